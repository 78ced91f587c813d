"""The one seam of the in-memory fakes: a test replaces a port method of one fake instance.

A test that must watch a call (the timeout a connect got, the peers a link drop disconnected),
inject a fault the fault tables do not describe (a disconnect that raises, a poll that fails
once), or act in the middle of one (a source restarting while a read is posted) intercepts that
method on that fake: ``plane.intercept("read", replacement)``. Only the port's own methods may be
intercepted, only on a fake, and only for that instance; product code is never touched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar


class Interceptable:
    """Mixin of the fakes: ``intercept(method, replacement)`` for the methods in ``INTERCEPTABLE``."""

    INTERCEPTABLE: ClassVar[frozenset[str]] = frozenset()

    def intercept(self, method: str, replacement: Callable[..., Any]) -> None:
        """Route calls of ``method`` on this instance to ``replacement`` (same signature); it may call
        the real method, which it reads (``real = fake.method``) before intercepting."""
        if method not in self.INTERCEPTABLE:
            raise ValueError(
                f"{type(self).__name__}.{method} is not an interceptable port method "
                f"(those are {', '.join(sorted(self.INTERCEPTABLE))})"
            )
        setattr(self, method, replacement)
