"""Transport errors, raised by adapters at the port boundary.

::

    KvcrError (kvcr.domain.errors)
     +-- TransportError         something between two endpoints went wrong      -> misses
          +-- PeerUnavailable   the peer cannot be reached or has gone away      -> misses
          +-- ControlTimeout    a control request got no reply in time           -> misses
          +-- PeerRefused       the peer refused us (auth, incompatibility)      -> misses
          +-- RegistrationError memory could not be registered                   -> raise at start-up
          +-- AddressInUse      a port kvcr must bind is taken                   -> raise at start-up
          +-- MemoryCopyError   a local copy failed part-way                     -> page not stored / miss

The degrade rule: every TransportError during a restore turns the affected pages into misses;
during a backup it leaves those pages unstored. None of them reaches SGLang.
"""

from kvcr.domain.errors import KvcrError


class TransportError(KvcrError):
    """Root of errors that come from moving bytes or messages."""


class PeerUnavailable(TransportError):
    """The peer cannot be reached, or went away."""


class ControlTimeout(TransportError, TimeoutError):
    """A control request got no reply before its deadline."""


class PeerRefused(TransportError):
    """The peer answered with a refusal (authentication, version, namespace)."""


class AddressInUse(TransportError):
    """An address kvcr must listen on is held by another socket (start-up names the setting)."""


class RegistrationError(TransportError):
    """Memory could not be registered with (or deregistered from) the transport."""


class MemoryCopyError(TransportError):
    """A local copy did not complete; the destination bytes are undefined."""
