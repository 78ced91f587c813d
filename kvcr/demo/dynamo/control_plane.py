"""Dynamo's production control plane on one machine: etcd (discovery) and NATS (an event plane).

Dynamo 1.6.x discovers workers through etcd by default (``--discovery-backend etcd``; it reads
``ETCD_ENDPOINTS``), and carries KV events on its zmq event plane with every discovery backend
unless ``--event-plane nats`` is asked for (then it reads ``NATS_SERVER``). ``ControlPlane``
starts the servers a deployment asks for as child processes, from the binaries on ``PATH``
(Debian's ``etcd-server`` 3.4 and ``nats-server`` 2.9, which ``scripts/install.sh`` installs),
each on free loopback ports with its data in the deployment's work directory, and stops them at
``close``. ``missing`` says in one line which binary is absent, for a demo that cannot start.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

from kvcr.testing.ports import free_port_block

LOOPBACK = "127.0.0.1"
DISCOVERY_BACKENDS = ("file", "etcd")
EVENT_PLANES = ("zmq", "nats")
_BINARIES = {"etcd": ("etcd", "Debian package etcd-server"), "nats": ("nats-server", "Debian package nats-server")}


class ControlPlaneError(RuntimeError):
    """A control-plane server is missing, did not start or died; the message says which."""


def binary(server: str) -> str | None:
    """Where a server's binary is: on PATH, or in /usr/sbin (Debian puts nats-server there)."""
    name = _BINARIES[server][0]
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")


def missing(discovery: str, event_plane: str) -> str | None:
    """One line naming the binary a (discovery, event plane) choice needs and this machine lacks."""
    for wanted, server in ((discovery == "etcd", "etcd"), (event_plane == "nats", "nats")):
        name, package = _BINARIES[server]
        if wanted and binary(server) is None:
            return f"{name} is not installed (the {package}; scripts/install.sh installs it when run as root)"
    return None


@dataclass
class ControlPlane:
    """etcd and/or NATS for one deployment (a context manager); ``env`` is what Dynamo's processes read."""

    workdir: Path
    etcd: bool = True
    nats: bool = False
    host: str = LOOPBACK  # the address both listen on
    start_timeout_s: float = 30.0
    etcd_url: str = field(default="", init=False)
    nats_url: str = field(default="", init=False)
    _children: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, init=False)
    _logs: list[IO[bytes]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        problem = missing("etcd" if self.etcd else "file", "nats" if self.nats else "zmq")
        if problem:
            raise ControlPlaneError(problem)

    def start(self) -> ControlPlane:
        """Start the servers and wait until each answers (ControlPlaneError, with its log, if not)."""
        try:
            if self.etcd:
                self._start_etcd()
            if self.nats:
                self._start_nats()
        except BaseException:
            self.close()
            raise
        return self

    def env(self) -> dict[str, str]:
        """The variables Dynamo 1.6.x reads for these servers."""
        env = {}
        if self.etcd_url:
            env["ETCD_ENDPOINTS"] = self.etcd_url
        if self.nats_url:
            env["NATS_SERVER"] = self.nats_url
        return env

    # ------------------------------------------------------------------ etcd

    def _start_etcd(self, client: int | None = None) -> None:
        client, peer = client or free_port_block(), free_port_block()
        self.etcd_url = f"http://{self.host}:{client}"
        peer_url = f"http://{self.host}:{peer}"
        args = [
            str(binary("etcd")),
            "--name", "kvcr-demo",
            "--data-dir", str(self.workdir / "etcd-data"),
            "--listen-client-urls", self.etcd_url,
            "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"kvcr-demo={peer_url}",
        ]  # fmt: skip
        self._spawn("etcd", args)
        self._wait("etcd", lambda: _etcd_healthy(self.etcd_url))

    # ------------------------------------------------------------------ NATS

    def _start_nats(self, port: int | None = None) -> None:
        port = port or free_port_block()
        self.nats_url = f"nats://{self.host}:{port}"
        # JetStream on: Dynamo's NATS event plane may use streams; its store stays in the workdir.
        args = [str(binary("nats")), "-a", self.host, "-p", str(port), "-js", "-sd", str(self.workdir / "nats-data")]
        self._spawn("nats", args)
        self._wait("nats", lambda: _nats_greets(self.host, port))

    # ------------------------------------------------------------------ outages

    def stop(self, server: str) -> None:
        """Stop ``etcd`` or ``nats`` now (an outage); ``restart`` brings it back at the same address and data."""
        self._stop(server)

    def restart(self, server: str) -> None:
        """Start a stopped server again on its old port (the clients keep their address)."""
        if server in self._children:
            return
        if server == "etcd" and self.etcd_url:
            self._start_etcd(int(self.etcd_url.rsplit(":", 1)[1]))
        elif server == "nats" and self.nats_url:
            self._start_nats(int(self.nats_url.rsplit(":", 1)[1]))

    # ------------------------------------------------------------------ processes

    def _spawn(self, name: str, args: list[str]) -> None:
        handle = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 (closed in close)
        self._logs.append(handle)
        self._children[name] = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )

    def _wait(self, name: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        child = self._children[name]
        while not ready():
            if child.poll() is not None or time.monotonic() > deadline:
                log = self.workdir / f"{name}.log"
                tail = log.read_text(errors="replace").splitlines()[-10:] if log.exists() else []
                state = f"exited ({child.returncode})" if child.poll() is not None else "did not answer"
                raise ControlPlaneError(f"{name} {state}; its log {log}: " + " | ".join(tail))
            time.sleep(0.1)

    def _stop(self, name: str) -> None:
        child = self._children.pop(name, None)
        if child is None or child.poll() is not None:
            return
        os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(10)

    def close(self) -> None:
        for name in list(self._children):
            self._stop(name)
        for handle in self._logs:
            handle.close()
        self._logs.clear()

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _etcd_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as reply:
            return b'"health":"true"' in reply.read()
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _nats_greets(host: str, port: int) -> bool:
    """NATS sends ``INFO {...}`` to every client that connects."""
    try:
        with socket.create_connection((host, port), timeout=1) as sock:
            return sock.recv(4).startswith(b"INFO")
    except OSError:
        return False
