"""The CLI commands run end to end (figures are not asserted: speed lives in benchmarks)."""

import json

from kvcr.cli import main


def test_demo_succeeds(capsys):
    assert main(["demo", "--local-only"]) == 0
    assert "bytes equal: True" in capsys.readouterr().out


def test_bench_local_reports_verified_ratios(tmp_path, capsys):
    out = tmp_path / "local.json"
    assert main(["bench", "local", "--page-sizes", "64KiB", "--pages", "8", "--reps", "2", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "backup vs memcpy" in table and "64KiB x 8" in table
    [result] = json.loads(out.read_text())
    assert result["verified"] is True and result["pages"] == 8
    assert result["backup_ratio"] > 0 and result["restore_ratio"] > 0
