"""DataPlane over UCX through ucxx (two-sided: the source tag-sends what a peer asks to read).

Importing this package does not import ucxx: the worker is built in ``UcxDataPlane.__init__``.
"""

from kvcr.adapters.ucx.dataplane import UcxDataPlane, parse_backend_params

__all__ = ["UcxDataPlane", "parse_backend_params"]
