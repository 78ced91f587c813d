"""``kvcr demo --engine stand-in`` end to end: Dynamo's frontend, two kvcr workers, conversations over HTTP."""

from __future__ import annotations

import pytest

from kvcr.cli import main

pytestmark = [pytest.mark.multiprocess, pytest.mark.nixl, pytest.mark.timeout(240)]


@pytest.mark.parametrize(
    "options",
    [["--quiet"], pytest.param(["--transport", "ucx"], marks=pytest.mark.ucx)],
    ids=["nixl-quiet", "ucx"],
)
def test_the_demo_restores_pages_from_a_peer_on_the_routers_hint_all_verified(tmp_path, capsys, options):
    plot = tmp_path / "demo.png"
    args = ["demo", "--engine", "stand-in", "--workers", "2", "--turns", "3", "--plot", str(plot)]
    args += ["--workdir", str(tmp_path), *options]
    assert main(args) == 0
    out = capsys.readouterr().out  # --quiet keeps the tables and the verdict
    assert "pages restored from a peer" in out and "all match" in out
    assert "OK:" in out and "read from a peer on the router's" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_demo_refuses_a_single_worker():
    with pytest.raises(SystemExit, match="--workers must be at least 2"):
        main(["demo", "--workers", "1"])
