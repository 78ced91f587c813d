"""ucxx as this adapter uses it: imported on first use, with the environment left as it was.

Importing ``ucxx`` writes UCX settings into ``os.environ`` (``UCX_RNDV_THRESH``,
``UCX_RNDV_FRAG_MEM_TYPE=cuda``, ``UCX_MAX_RNDV_RAILS``, ``UCX_MEMTYPE_CACHE``). Those would
reach every UCX context created afterwards in this process -- NIXL's too -- and every child
process, so :func:`load` removes what the import added; our own UCX options go to our context
alone, through its config map.

ucxx 0.52 has no per-request cancel in Python (only "cancel everything in flight on this worker
or endpoint", or dropping the last reference, after which the request can no longer be
observed). The C++ ``ucxx::Request::cancel()`` it wraps is exported by ``libucxx.so``;
:meth:`Binding.cancel` calls it on the request a ``UCXRequest`` holds. It is
``ucp_request_cancel``: a tag receive not yet matched completes at once with
``UCS_ERR_CANCELED`` (nothing was written), a matched one runs to its end.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvcr.ports.errors import TransportError

INSTALL_HINT = (
    "pip install --no-deps ucxx-cu12==0.52.0 libucxx-cu12==0.52.0 libucx-cu12==1.21.0 "
    "librmm-cu12==26.10.0 rapids-logger==0.3.0 (see scripts/install.sh)"
)
STATUS_OK = 0
STATUS_IN_PROGRESS = 1
STATUS_CANCELED = -16  # UCS_ERR_CANCELED


@dataclass(frozen=True, slots=True)
class Binding:
    """The pieces of ucxx this adapter calls, loaded once per process."""

    lib: Any  # ucxx._lib.libucxx
    array: Any  # ucxx._lib.arr.Array
    _cancel: Any  # ucxx::Request::cancel(), a ctypes function of one pointer
    ucx_version: tuple[int, int, int]

    def tag(self, value: int) -> Any:
        return self.lib.UCXXTag(value)

    def mask(self, value: int) -> Any:
        return self.lib.UCXXTagMask(value)

    def view(self, address: int, nbytes: int) -> Any:
        """A ucxx array over ``nbytes`` of memory at ``address`` (no copy, no ownership)."""
        return self.array((ctypes.c_char * nbytes).from_address(address))

    def cancel(self, request: Any) -> None:
        """Cancel one ucxx request (see the module doc); a completed one is left alone."""
        self._cancel(request.ucxx_ptr)

    def close(self, endpoint: Any) -> Any:
        """Start closing ``endpoint`` without waiting; the close request, or None.

        Not ``close_blocking``: with error handling off it flushes, spinning the worker until a
        peer that may be gone answers. For an endpoint that failed or closes already, ucxx
        returns a request over a null pointer, and touching it -- even freeing it, which
        cancels it -- crashes the process, at exit too; such a request gets one reference
        more than anyone will drop, so it is never freed.
        """
        request = endpoint.close()
        if request.ucxx_ptr:
            return request
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(request))
        return None

    def context(self, options: Mapping[str, str]) -> tuple[Any, bool]:
        """A UCX context for ``options``, and whether it has a registration cache.

        UCX keeps a context's registration cache up to date through libucm's memory hooks. Two
        UCX builds in one process (NIXL bundles its own) each hook libc; when the other one
        hooked after ours, a context made from then on gets no cache, which UCX only says at
        ``diag`` level. So the first try requires one (``RCACHE_ENABLE=y`` makes ``ucp_init``
        fail without it); only if that fails is the context made without.
        """
        lib = self.lib
        flags = (lib.Feature.TAG, lib.Feature.WAKEUP)
        try:
            return lib.UCXContext(config_dict={**options, "RCACHE_ENABLE": "y"}, feature_flags=flags), True
        except Exception:  # no cache can be made here; any other fault shows again just below
            return lib.UCXContext(config_dict=dict(options), feature_flags=flags), False

    def worker(self, context: Any) -> Any:
        worker = self.lib.UCXWorker(context, enable_delayed_submission=False, enable_python_future=False)
        worker.init_blocking_progress_mode()
        return worker

    def address(self, data: bytes) -> Any:
        return self.lib.UCXAddress.create_from_buffer(data)


_lock = threading.Lock()
_binding: Binding | None = None


def load() -> Binding:
    """Import ucxx (once) and bind ``ucxx::Request::cancel``.

    Raises:
        TransportError: ucxx is missing or is not the build this adapter knows.
    """
    global _binding
    with _lock:
        if _binding is not None:
            return _binding
        with _environment_kept():
            try:
                lib = importlib.import_module("ucxx._lib.libucxx")
                array = importlib.import_module("ucxx._lib.arr").Array
                libucxx = importlib.import_module("libucxx")
            except ImportError as exc:
                raise TransportError(f"ucxx is not installed ({INSTALL_HINT}): {exc}") from exc
        path = os.path.join(os.path.dirname(str(libucxx.__file__)), "lib64", "libucxx.so")
        try:
            cancel = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)._ZN4ucxx7Request6cancelEv
        except (OSError, AttributeError) as exc:
            raise TransportError(f"cannot bind ucxx::Request::cancel in {path}: {exc}") from exc
        cancel.argtypes = [ctypes.c_void_p]
        cancel.restype = None
        version = tuple(int(v) for v in lib.get_ucx_version())
        _binding = Binding(lib, array, cancel, (version[0], version[1], version[2]))
        return _binding


@contextlib.contextmanager
def _environment_kept() -> Iterator[None]:
    before = {k: v for k, v in os.environ.items() if k.startswith("UCX")}
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("UCX") and k not in before]:
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
