"""Replica processes and helpers that kvcr's tests, benchmarks and demo start.

They ship with the package so ``python -m kvcr.testing.replica`` (a runner node over NIXL + ZMQ
holding known pages) and ``python -m kvcr.testing.sglang_replica`` (an SGLang replica with kvcr as
its HiCache backend) run the same way from a checkout and from an installed wheel.
"""
