"""The token ids of the pages SGLang backs up, so that kvcr's KV events can carry them.

Dynamo's indexer places a stored block by hashing the block's token ids (its own xxh3 local
hash), so a ``BlockStored`` event without them cannot be indexed. SGLang's storage calls
(``batch_set_v1``) carry only page hashes; kvcr's SGLang plugin therefore records each page's
token ids here, on the backup thread, right before SGLang hands those pages to storage, under
the very keys the backend receives. The Dynamo inventory sink looks them up when the runner
reports the pages stored.

A page's tokens are accepted only if they are really that page's: SGLang's chained SHA-256 of
the tokens, over the previous page's key, must give the page's key. That also tells where the
page hangs (its parent key), which the router needs as much as the tokens. The first page of a
backup is checked against ``prior_hash`` when SGLang passed the prefix keys
(``hicache_storage_pass_prefix_keys``), or against an unchained (root) hash; failing both, its
tokens are kept only when the token list is exactly as long as the pages (so the pairing cannot
be shifted), but its parent is then unknown (``placed`` False). Pages that do not check out are
not recorded and are left out of the events: no hint is better than a wrong one.

Bounded: at most ``max_tokens`` token ids are kept and the oldest pages go first; a page needs
its tokens only between its backup call and the runner's STORED event, moments later.
This module imports nothing from SGLang or Dynamo.
"""

from __future__ import annotations

import logging
import struct
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvcr.domain.errors import InvalidKeyError
from kvcr.domain.keys import check_page_hash, page_hash

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 1 << 22  # 4 Mi token ids: 32 MiB of int64


@dataclass(frozen=True, slots=True)
class CapturedPage:
    """A backed-up page's token ids and its parent page's key (None: a root page).

    ``placed`` is False when the tokens are certain but the parent could not be established.
    """

    tokens: list[int]
    parent: str | None
    placed: bool


_Stored = tuple["array[int]", str | None, bool]


class PageTokenRegistry:
    """Page hash -> token ids of that page, bounded by a total number of tokens. Thread-safe.

    ``record`` does nothing until ``enable`` was called (a backend that publishes KV events does
    that), so the SGLang hook costs nothing in a process that publishes none.
    """

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self._max_tokens = max_tokens
        self._pages: OrderedDict[str, _Stored] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        self._enabled = False
        self._recorded = 0
        self._refused = 0

    @property
    def enabled(self) -> bool:
        return self._enabled

    def enable(self) -> None:
        self._enabled = True

    def record(
        self, page_hashes: Sequence[str], token_ids: Any, page_size: int, *, prior_hash: str | None = None
    ) -> int:
        """Remember the tokens of each page of a backup; returns how many pages were recorded.

        Args:
            page_hashes: the storage keys of consecutive pages, in prefix order.
            token_ids: the pages' token ids from the first page on (list, ``array`` or tensor).
            page_size: tokens per page.
            prior_hash: the key of the page before the first one, when known.
        """
        if not self._enabled or not page_hashes:
            return 0
        try:
            tokens = _int_list(token_ids)
        except (TypeError, ValueError):
            return self._refuse(len(page_hashes), "token ids are not integers")
        count = len(page_hashes)
        if page_size <= 0 or len(tokens) < count * page_size:
            return self._refuse(count, f"{len(tokens)} tokens cannot fill {count} pages of {page_size}")
        exact = len(tokens) == count * page_size
        previous = _valid_or_none(prior_hash)
        accepted: list[tuple[str, _Stored]] = []
        for i, key in enumerate(page_hashes):
            chunk = tokens[i * page_size : (i + 1) * page_size]
            stored: _Stored | None = None
            try:
                check_page_hash(key)
                if previous is not None:
                    if page_hash(chunk, previous) == key:
                        stored = (array("q", chunk), previous, True)
                elif page_hash(chunk) == key:
                    stored = (array("q", chunk), None, True)  # a root page
                elif exact and i == 0:
                    # The pairing cannot be shifted, so the tokens are right, but the page's parent
                    # (SGLang passed no prefix keys, or a salted chain) is unknown.
                    stored = (array("q", chunk), None, False)
            except (InvalidKeyError, OverflowError, struct.error, TypeError):
                stored = None
            if stored is not None:
                accepted.append((key, stored))
            previous = key if isinstance(key, str) and len(key) == 64 else None
        refused = count - len(accepted)
        if refused:
            self._refuse(refused, "tokens do not hash to the page key")
        with self._lock:
            for key, stored in accepted:
                old = self._pages.pop(key, None)
                if old is not None:
                    self._held -= len(old[0])
                self._pages[key] = stored
                self._held += len(stored[0])
            while self._held > self._max_tokens and self._pages:
                _, gone = self._pages.popitem(last=False)
                self._held -= len(gone[0])
            self._recorded += len(accepted)
        return len(accepted)

    def page(self, page_hash_hex: str) -> CapturedPage | None:
        """What was captured of a page (its tokens and where it hangs), or None."""
        with self._lock:
            stored = self._pages.get(page_hash_hex)
        if stored is None:
            return None
        packed, parent, placed = stored
        return CapturedPage(packed.tolist(), parent, placed)

    def tokens(self, page_hash_hex: str) -> list[int] | None:
        """The token ids of a recorded page, or None."""
        captured = self.page(page_hash_hex)
        return captured.tokens if captured is not None else None

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "pages": len(self._pages),
                "tokens": self._held,
                "recorded_pages": self._recorded,
                "refused_pages": self._refused,
            }

    def _refuse(self, pages: int, why: str) -> int:
        with self._lock:
            self._refused += pages
        log.debug("kvcr: token ids of %d backed-up pages not recorded: %s", pages, why)
        return 0


def _int_list(token_ids: Any) -> list[int]:
    values = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
    if not all(type(t) is int for t in values):
        values = [int(t) for t in values]  # numpy / tensor scalars; tuples (bigram keys) raise TypeError
    return values


def _valid_or_none(prior_hash: Any) -> str | None:
    try:
        return check_page_hash(prior_hash) if prior_hash is not None else None
    except InvalidKeyError:
        return None


_DEFAULT = PageTokenRegistry()


def default_registry() -> PageTokenRegistry:
    """The process-wide registry the SGLang plugin records into and the backend's sink reads."""
    return _DEFAULT
