"""Second-preimage forgery for XXH3-128 (seed 0, default secret) on long inputs.

XXH3 is a fast non-cryptographic hash: this module shows concretely that anyone who can write page bytes
can produce a different page with the same ``xxhash.xxh3_128`` digest.

How it works (XXH3 long-input accumulate loop, inputs > 240 bytes): the input is consumed in 64-byte stripes,
16 stripes per 1024-byte block with the 192-byte ``XXH3_kSecret``; after each full block the accumulators are
scrambled. For stripe ``n`` of a block and lane ``i`` (0..7)::

    val = le64(stripe + 8*i);  key = val ^ le64(kSecret + 8*n + 8*i)
    acc[i ^ 1] += val;  acc[i] += lo32(key) * hi32(key)        (mod 2**64)

Before the scramble only the per-block sums matter, so we rewrite lanes ``(i, i^1)`` of two stripes ``s`` and
``t`` of one full block so that both sums stay the same. In stripe ``s`` we force ``lo32(key) == 0`` (product 0),
in stripe ``t`` ``lo32(key) == 1`` (product ``hi32(key)``). That leaves four free 32-bit high halves and four
32-bit equations, which solve directly (no search): the low halves of the two sums fix stripe ``t``'s high
halves, and the high halves then fix stripe ``s``'s. The result is always checked against the real library.
"""

from __future__ import annotations

import struct

import xxhash

__all__ = ["KSECRET", "xxh3_128_second_preimage"]

#: ``XXH3_kSecret`` from xxhash.h (192 bytes, "taken directly from FARSH").
KSECRET: bytes = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95161628afd77bb14b7f3f99"
)
assert len(KSECRET) == 192

_STRIPE = 64
_STRIPES_PER_BLOCK = (len(KSECRET) - _STRIPE) // 8  # 16
_BLOCK = _STRIPE * _STRIPES_PER_BLOCK  # 1024
_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF


def _mul(key: int) -> int:
    """XXH_mult32to64(lo32(key), hi32(key))."""
    return (key & _M32) * (key >> 32)


def _solve(vals: tuple[int, int, int, int], keys: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """Return new lane values (s_i, s_j, t_i, t_j) with the same contributions to acc[i] and acc[j=i^1].

    ``vals``/``keys`` are the original lane values and secret words, in the order (s_i, s_j, t_i, t_j).
    """
    a0, a1, c0, c1 = vals
    ks0, ks1, kt0, kt1 = keys
    sum_i = (a1 + _mul(a0 ^ ks0) + c1 + _mul(c0 ^ kt0)) & _M64  # final contribution to acc[i]
    sum_j = (a0 + _mul(a1 ^ ks1) + c0 + _mul(c1 ^ kt1)) & _M64  # final contribution to acc[i^1]
    ls0, ls1 = ks0 & _M32, ks1 & _M32  # stripe s: lo32(val) = lo32(secret) -> lo32(key) = 0 -> product 0
    lt0, lt1 = (kt0 & _M32) ^ 1, (kt1 & _M32) ^ 1  # stripe t: lo32(key) = 1 -> product = hi32(key)
    ht0, ht1 = kt0 >> 32, kt1 >> 32
    # acc[i]:   (v<<32|ls1) + (y<<32|lt1) + (x ^ ht0) == sum_i ;  acc[j]: (u<<32|ls0) + (x<<32|lt0) + (y ^ ht1) == sum_j
    x = ((sum_i - ls1 - lt1) & _M32) ^ ht0
    y = ((sum_j - ls0 - lt0) & _M32) ^ ht1
    carry_i = (ls1 + lt1 + (x ^ ht0)) >> 32
    carry_j = (ls0 + lt0 + (y ^ ht1)) >> 32
    v = ((sum_i >> 32) - y - carry_i) & _M32
    u = ((sum_j >> 32) - x - carry_j) & _M32
    return (u << 32) | ls0, (v << 32) | ls1, (x << 32) | lt0, (y << 32) | lt1


def xxh3_128_second_preimage(data: bytes, *, start: int = 0) -> bytes:
    """Return ``forged != data``, same length, with ``xxh3_128(forged).digest() == xxh3_128(data).digest()``.

    Only bytes of the first full 1024-byte block (block boundaries counted from offset 0 of ``data``) that begins
    at or after ``start`` are changed: two of its 64-byte stripes, 16 bytes each. That block must be a full block
    of the accumulate loop and must end before the final 64-byte stripe, otherwise ``ValueError`` is raised.
    Assumes seed 0 and the default secret, i.e. plain ``xxhash.xxh3_128(data)``.
    """
    length = len(data)
    if start < 0:
        raise ValueError("start must be >= 0")
    if length <= 240:
        raise ValueError("input too short for the XXH3 long-input path")
    block = -(-start // _BLOCK)
    base = block * _BLOCK
    if block >= (length - 1) // _BLOCK or base + _BLOCK > length - _STRIPE:
        raise ValueError(f"no full block at or after offset {start} clear of the tail for length {length}")
    target = xxhash.xxh3_128(data).digest()
    for lane in range(0, 8, 2):
        for s in range(_STRIPES_PER_BLOCK):
            for t in range(_STRIPES_PER_BLOCK):
                if s == t:
                    continue
                offs = (base + s * _STRIPE + 8 * lane, base + t * _STRIPE + 8 * lane)
                old = struct.unpack_from("<QQ", data, offs[0]) + struct.unpack_from("<QQ", data, offs[1])
                keys = struct.unpack_from("<QQ", KSECRET, 8 * (s + lane)) + struct.unpack_from(
                    "<QQ", KSECRET, 8 * (t + lane)
                )
                new = _solve(old, keys)
                if new == old:
                    continue  # data already has this exact shape (e.g. it is itself a forgery); try elsewhere
                forged = bytearray(data)
                struct.pack_into("<QQ", forged, offs[0], new[0], new[1])
                struct.pack_into("<QQ", forged, offs[1], new[2], new[3])
                result = bytes(forged)
                if result == data or xxhash.xxh3_128(result).digest() != target:
                    raise ValueError("forgery did not verify against xxhash (model mismatch?)")
                return result
    raise ValueError("no forgery found")
