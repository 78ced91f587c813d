"""Integrations with serving systems; they may import anything and build from the container."""
