"""Real UCX data planes (ucxx) in this process, with UCX kept on loopback."""

import contextlib

import pytest

from tests.integration.ucx.support import LOOPBACK


@pytest.fixture
def planes():
    from kvcr.adapters.ucx import UcxDataPlane

    made = []

    def make(name, **kwargs):
        kwargs.setdefault("backend_params", LOOPBACK)
        plane = UcxDataPlane(name, **kwargs)
        made.append(plane)
        return plane

    yield make
    for plane in made:
        with contextlib.suppress(Exception):  # a test may have closed it, or left it unclosable on purpose
            plane.close()
