"""One raw NIXL agent in its own process, driven by JSON lines on stdin (probe tool, not kvcr code).

The probes in this folder start two or three of these (a source, a target, an attacker), so that
each agent has its own process and UCX worker, as on a real fabric, and a probe can SIGKILL or
SIGSTOP one of them, or put it into a network namespace. Answers are the stdout lines that start
with ``@@ `` (NIXL prints its own INFO lines on stdout too). Every NIXL call is made under one lock
because the optional pump thread progresses the same agent.

Commands (``{"cmd": ..., **args}``): see the ``_Worker`` methods named ``do_<cmd>``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import sys
import threading
import time
from typing import Any

import numpy as np

logging.getLogger("nixl").setLevel(logging.WARNING)

_STATE = {"DONE": "DONE", "PROC": "PROC", "ERR": "ERR"}


class _Buffer:
    """A buffer the probes read from or into; memfd ones also have a read-only second mapping."""

    def __init__(self, size: int, mode: str) -> None:
        self.size = size
        self.ro_map: mmap.mmap | None = None
        if mode == "memfd":
            self.fd = os.memfd_create("kvcr-probe")
            os.ftruncate(self.fd, size)
            self.rw_map = mmap.mmap(self.fd, size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self.ro_map = mmap.mmap(self.fd, size, prot=mmap.PROT_READ)
            self.array = np.frombuffer(self.rw_map, dtype=np.uint8)
            self.ro_addr = _address_of(self.ro_map)
        else:
            self.array = np.zeros(size, dtype=np.uint8)
            self.ro_addr = 0
        self.addr = int(self.array.ctypes.data)


def _address_of(view: mmap.mmap) -> int:
    """Address of a read-only mmap (ctypes refuses from_buffer on it, so ask numpy)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class _Worker:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.agent: Any = None
        self.buffers: dict[str, _Buffer] = {}
        self.regs: dict[str, tuple[Any, int, int]] = {}
        self.xfers: dict[int, Any] = {}
        self.next_id = 1
        self.pump_stop: threading.Event | None = None
        self.pump_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ set-up
    def do_init(
        self,
        name: str,
        params: dict[str, str] | None = None,
        prog_thread: bool = False,
        pthr_delay_us: int | None = None,
    ) -> dict[str, Any]:
        from nixl import _bindings
        from nixl._api import nixl_agent, nixl_agent_config

        config = nixl_agent_config(enable_prog_thread=prog_thread, enable_listen_thread=False, backends=[])
        if pthr_delay_us is not None:
            # The wrapper hard-codes pthrDelay=0; build the agent through the binding ourselves.
            raw = _bindings.nixlAgentConfig()
            raw.useProgThread = prog_thread
            raw.useListenThread = False
            raw.pthrDelay = pthr_delay_us
            original = _bindings.nixlAgent

            def patched(agent_name: str, _ignored: Any) -> Any:
                return original(agent_name, raw)

            _bindings.nixlAgent = patched
            try:
                self.agent = nixl_agent(name, config)
            finally:
                _bindings.nixlAgent = original
        else:
            self.agent = nixl_agent(name, config)
        self.agent.create_backend("UCX", params or {})
        return {"pid": os.getpid()}

    def do_alloc(
        self, label: str, size: int, seed: int | None = None, byte: int | None = None, mode: str = "numpy"
    ) -> dict[str, Any]:
        buf = _Buffer(size, mode)
        if seed is not None:
            buf.array[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        elif byte is not None:
            buf.array[:] = byte
        self.buffers[label] = buf
        return {"addr": buf.addr, "ro_addr": buf.ro_addr}

    def do_register(
        self, reg: str, label: str, offset: int = 0, length: int | None = None, view: str = "rw"
    ) -> dict[str, Any]:
        buf = self.buffers[label]
        base = (buf.ro_addr if view == "ro" else buf.addr) + offset
        nbytes = buf.size - offset if length is None else length
        with self.lock:
            handle = self.agent.register_memory([(base, nbytes, 0, "")], "DRAM")
        self.regs[reg] = (handle, base, nbytes)
        return {"addr": base, "len": nbytes}

    def do_deregister(self, reg: str) -> dict[str, Any]:
        handle, _, _ = self.regs.pop(reg)
        with self.lock:
            self.agent.deregister_memory(handle)
        return {}

    def do_md(self, regs: list[str] | None = None) -> dict[str, Any]:
        with self.lock:
            if regs is None:
                md = self.agent.get_agent_metadata()
            else:
                rows = [(self.regs[r][1], self.regs[r][2], 0, "") for r in regs]
                descs = self.agent.get_reg_descs(rows, "DRAM")
                md = self.agent.get_partial_agent_metadata(descs, inc_conn_info=True)
        return {"md": bytes(md).hex()}

    def do_load(self, md: str) -> dict[str, Any]:
        with self.lock:
            name = self.agent.add_remote_agent(bytes.fromhex(md))
        return {"name": name.decode() if isinstance(name, bytes) else str(name)}

    def do_remove(self, name: str) -> dict[str, Any]:
        t0 = time.monotonic()
        with self.lock:
            self.agent.remove_remote_agent(name)
        return {"s": time.monotonic() - t0}

    # ------------------------------------------------------------------ transfers
    def do_xfer(
        self, op: str, peer: str, local: list[list[Any]], remote: list[list[int]], mode: str = "init"
    ) -> dict[str, Any]:
        """Post one transfer; ``local`` rows are [buffer label, offset, length], ``remote`` [addr, len]."""
        lrows = [[self.buffers[lab].addr + off, n, 0] for lab, off, n in local]
        t0 = time.monotonic()
        with self.lock:
            agent = self.agent
            if mode == "prep":
                lside = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array(lrows, dtype=np.uint64), "DRAM")
                rside = agent.prep_xfer_dlist(peer, np.array([[a, n, 0] for a, n in remote], dtype=np.uint64), "DRAM")
                idx = list(range(len(lrows)))
                xfer = agent.make_prepped_xfer(op, lside, idx, rside, idx)
            else:
                ldescs = agent.get_xfer_descs(np.array(lrows, dtype=np.uint64), "DRAM")
                rdescs = agent.get_xfer_descs(np.array([[a, n, 0] for a, n in remote], dtype=np.uint64), "DRAM")
                xfer = agent.initialize_xfer(op, ldescs, rdescs, peer)
            status = agent.transfer(xfer)
        xid = self.next_id
        self.next_id += 1
        self.xfers[xid] = xfer
        return {"id": xid, "status": status, "post_s": time.monotonic() - t0}

    def do_state(self, id: int) -> dict[str, Any]:
        with self.lock:
            return {"state": self.agent.check_xfer_state(self.xfers[id])}

    def do_wait(self, id: int, limit: float = 10.0, sleep: float = 0.0002) -> dict[str, Any]:
        t0 = time.monotonic()
        state = "PROC"
        while time.monotonic() - t0 < limit:
            with self.lock:
                state = self.agent.check_xfer_state(self.xfers[id])
            if state != "PROC":
                break
            time.sleep(sleep)
        return {"state": state, "s": time.monotonic() - t0}

    def do_release(self, id: int) -> dict[str, Any]:
        xfer = self.xfers.pop(id)
        t0 = time.monotonic()
        with self.lock:
            xfer.release()
        return {"s": time.monotonic() - t0}

    def do_progress(self, n: int = 1, seconds: float = 0.0) -> dict[str, Any]:
        t_end = time.monotonic() + seconds
        count = 0
        while count < n or time.monotonic() < t_end:
            with self.lock:
                self.agent.get_new_notifs()
            count += 1
            if seconds:
                time.sleep(0.001)
        return {"n": count}

    def do_pump(self, interval: float) -> dict[str, Any]:
        if self.pump_stop is not None:
            self.pump_stop.set()
            assert self.pump_thread is not None
            self.pump_thread.join()
            self.pump_stop = self.pump_thread = None
        if interval > 0:
            stop = self.pump_stop = threading.Event()

            def run() -> None:
                while not stop.wait(interval):
                    with self.lock, contextlib.suppress(Exception):
                        self.agent.get_new_notifs()

            self.pump_thread = threading.Thread(target=run, daemon=True)
            self.pump_thread.start()
        return {}

    # ------------------------------------------------------------------ memory checks
    def do_digest(self, label: str, offset: int = 0, length: int | None = None) -> dict[str, Any]:
        buf = self.buffers[label]
        view = buf.array[offset : buf.size if length is None else offset + length]
        return {
            "sha1": hashlib.sha1(view.tobytes()).hexdigest(),
            "nonzero": int(np.count_nonzero(view)),
            "first": int(view[0]) if view.size else -1,
        }

    def do_fill(self, label: str, byte: int, offset: int = 0, length: int | None = None) -> dict[str, Any]:
        buf = self.buffers[label]
        buf.array[offset : buf.size if length is None else offset + length] = byte
        return {}

    def do_seed(self, label: str, seed: int) -> dict[str, Any]:
        buf = self.buffers[label]
        buf.array[:] = np.random.default_rng(seed).integers(0, 256, buf.size, dtype=np.uint8)
        return {}

    def do_count(self, label: str, byte: int, offset: int = 0, length: int | None = None) -> dict[str, Any]:
        """How many bytes of a buffer differ from ``byte`` (a poison check)."""
        buf = self.buffers[label]
        view = buf.array[offset : buf.size if length is None else offset + length]
        return {"differ": int(np.count_nonzero(view != byte))}

    def do_cpu(self) -> dict[str, Any]:
        with open(f"/proc/{os.getpid()}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return {"ticks": int(fields[11]) + int(fields[12]), "hz": os.sysconf("SC_CLK_TCK")}

    def do_destroy(self) -> dict[str, Any]:
        """Drop every transfer handle and the agent itself (its UCX worker and endpoints go too)."""
        import gc

        t0 = time.monotonic()
        self.do_pump(0)
        with self.lock:
            self.xfers.clear()
            self.regs.clear()
            self.agent = None
            gc.collect()
        return {"s": time.monotonic() - t0}

    def do_sleep(self, s: float) -> dict[str, Any]:
        time.sleep(s)
        return {}

    def do_quit(self) -> dict[str, Any]:
        sys.stdout.flush()
        os._exit(0)


def main() -> None:
    worker = _Worker()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        cmd = request.pop("cmd")
        try:
            answer: dict[str, Any] = {"ok": True, **getattr(worker, f"do_{cmd}")(**request)}
        except Exception as exc:
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write("@@ " + json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
