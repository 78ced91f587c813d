"""The soak's verdict and its options, without processes: anything wrong fails the run, bad options are one line."""

from __future__ import annotations

import pytest

from kvcr.cli import main
from kvcr.soak.run import KINDS, ReplicaFigures, SoakOptions, SoakReport

CLEAN = {"error": None, **dict.fromkeys(("leaked_threads", "leaked_fds", "nixl_registrations", "live_transfers"), 0)}
CLEAN["nixl_agents"] = 0


def _figures(name="r0", **kind_changes):
    kinds = {k: {"ops": 10, "pages": 80, "restored": 40, "wrong_bytes": 0, "late_bytes": 0, "hangs": 0} for k in KINDS}
    for kind, changes in kind_changes.items():
        kinds[kind].update(changes)
    return ReplicaFigures(name, stats={"kinds": kinds, "rss": 1 << 20}, closed=dict(CLEAN))


def test_a_clean_run_is_ok_and_anything_wrong_is_not():
    options = SoakOptions(minutes=1)
    assert SoakReport(options, 60, [_figures(), _figures("r1")]).ok
    bad = [
        [_figures(remote_restore={"wrong_bytes": 1})],
        [_figures(local_restore={"late_bytes": 4})],
        [_figures(backup={"hangs": 1})],
        [_figures(remote_restore={"exceptions": 1})],
        [_figures(remote_restore={"restored": 0})],  # no remote restore ever worked
    ]
    leaky = _figures()
    leaky.closed = {**CLEAN, "leaked_fds": 3}
    hung = _figures()
    hung.hung = True
    unclosed = _figures()
    unclosed.closed = None
    for replicas in [*bad, [leaky], [hung], [unclosed]]:
        report = SoakReport(options, 60, replicas)
        assert not report.ok
        assert "FAILED" in report.table()
    assert SoakReport(options, 60, [leaky]).as_dict()["leaks"]["leaked_fds"] == 3


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--replicas", "1"], "--replicas must be at least 2"),
        (["--minutes", "0"], "--minutes must be positive"),
        (["--page-kib", "100"], "--page-kib must be a positive multiple of 256"),
        (["--prompt-pages", "80", "--host-pages", "100"], "--host-pages (100) must hold two prompts"),
        (["--remote-share", "2"], "--remote-share must be in [0, 1]"),
        (["--transport", "rdma"], "--transport must be one of"),
    ],
)
def test_bad_soak_options_are_one_line_naming_the_option(capsys, argv, says):
    assert main(["soak", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err
