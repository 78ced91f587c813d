"""Real UCX data planes (ucxx) in this process, with UCX kept on loopback."""

import contextlib

import pytest

from tests.integration.ucx.support import LOOPBACK


@pytest.fixture
def planes():
    from kvcr.adapters.ucx import UcxDataPlane

    made = []
    kept = []  # memory the planes may still send from: freed only after they closed

    def make(name, **kwargs):
        kwargs.setdefault("backend_params", LOOPBACK)
        plane = UcxDataPlane(name, **kwargs)
        made.append(plane)
        return plane

    make.keep = kept.append
    yield make
    for plane in made:
        with contextlib.suppress(Exception):  # a test may have closed it, or left it unclosable on purpose
            plane.close()
    kept.clear()
