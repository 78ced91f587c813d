"""Real NIXL data planes in this process, with UCX kept on loopback."""

import contextlib

import pytest

from tests.integration.nixl.support import LOOPBACK


@pytest.fixture
def planes():
    from kvcr.adapters.nixl import NixlDataPlane

    made = []

    def make(name, **kwargs):
        kwargs.setdefault("backend_params", LOOPBACK)
        plane = NixlDataPlane(name, **kwargs)
        made.append(plane)
        return plane

    yield make
    for plane in made:
        with contextlib.suppress(Exception):  # a test may have closed it, or left it unclosable on purpose
            plane.close()
