"""Adapters: concrete implementations of the ports. They never import each other."""
