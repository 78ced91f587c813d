"""The domain's error tree, and the rule for degrading each branch.

::

    KvcrError
     +-- ConfigError          a setting is unknown, mistyped or out of range    -> raise at start-up
     +-- LayoutError          zero/overlapping components, misaligned pages,
     |                        geometry that does not match the pool              -> raise at registration
     +-- InvalidKeyError      a page hash or block key is malformed              -> raise to the caller
     +-- CapacityError        a page can never fit (bigger than the arena)       -> raise to the caller
     +-- EvidenceError        a query names no physical ALL_PAGES pool           -> caller answers 0 hits
     +-- ClosedError          the object was used after close()                  -> raise
     +-- DeadlineExceeded     an operation ran past its deadline                 -> caller reports misses

Transport failures live in :mod:`kvcr.ports.errors`; integrations turn them into misses, never
into partial data. Nothing in this tree is raised into SGLang's threads by the integration: bad
input at start-up fails the start, bad input per request degrades to recompute.
"""


class KvcrError(Exception):
    """Root of every error kvcr raises on purpose."""


class ConfigError(KvcrError, ValueError):
    """A configuration value is unknown, mistyped or out of range; the message names the key."""


class LayoutError(KvcrError, ValueError):
    """A memory layout cannot be used as described; the message names the region or pool."""


class InvalidKeyError(KvcrError, ValueError):
    """A page hash or block key is malformed."""


class CapacityError(KvcrError):
    """A page cannot fit in the arena at all."""


class EvidenceError(KvcrError):
    """A query carries no physical evidence (a bare logical anchor) and must not be answered."""


class ClosedError(KvcrError, RuntimeError):
    """The object was used after close()."""


class DeadlineExceeded(KvcrError, TimeoutError):
    """An operation did not finish before its deadline."""
