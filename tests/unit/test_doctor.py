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
    check_memory,
    check_ports,
    check_token,
    exit_code,
    run_doctor,
    summary,
)
from kvcr.domain.errors import ConfigError
from kvcr.integrations.shared.settings import parse_settings
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
    ("data", "mode", "says"),
    [
        (b"0123456789abcdef", 0o644, "chmod 600"),
        (b"0123456789abcdef", 0o606, "group or others"),
        (b"0123456789abcdef", 0o620, "group or others"),
        (b"short-token\n", 0o600, "at least 16"),
        (b"0123456789abcdef", 0o640, "group or others"),  # was a WARN ("kvcr will work") while the backend refused it
        (b"a" * 32, 0o600, "only 1 distinct byte values"),
        (b"abcdefg" * 3, 0o600, "only 7 distinct byte values"),
    ],
)
def test_a_token_the_backend_refuses_fails_the_doctor_as_the_backend_fails_its_start(tmp_path, data, mode, says):
    path = token(tmp_path, data, mode)
    finding = check_token(path)
    assert finding.status is Status.FAIL and says in finding.detail and "kvcr will not start" in finding.detail
    with pytest.raises(ConfigError):  # what start-up does with the same file
        parse_settings({"auth_token_file": path}).token()


def test_the_memory_check_counts_every_rank_and_says_what_is_left():
    gib = 1 << 30
    ok = check_memory(4 * gib, 2, available=lambda: 23 * gib)
    assert ok.status is Status.OK and "8.0 GiB" in ok.detail and "15.0 GiB left for SGLang" in ok.detail
    short = check_memory(32 * gib, 2, available=lambda: 23 * gib)  # 32 GiB x TP 2 on a 23 GiB host was "ok config"
    assert short.status is Status.FAIL and "64.0 GiB" in short.detail and "at most 11.5 GiB per rank" in short.detail
    assert check_memory(gib, 1, available=lambda: None).status is Status.WARN


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
    assert lines[-1].startswith("doctor: 4 ok, 0 warning(s), 0 failure(s), 6 skipped")  # identity: no node key


def test_an_unknown_check_to_skip_is_named(capsys):
    assert main(["doctor", "--skip", "nixl,bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvcr doctor: --skip: unknown check(s) bogus") and "\n" not in err


def _identity_config(tmp_path, listed_ranks):
    from kvcr.adapters.zmq.identity import write_node_key

    key = tmp_path / "node.key"
    public = write_node_key(str(key)).decode()
    directory = tmp_path / "peers"
    directory.write_text("".join(f"tcp://10.1.2.3:{32100 + r} {public}\n" for r in listed_ranks))
    config = {"node_key_file": str(key), "peer_directory_file": str(directory), "control_host": "10.1.2.3"}
    return parse_settings(config), public


def test_the_identity_check_passes_when_every_ranks_endpoint_lists_this_nodes_key(tmp_path):
    from kvcr.doctor import check_identity

    settings, public = _identity_config(tmp_path, [0, 1])
    finding = check_identity(DoctorOptions(tp_size=2), settings)
    assert finding.status is Status.OK, finding.detail
    assert public[:8] in finding.detail and "tcp://10.1.2.3:32101" in finding.detail


def test_the_identity_check_fails_a_rank_the_directory_does_not_list_as_start_up_would(tmp_path):
    from kvcr.doctor import check_identity

    settings, public = _identity_config(tmp_path, [0])
    finding = check_identity(DoctorOptions(tp_size=2), settings)
    assert finding.status is Status.FAIL and "kvcr will not start" in finding.detail
    assert f"add the line 'tcp://10.1.2.3:32101 {public}'" in finding.detail


def test_with_per_node_keys_the_token_check_does_not_say_peers_are_unauthenticated():
    assert "per-node keys" in check_token(None, node_keys=True).detail
    assert "not authenticated" in check_token(None).detail


def test_the_identity_check_is_skipped_without_a_node_key(tmp_path):
    from kvcr.doctor import check_identity

    assert check_identity(DoctorOptions(), parse_settings({})).status is Status.SKIP
