"""Building a NIXL agent for a data plane: UCX backend, event-driven progress, quiet logging.

NIXL's progress thread sleeps in ``poll()`` on the UCX worker's event fd when its ``pthrDelay``
is positive and wakes on traffic (or after the delay); the Python wrapper hard-codes
``pthrDelay=0``, which makes the thread spin a core. So the agent is built with the binding's own
config, swapped in for this agent's name only (docs/nixl-behaviour.md, section 5).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvcr.domain.errors import KvcrError
from kvcr.ports.errors import TransportError

if TYPE_CHECKING:
    from kvcr.adapters.nixl.probe import ZeroCopyReport

_build_lock = threading.Lock()


@contextlib.contextmanager
def nixl_errors(what: str, error: type[TransportError] = TransportError) -> Iterator[None]:
    """Turn whatever NIXL raises inside into ``error``, its message prefixed with ``what``.

    NIXL's Python API raises plain exceptions (its bindings' own types, RuntimeError, ValueError);
    no Python exception type may reach kvcr's callers, so every NIXL call that can only succeed
    or fail runs inside this. kvcr's own errors pass through unchanged.
    """
    try:
        yield
    except KvcrError:
        raise
    except Exception as exc:
        raise error(f"{what}: {exc}") from exc


def build_agent(
    name: str, params: dict[str, str], wake_s: float | None
) -> tuple[Any, Any, tuple[type[Exception], ...]]:
    """(agent, numpy, the NIXL errors that mean "the peer is gone"); no progress thread if ``wake_s`` is None.

    Raises:
        TransportError: NIXL is missing, or the agent or its UCX backend cannot be created.
    """
    from kvcr import compat

    compat.ensure_supported("nixl")  # an unsupported NIXL is one clear line at start-up, not a deep failure
    try:
        import numpy
        from nixl import _bindings
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise TransportError(f"NIXL is not installed (pip install nixl-cu13==1.5.1 --no-deps): {exc}") from exc
    _quiet_nixl_logging()
    with nixl_errors(f"cannot create NIXL agent {name!r} with UCX {params}"):
        config = nixl_agent_config(enable_prog_thread=wake_s is not None, enable_listen_thread=False, backends=[])
        if wake_s is None:
            agent = nixl_agent(name, config)
        else:
            raw = _bindings.nixlAgentConfig()
            raw.useProgThread = True
            raw.useListenThread = False
            raw.pthrDelay = round(wake_s * 1e6)
            with _build_lock:
                original = _bindings.nixlAgent

                def build(agent_name: str, agent_config: Any) -> Any:
                    # Only our agent gets our config: one built meanwhile by others keeps its own.
                    return original(agent_name, raw if agent_name == name else agent_config)

                _bindings.nixlAgent = build
                try:
                    agent = nixl_agent(name, config)
                finally:
                    _bindings.nixlAgent = original
        if "UCX" not in agent.get_plugin_list():
            raise TransportError("NIXL has no UCX plugin")
        agent.create_backend("UCX", params)
    peer_errors = (_bindings.nixlRemoteDisconnectError, _bindings.nixlNotFoundError)
    return agent, numpy, peer_errors


def _quiet_nixl_logging() -> None:
    """NIXL's wrapper logs INFO lines to *stdout* on every agent; keep warnings, unless told otherwise.

    A process whose stdout carries a protocol (a READY line, JSON) breaks on them. NIXL_LOG_LEVEL,
    NIXL's own switch, still wins when set.
    """
    if os.environ.get("NIXL_LOG_LEVEL"):
        return
    nixl_logger = logging.getLogger("nixl")
    if nixl_logger.getEffectiveLevel() < logging.WARNING:
        nixl_logger.setLevel(logging.WARNING)


_probe_lock = threading.Lock()
_probes: dict[tuple[object, ...], _Probe] = {}
_EXIT_WAIT_S = 15.0  # how long an exiting process waits for a probe still running (seconds over tcp)
_exit_hook: list[bool] = []


class _Probe:
    """One probe run: the first caller measures, everyone else waits for it (boundedly, if they must)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.report: ZeroCopyReport | None = None


def ucx_environment() -> tuple[str | None, str | None]:
    """The UCX settings an agent built now reads from the environment (they are read at build time)."""
    return os.environ.get("UCX_TLS"), os.environ.get("UCX_NET_DEVICES")


def transport_report(
    params: dict[str, str], environment: tuple[str | None, str | None], timeout_s: float | None = None
) -> ZeroCopyReport | None:
    """One zero-copy probe per process and transport setting: UCX's choice does not change in between.

    ``environment`` is :func:`ucx_environment` as it was when the asking agent was built: the probe
    answers for that agent even if the environment changed since (tests narrow ``UCX_TLS`` only
    while they build one agent; the probe must then have run before they widen it again). The
    probe takes a moment (seconds over tcp); ``timeout_s`` bounds the wait for one that is still
    running (None: wait for it), and None comes back if it has not finished by then.
    """
    from kvcr.adapters.nixl.probe import check_zero_copy

    key = (tuple(sorted(params.items())), *environment)
    with _probe_lock:
        probe = _probes.get(key)
        owner = probe is None
        if probe is None:
            probe = _probes[key] = _Probe()
            if not _exit_hook:
                _exit_hook.append(True)
                atexit.register(_wait_for_probes)
    if owner:
        try:
            probe.report = check_zero_copy(backend_params=params)  # never raises for a failed probe
        finally:
            if probe.report is None:  # it raised after all (a bug): let the next caller try again
                with _probe_lock:
                    _probes.pop(key, None)
            probe.done.set()
    elif not probe.done.wait(timeout_s):
        return None
    return probe.report


def _wait_for_probes() -> None:
    """At exit, let a running probe finish: a process that exits with it inside NIXL aborts (SIGABRT)."""
    deadline = time.monotonic() + _EXIT_WAIT_S
    with _probe_lock:
        running = [p for p in _probes.values() if not p.done.is_set()]
    for probe in running:
        probe.done.wait(max(0.0, deadline - time.monotonic()))
