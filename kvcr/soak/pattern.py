"""Page keys and page bytes that every process can rebuild from the key alone.

A soak or fault run checks every restored page against ``page_words(key, seed)``: words
``i * mul + add`` (mod 2**32) with ``mul`` (odd) and ``add`` taken from a digest of the seed and the
key. Two different pages therefore agree in at most a handful of words, a page shifted by any
number of words does not match itself, and a restarted source can hold different bytes under the
same keys (another ``seed``). ``POISON`` marks host pages after a call returned, so a byte that
lands later is seen.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

POISON = 0xA5


def page_key(prompt: int, page: int, space: str = "soak") -> str:
    """A 64-hex page key (the shape of SGLang's page hashes) for page ``page`` of prompt ``prompt``."""
    return hashlib.sha256(f"{space}/{prompt}/{page}".encode()).hexdigest()


def prompt_keys(prompt: int, pages: int, space: str = "soak") -> list[str]:
    return [page_key(prompt, i, space) for i in range(pages)]


def page_words(key: str, seed: int, nbytes: int) -> Any:
    """The page's bytes as uint32 words (``nbytes`` must be a multiple of 4)."""
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    mul = np.uint32(int.from_bytes(digest[:4], "little") | 1)
    add = np.uint32(int.from_bytes(digest[4:], "little"))
    return np.arange(nbytes // 4, dtype=np.uint32) * mul + add


class PageView:
    """Pages of an SGLang ``page_first`` MHA host pool as numpy bytes: K half, then V half.

    ``kv_buffer`` has shape (2, tokens, layers, heads, dim); a page's tokens are contiguous within
    each of the K and V planes, so a page is two contiguous byte ranges.
    """

    def __init__(self, host: Any, page_tokens: int) -> None:
        import torch

        planes = host.kv_buffer.view(torch.uint8).numpy()  # shares the pool's memory
        self._planes = [planes[0].reshape(-1), planes[1].reshape(-1)]
        self.half = planes[0].reshape(-1).size // (host.size // page_tokens)
        self.page_bytes = 2 * self.half
        self.pages = host.size // page_tokens

    def _halves(self, slot: int) -> tuple[Any, Any]:
        start = slot * self.half
        return self._planes[0][start : start + self.half], self._planes[1][start : start + self.half]

    def write(self, slot: int, key: str, seed: int) -> None:
        data = page_words(key, seed, self.page_bytes).view(np.uint8)
        k, v = self._halves(slot)
        k[:] = data[: self.half]
        v[:] = data[self.half :]

    def wrong_bytes(self, slot: int, key: str, seed: int) -> int:
        """How many of the page's bytes differ from the key's pattern (0: the page is right)."""
        data = page_words(key, seed, self.page_bytes).view(np.uint8)
        k, v = self._halves(slot)
        return int(np.count_nonzero(k != data[: self.half]) + np.count_nonzero(v != data[self.half :]))

    def poison(self, slot: int) -> None:
        for half in self._halves(slot):
            half[:] = POISON

    def unpoisoned(self, slot: int) -> int:
        """Bytes of a poisoned page that changed since (0: nothing landed)."""
        return sum(int(np.count_nonzero(half != POISON)) for half in self._halves(slot))
