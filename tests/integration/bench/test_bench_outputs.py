"""What the benchmarks leave behind: JSON, a PNG beside it, and the README block rebuilt from the JSON."""

import json

import pytest

from kvcr.bench.report import BEGIN, END
from kvcr.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_bench_local_writes_a_png_beside_its_json_and_shows_progress(tmp_path, capsys):
    out = tmp_path / "local.json"
    args = ["bench", "local", "--page-sizes", "64KiB,256KiB", "--pages", "8", "--reps", "2", "--json", str(out)]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "[1/2] local: 64KiB pages x 8 ... done in" in err and "[2/2] local: 256KiB" in err
    width, height = png_size(out.with_suffix(".png"))
    assert width > 600 and height > 300
    rows = json.loads(out.read_text())
    assert [r["page_bytes"] for r in rows] == [64 << 10, 256 << 10]
    # The cost of verify_bytes is measured in the same run (a digest per page costs something).
    assert all(0 < r["verify_backup_ratio"] < 5 and 0 < r["verify_restore_ratio"] < 5 for r in rows)
    assert all(0 < r["blake3_backup_ratio"] < 5 and 0 < r["blake3_restore_ratio"] < 5 for r in rows)


@pytest.mark.nixl
@pytest.mark.zmq
@pytest.mark.multiprocess
def test_bench_report_rebuilds_the_readme_block_from_the_json(tmp_path, capsys):
    results = tmp_path / "bench-results"
    small = ["--pages", "8", "--reps", "2", "--page-sizes", "64KiB,128KiB"]
    assert main(["bench", "local", *small, "--json", str(results / "local.json")]) == 0
    remote = ["--page-sizes", "64KiB,128KiB", "--batches", "4", "--reps", "2"]
    assert main(["bench", "remote", *remote, "--json", str(results / "remote.json")]) == 0
    png_size(results / "remote.png")
    for row in json.loads((results / "remote.json").read_text()):
        # the bare control round trip was measured against the source, and the floor is computed from it
        assert row["control_p50_ms"] > 0
        assert row["floor_vs_raw"] == pytest.approx(row["raw_p50_ms"] / (row["raw_p50_ms"] + row["control_p50_ms"]))
    printed = capsys.readouterr().out
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n\n{BEGIN}\nold tables\n{END}\n\nafter\n")
    figure = tmp_path / "docs" / "bench.png"
    args = ["bench", "report", "--from", str(results), "--figure", str(figure), "--readme", str(readme)]
    assert main([*args, "--update-readme"]) == 0
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n\n" + BEGIN) and text.endswith(END + "\n\nafter\n")
    assert "old tables" not in text and "![kvcr restore throughput against page size](docs/bench.png)" in text
    for row in ("| 64KiB x 8 |", "| 128KiB x 8 |", "| 64KiB x 4 |", "| 128KiB x 4 |"):
        assert row in text
    # the tables are the ones the benchmarks printed, cell for cell
    local_rows = [line for line in printed.splitlines() if line.startswith("| 64KiB x 8 |")]
    assert local_rows and local_rows[0] in text
    assert (results / "README-tables.md").read_text() in text
    png_size(figure)


def test_a_readme_without_the_markers_is_one_line_naming_them(tmp_path, capsys):
    results = tmp_path / "r"
    assert (
        main(
            [
                "bench",
                "local",
                "--pages",
                "4",
                "--reps",
                "1",
                "--page-sizes",
                "64KiB",
                "--json",
                str(results / "local.json"),
            ]
        )
        == 0
    )
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    capsys.readouterr()
    rc = main(
        [
            "bench",
            "report",
            "--from",
            str(results),
            "--figure",
            str(tmp_path / "f.png"),
            "--readme",
            str(readme),
            "--update-readme",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "has no generated benchmark block" in err and "\n" not in err
    assert readme.read_text() == "# no markers\n"
    assert main(["bench", "report", "--from", str(tmp_path / "empty")]) == 2
