"""kvcr doctor's host checks that need no heavy part: token file, ports, config, verdict and exit code."""

import json
import socket

import pytest

from kvcr.cli import main
from kvcr.doctor import (
    CHECKS,
    DoctorOptions,
    Finding,
    Status,
    check_ports,
    check_token,
    exit_code,
    run_doctor,
    summary,
)
from tests.support import free_port

HEAVY = frozenset({"nixl", "transport", "sglang", "page-keys"})


def token(tmp_path, data=b"0123456789abcdef-cluster", mode=0o600):
    path = tmp_path / "token"
    path.write_bytes(data)
    path.chmod(mode)
    return str(path)


def test_a_private_token_of_16_bytes_or_more_passes(tmp_path):
    finding = check_token(token(tmp_path))
    assert finding.status is Status.OK and "mode 0600" in finding.detail


@pytest.mark.parametrize(
    ("data", "mode", "status", "says"),
    [
        (b"0123456789abcdef", 0o644, Status.FAIL, "chmod 600"),
        (b"0123456789abcdef", 0o606, Status.FAIL, "every user"),
        (b"0123456789abcdef", 0o620, Status.FAIL, "writable by its group"),
        (b"short-token\n", 0o600, Status.FAIL, "at least 16"),
        (b"a" * 32, 0o600, Status.FAIL, "only 1 distinct byte values"),
        (b"abcdefg" * 3, 0o600, Status.FAIL, "only 7 distinct byte values"),
        (b"0123456789abcdef", 0o640, Status.WARN, "readable by its group"),
    ],
)
def test_a_token_others_can_read_or_a_short_one_is_refused(tmp_path, data, mode, status, says):
    finding = check_token(token(tmp_path, data, mode))
    assert finding.status is status and says in finding.detail


def test_a_missing_token_file_or_a_directory_fails_naming_the_path(tmp_path):
    missing = check_token(str(tmp_path / "nope"))
    assert missing.status is Status.FAIL and "nope" in missing.detail
    assert check_token(str(tmp_path)).status is Status.FAIL
    assert check_token(None).status is Status.SKIP


def test_a_port_in_use_fails_and_free_ports_pass():
    base = free_port(2)
    assert check_ports("127.0.0.1", [("rank 0 control", base), ("rank 1 control", base + 1)]).status is Status.OK
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        finding = check_ports("127.0.0.1", [("rank 0 control", base), ("rank 1 control", base + 1)])
    assert finding.status is Status.FAIL and f"rank 1 control 127.0.0.1:{base + 1}" in finding.detail
    assert f":{base}," not in finding.detail


def test_an_address_of_another_host_is_named():
    finding = check_ports("192.0.2.7", [("rank 0 control", free_port())])  # TEST-NET-1: never local
    assert finding.status is Status.FAIL and "control_host" in finding.detail


@pytest.mark.sglang  # the backend's settings parser lives in the SGLang integration
def test_the_sglang_config_feeds_the_port_and_token_checks(tmp_path):
    port = free_port(2)
    config = {"backend_name": "kvcr", "control_port": port, "auth_token_file": token(tmp_path, mode=0o644)}
    findings = run_doctor(DoctorOptions(sglang_config=json.dumps(config), tp_size=2, skip=HEAVY))
    by = {f.check: f for f in findings}
    assert by["config"].status is Status.OK
    assert f"rank 1 control {port + 1}" in by["ports"].detail
    assert by["token"].status is Status.FAIL
    assert [f.check for f in findings] == list(CHECKS)
    assert exit_code(findings) == 1


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("config", "says"),
    [("{not json", "not JSON"), ('{"control_prot": 1}', "control_prot"), ("[1]", "JSON object")],
)
def test_a_bad_sglang_config_is_one_line_naming_the_problem(config, says):
    [finding] = [f for f in run_doctor(DoctorOptions(sglang_config=config, skip=HEAVY)) if f.check == "config"]
    assert finding.status is Status.FAIL and says in finding.detail and "\n" not in finding.detail


def test_exit_code_and_verdict():
    ok, warn, fail = (Finding("x", s, "d") for s in (Status.OK, Status.WARN, Status.FAIL))
    skip = Finding("y", Status.SKIP, "d")
    assert exit_code([ok, skip]) == 0 and exit_code([ok, warn]) == 2 and exit_code([warn, fail]) == 1
    assert summary([ok, warn, skip]).endswith("kvcr will work, degraded")


@pytest.mark.sglang  # kvcr's default control host comes from the SGLang settings
def test_the_cli_prints_one_line_per_check_and_returns_the_exit_code(capsys, tmp_path):
    rc = main(
        ["doctor", "--skip", ",".join(HEAVY), "--token-file", token(tmp_path), "--control-port", str(free_port())]
    )
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0 and len(lines) == len(CHECKS) + 1
    assert lines[-1].startswith("doctor: 3 ok, 0 warning(s), 0 failure(s), 5 skipped")


def test_an_unknown_check_to_skip_is_named(capsys):
    assert main(["doctor", "--skip", "nixl,bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvcr doctor: --skip: unknown check(s) bogus") and "\n" not in err
