"""The page digests kvcr can take, by the name the ``page_digest`` setting uses, and their sizes.

A digest travels from the page's owner to a target in the LEASE reply, over the authenticated
control channel; what it must resist is a writer that changes the page's bytes in the owner's
arena (a peer holding the owner's NIXL description can) and wants the target to accept them.
XXH3 catches corruption, stale slots and relays, fast; BLAKE3 also resists a writer that chooses
its bytes to match the digest (XXH3 does not: a second preimage of an XXH3-128 page digest takes
milliseconds to compute), at several times the cost.
"""

from __future__ import annotations

import enum


class PageDigest(str, enum.Enum):
    """How a page's bytes are digested (``verify_bytes``)."""

    XXH3 = "xxh3"  # XXH3-128: 16 bytes, faster than memcpy; not second-preimage resistant
    BLAKE3 = "blake3"  # BLAKE3: 32 bytes, cryptographic


PAGE_DIGEST_NAMES = tuple(d.value for d in PageDigest)
"""Every name the ``page_digest`` setting accepts."""

DIGEST_BYTES = {PageDigest.XXH3.value: 16, PageDigest.BLAKE3.value: 32}
"""How long each digest is: a target told a digest of another length knows the owner uses another one."""
