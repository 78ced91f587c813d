"""Ports for child listeners come from outside the kernel's ephemeral range and never repeat."""

from __future__ import annotations

import socket
from pathlib import Path

from kvcr.demo.dynamo.deployment import free_system_port
from kvcr.testing.ports import ephemeral_range, free_port_block


def test_the_ephemeral_range_is_read_from_the_kernel_file(tmp_path: Path) -> None:
    path = tmp_path / "range"
    path.write_text("40000\t50000\n")
    assert ephemeral_range(path) == (40000, 50000)
    path.write_text("garbage")
    assert ephemeral_range(path) == (32768, 60999)
    assert ephemeral_range(tmp_path / "absent") == (32768, 60999)


def test_ports_are_outside_the_ephemeral_range_and_never_handed_out_twice() -> None:
    first, last = ephemeral_range()
    seen: set[int] = set()
    for _ in range(300):
        start = free_port_block(3)
        block = set(range(start, start + 3))
        assert block.isdisjoint(seen)
        assert all(not first <= port <= last for port in block)
        seen |= block


def test_a_handed_out_port_is_free_to_bind() -> None:
    port = free_port_block()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()


def test_dynamos_system_port_fits_an_i16() -> None:
    assert all(free_system_port() < 32768 for _ in range(50))
