"""kvcr.compat: supported ranges, the one-line verdicts, the start-up gate and the name-clash check."""

import logging
import types

import pytest

from kvcr import compat
from kvcr.compat import IncompatibleEnvironment, Status, check, check_import_package, ensure_supported, in_range


def versions(**installed: str):
    table = {name.replace("_", "-"): v for name, v in installed.items()}
    return table.get


SUPPORTED_ENV = versions(sglang="0.5.23", nixl="1.5.1", nixl_cu13="1.5.1", ai_dynamo_runtime="1.6.1")


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.5.23", True),
        ("0.5.23.post1", True),
        ("0.5.23+cpu", True),
        ("0.5.23.1", True),
        ("0.5.22", False),
        ("0.5.24", False),
        ("0.5.24rc1", False),  # PEP 440: <0.5.24 excludes its pre-releases
        ("0.5.23rc1", False),  # ... and a pre-release of the minimum is below it
        ("0.5.23.dev0", False),
        ("0.6.0", False),
        ("not-a-version", False),
    ],
)
def test_sglang_range(version, expected):
    assert in_range(version, "0.5.23", "0.5.24") is expected


@pytest.mark.parametrize(("version", "expected"), [("1.5", False), ("1.5.1", True), ("1.5.9", True), ("1.6", False)])
def test_short_versions_pad_with_zeros(version, expected):
    assert in_range(version, "1.5.1", "1.6") is expected


def test_a_supported_part_is_ok():
    finding = check("sglang", version_of=SUPPORTED_ENV)
    assert finding.status is Status.OK
    assert finding.found == "sglang 0.5.23"


@pytest.mark.parametrize("version", ["0.5.22", "0.5.23"])
def test_every_sglang_release_ci_tests_is_supported(version):
    # CI runs the SGLang tests against 0.5.23 and 0.5.22 (scripts/test.sh, "oldest SGLang")
    assert check("sglang", version_of=versions(sglang=version)).status is Status.OK


def test_sglang_0_5_21_is_below_the_window():
    # its backend API fits, but its controller lacks the synced-hit hook kvcr's hints need (docs/install.md)
    assert check("sglang", version_of=versions(sglang="0.5.21")).status is Status.UNSUPPORTED


def test_an_unsupported_version_is_one_line_naming_found_and_supported():
    finding = check("sglang", version_of=versions(sglang="0.5.20"))
    assert finding.status is Status.UNSUPPORTED
    assert "\n" not in finding.line
    assert "sglang 0.5.20" in finding.line
    assert "SGLang >=0.5.22,<0.5.24" in finding.line
    assert compat.ALLOW_ENV in finding.line


def test_a_missing_part_says_how_to_install_it():
    finding = check("nixl", version_of=versions())
    assert finding.status is Status.MISSING
    assert "NIXL >=1.5.1,<1.6" in finding.line
    assert 'pip install "kvcr-runner[nixl]"' in finding.line


def test_every_installed_nixl_backend_must_be_supported():
    # torch's CUDA version picks the backend at import time, so a stale nixl-cu12 matters too
    finding = check("nixl", version_of=versions(nixl="1.5.1", nixl_cu13="1.5.1", nixl_cu12="1.4.1"))
    assert finding.status is Status.UNSUPPORTED
    assert "nixl-cu12 1.4.1" in finding.line
    assert "nixl-cu13" not in finding.line.split(";")[0]


def test_a_nixl_backend_alone_counts_as_installed():
    assert check("nixl", version_of=versions(nixl_cu12="1.5.1")).ok


OURS = types.SimpleNamespace(__distribution__="kvcr-runner", __file__="/site/kvcr/__init__.py")


def test_kvcr_runner_alone_owns_the_import_package():
    assert check_import_package(owners=["kvcr_runner"], loaded=OURS).ok


def test_nvidias_kvcr_beside_ours_is_a_clash():
    finding = check_import_package(owners=["kvcr-runner", "kvcr"], version_of=versions(kvcr="0.1.1"), loaded=OURS)
    assert finding.status is Status.CLASH
    assert "\n" not in finding.line
    assert "kvcr 0.1.1" in finding.line
    assert "separate environments" in finding.line
    assert "pip uninstall kvcr" in finding.line


def test_an_overwritten_init_is_a_clash_even_without_metadata():
    theirs = types.SimpleNamespace(__file__="/site/kvcr/__init__.py")
    finding = check_import_package(owners=["kvcr-runner"], loaded=theirs)
    assert finding.status is Status.CLASH
    assert "/site/kvcr/__init__.py is not kvcr-runner's" in finding.line


def test_the_gate_passes_a_supported_environment():
    found = ensure_supported("sglang", "nixl", version_of=SUPPORTED_ENV, environ={})
    assert [f.check for f in found] == ["import-package", "sglang", "nixl"]
    assert all(f.ok for f in found)


def test_the_gate_refuses_an_unsupported_version_with_its_line():
    with pytest.raises(IncompatibleEnvironment) as refused:
        ensure_supported("sglang", version_of=versions(sglang="0.5.20"), environ={})
    assert str(refused.value) == check("sglang", version_of=versions(sglang="0.5.20")).line


def test_the_override_turns_an_unsupported_version_into_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="kvcr.compat"):
        found = ensure_supported("sglang", version_of=versions(sglang="0.5.20"), environ={compat.ALLOW_ENV: "1"})
    assert found[-1].status is Status.UNSUPPORTED
    assert "sglang 0.5.20" in caplog.text


def test_the_override_does_not_excuse_a_missing_part():
    with pytest.raises(IncompatibleEnvironment, match="NIXL is not installed"):
        ensure_supported("nixl", version_of=versions(), environ={compat.ALLOW_ENV: "1"})


def test_an_unknown_check_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown compatibility check 'vllm'"):
        ensure_supported("vllm", environ={})


def test_this_environment_is_supported():
    # the dev venv holds the supported SGLang, NIXL and Dynamo runtime (scripts/install.sh)
    assert all(f.ok for f in ensure_supported("sglang", "nixl", "dynamo-runtime", environ={}))


def test_a_missing_base_dependency_is_named():
    real = compat.installed_version
    finding = compat.check_base_dependencies(version_of=lambda d: None if d == "xxhash" else real(d))
    assert finding.status is Status.MISSING
    assert finding.line.startswith("kvcr: xxhash not installed")


def test_main_prints_one_line_per_check_and_fails_only_on_real_problems(capsys):
    rc = compat.main([])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(compat.doctor_findings())
    assert rc == 0, lines


def test_doctor_counts_clashes_unsupported_versions_and_missing_base_dependencies_only():
    missing_optional = check("dynamo", version_of=versions())
    unsupported = check("sglang", version_of=versions(sglang="0.5.20"))
    clash = check_import_package(owners=["kvcr-runner", "kvcr"], loaded=OURS)
    missing_base = compat.check_base_dependencies(version_of=lambda d: None)
    assert [compat.is_problem(f) for f in (missing_optional, unsupported, clash, missing_base)] == [
        False,
        True,
        True,
        True,
    ]
