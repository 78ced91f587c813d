"""The shm plane's streaming copy (a C extension built at install): exact bytes at every size and
alignment, and arguments it cannot use are refused, never copied."""

import ctypes
import os
import platform

import pytest

from kvcr.adapters.shm import _stream

# around each path of the copy: a plain copy below a page, whole four-page groups, single lines, a tail
SIZES = [0, 1, 15, 63, 64, 65, 4095, 4096, 4097, 4096 + 63, 3 * 4096 + 100, 65536 + 17]
SIZES += [3 * 16384 + 4095 + 64 * 5 + 7, (1 << 20) + 5]


def _buffers(n):
    src = ctypes.create_string_buffer(os.urandom(n + 128), n + 128)
    dst = ctypes.create_string_buffer(n + 128)
    return src, dst


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(("src_shift", "dst_shift"), [(0, 0), (1, 0), (0, 7), (13, 61)])
def test_copies_exactly_the_bytes_asked_at_any_alignment(size, src_shift, dst_shift):
    src, dst = _buffers(size)
    canary = bytes(dst.raw)
    _stream.copy(ctypes.addressof(dst) + dst_shift, ctypes.addressof(src) + src_shift, size)
    got = dst.raw
    assert got[dst_shift : dst_shift + size] == src.raw[src_shift : src_shift + size]
    assert got[:dst_shift] == canary[:dst_shift]  # nothing before the destination range
    assert got[dst_shift + size :] == canary[dst_shift + size :]  # nor after it


def test_this_build_streams_on_x86_64():
    assert (1 if platform.machine() in ("x86_64", "AMD64") else 0) == _stream.STREAMS


def test_arguments_it_cannot_use_are_refused():
    src, dst = _buffers(64)
    with pytest.raises(ValueError, match="negative"):
        _stream.copy(ctypes.addressof(dst), ctypes.addressof(src), -1)
    with pytest.raises(ValueError, match="null address"):
        _stream.copy(0, ctypes.addressof(src), 8)
    with pytest.raises(TypeError, match="3 arguments"):
        _stream.copy(ctypes.addressof(dst), ctypes.addressof(src))
    with pytest.raises(TypeError):
        _stream.copy("dst", ctypes.addressof(src), 8)
    _stream.copy(0, 0, 0)  # nothing to copy: no address is touched
