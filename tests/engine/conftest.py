"""Real SGLang 0.5.23 servers on the CPU with kvcr as L3 (kvcr.testing.engine); every test here is ``engine``."""

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/engine/" in str(item.fspath):
            for marker in ("engine", "sglang", "nixl", "multiprocess"):
                item.add_marker(getattr(pytest.mark, marker))
