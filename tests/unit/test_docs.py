"""Docs that cannot rot: every command and config README.md and docs/*.md show an operator is checked.

A ``kvcr ...`` line parses with kvcr's own parser; ``python -m X`` names a module that exists;
``bash scripts/...`` a script that exists; a pip extra is one the wheel declares; every
``--hicache-storage-backend-extra-config`` passes kvcr's settings validation (and the backend's
own interface check); every name in a settings table is a setting. A block meant to fail is
marked ``<!-- docs-test: expect-failure -->`` and must fail. The SGLang-side half (the same configs
starting a backend on SGLang's real host pool) is ``tests/integration/sglang/test_doc_configs.py``.
"""

from __future__ import annotations

import importlib.util
import json
import re
import tomllib
from pathlib import Path

import pytest

from kvcr.cli import build_parser
from kvcr.domain.errors import KvcrError
from kvcr.integrations.shared.settings import _TYPES, SGLANG_KEYS, parse_settings
from kvcr.runner.node import NodeSettings
from kvcr.testing.docs import (
    Command,
    commands,
    documents,
    fill_placeholders,
    inline_commands,
    option,
    setting_tables,
    without_env,
)

REPO = Path(__file__).resolve().parents[2]
ALL = [command for doc in documents(REPO) for command in commands(doc, REPO)]
SUBCOMMANDS = ("demo", "worker", "bench", "soak", "doctor", "keygen")
# prose also quotes kvcr's messages (`kvcr needs the zero-copy interface`): only command spans count
INLINE = [
    c for doc in documents(REPO) for c in inline_commands(doc, REPO) if c.words[1:2] in {(s,) for s in SUBCOMMANDS}
]
KNOWN_SETTINGS = {*_TYPES, "dram_bytes", *SGLANG_KEYS}
PLACEHOLDERS = {"<port>": "32100", "<this host>": "10.0.0.7", "<address peers dial>": "10.0.0.7"}


def kvcr_args(words: tuple[str, ...]) -> tuple[str, ...] | None:
    words = without_env(words)
    if words and Path(words[0]).name == "kvcr":
        return words[1:]
    if words[:3] == ("python", "-m", "kvcr.cli"):
        return words[3:]
    return None


def extra_configs() -> list[tuple[Command, str]]:
    found = []
    for command in ALL:
        config = option(command.words, "--hicache-storage-backend-extra-config")
        if config is not None:
            found.append((command, config))
    return found


def check_kvcr_command(args: tuple[str, ...]) -> None:
    """Parse as ``kvcr`` would; SystemExit (argparse's refusal) is what an operator would see."""
    if args[:1] == ("worker",):
        from kvcr.demo.dynamo.worker_settings import build_parser as worker_parser

        worker_parser().parse_args(list(args[1:]))
    else:
        build_parser().parse_args(list(args))


def check_extra_config(text: str, token_file: Path) -> None:
    """The extra-config as SGLang hands it to kvcr: JSON, then kvcr's settings and interface checks."""
    data = json.loads(fill_placeholders(text, PLACEHOLDERS))
    if "auth_token_file" in data:
        data["auth_token_file"] = str(token_file)  # the doc's path, stood in for by a real token
    if not data.get("interface_v1"):
        raise KvcrError("no interface_v1: the backend refuses to start")
    settings = parse_settings(data)
    if settings.control_port:  # the node's own start-up rules (a non-loopback bind needs the token, ...)
        NodeSettings(
            settings.control_host,
            settings.control_port,
            advertise_host=settings.control_advertise_host,
            token=settings.token(),
            allow_unauthenticated=settings.allow_unauthenticated,
        )


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_bytes(bytes(range(32, 96)))
    path.chmod(0o600)
    return path


def test_the_docs_show_commands_and_configs_to_check():
    choices = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert set(SUBCOMMANDS) == set(choices or ())
    assert len([c for c in ALL if kvcr_args(c.words) is not None]) >= 5
    assert len(extra_configs()) >= 4  # README, install.md, sglang.md, engine-on-cpu.md


@pytest.mark.parametrize("command", [c for c in ALL if kvcr_args(c.words) is not None], ids=lambda c: c.where)
def test_every_kvcr_command_in_the_docs_parses(command):
    args = kvcr_args(command.words)
    assert args is not None
    if command.expect_failure:
        with pytest.raises(SystemExit):
            check_kvcr_command(args)
    else:
        try:
            check_kvcr_command(args)
        except SystemExit as exc:
            if exc.code != 0:  # 0: --help
                pytest.fail(f"{command.where}: `{' '.join(command.words)}` does not parse (exit {exc.code})")


@pytest.mark.parametrize("command", INLINE, ids=lambda c: c.where)
def test_every_kvcr_command_named_in_prose_has_options_that_exist(command, capsys):
    """Prose names a command with some of its options (`kvcr worker --metrics-port N`): each must exist."""
    args = kvcr_args(command.words)
    assert args is not None
    try:
        check_kvcr_command(args)
    except SystemExit as exc:
        said = capsys.readouterr().err
        if exc.code != 0 and "the following arguments are required" not in said:
            pytest.fail(f"{command.where}: `{' '.join(command.words)}`: {said.strip().splitlines()[-1]}")


@pytest.mark.parametrize(("command", "config"), extra_configs(), ids=lambda c: getattr(c, "where", "config"))
def test_every_extra_config_in_the_docs_passes_kvcrs_validation(command, config, token_file):
    if command.expect_failure:
        with pytest.raises((KvcrError, ValueError)):
            check_extra_config(config, token_file)
    else:
        try:
            check_extra_config(config, token_file)
        except (KvcrError, ValueError) as exc:
            pytest.fail(f"{command.where}: the extra-config is refused: {exc}")


def modules() -> list[tuple[Command, str]]:
    found = []
    for command in ALL:
        words = without_env(command.words)
        for index, word in enumerate(words[:-1]):
            if word == "-m" and Path(words[0]).name.startswith("python"):
                found.append((command, words[index + 1]))
                break
    return found


@pytest.mark.parametrize(("command", "module"), modules(), ids=lambda c: getattr(c, "where", str(c)))
def test_every_python_module_the_docs_run_exists(command, module):
    if module in ("pip", "build", "venv"):
        return
    assert importlib.util.find_spec(module) is not None, f"{command.where}: python -m {module}: no such module"


@pytest.mark.parametrize(
    "command", [c for c in ALL if without_env(c.words)[:1] == ("bash",)], ids=lambda c: getattr(c, "where", str(c))
)
def test_every_script_the_docs_run_exists(command):
    script = without_env(command.words)[1]
    assert (REPO / script).is_file(), f"{command.where}: bash {script}: no such script"


def pip_extras() -> list[tuple[Command, str]]:
    found = []
    for command in ALL:
        words = without_env(command.words)
        if words[:2] != ("pip", "install"):
            continue
        for word in words[2:]:
            match = re.fullmatch(r"(?:kvcr-runner|dist/kvcr_runner-[^\[]+\.whl)\[([a-z,]+)\]", word)
            if match:
                found += [(command, extra) for extra in match.group(1).split(",")]
    return found


@pytest.mark.parametrize(("command", "extra"), pip_extras(), ids=lambda c: getattr(c, "where", str(c)))
def test_every_pip_extra_the_docs_name_is_declared(command, extra):
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extra in declared, f"{command.where}: kvcr-runner[{extra}] is not an extra of the wheel"


def test_every_setting_a_settings_table_names_exists():
    unknown = [
        f"{doc.relative_to(REPO)}:{line} {name}"
        for doc in documents(REPO)
        for line, name in setting_tables(doc)
        if re.fullmatch(r"[a-z][a-z0-9_]*", name) and name not in KNOWN_SETTINGS
    ]
    assert not unknown, f"settings tables name settings that do not exist: {unknown}"


def test_a_renamed_key_in_a_doc_config_is_caught(token_file):
    """The check can fail: the README's config with one key renamed (as docs/security.md once had)."""
    _, config = next((c, text) for c, text in extra_configs() if c.doc == "README.md")
    check_extra_config(config, token_file)
    with pytest.raises(KvcrError, match="unknown kvcr setting 'token'"):
        check_extra_config(config.replace('"auth_token_file"', '"token"'), token_file)
    with pytest.raises(SystemExit):
        check_kvcr_command(("demo", "--metric-port", "9464"))


def test_the_grafana_dashboard_queries_only_series_kvcr_exports():
    from kvcr.ports.metric_catalogue import CATALOGUE

    dashboard = json.loads((REPO / "docs" / "grafana-kvcr.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    named = {name for expr in exprs for name in re.findall(r"\b(kvcr_[a-z_]+)", expr)}
    exported = {*CATALOGUE, *(f"{n}_bucket" for n in CATALOGUE)}
    assert named and named <= exported, sorted(named - exported)


TOKEN_COMMAND = re.compile(r"`(head -c \d+ /dev/urandom[^`]*?> *(\S+?))(?: *&&[^`]*)?`", re.S)


def test_every_token_command_in_the_docs_makes_a_token_kvcr_accepts(tmp_path):
    """Run each documented token command many times: none may write a token kvcr refuses (a raw NUL did 1 in 9)."""
    import subprocess

    from kvcr.integrations.shared.settings import read_token_file

    found = [
        (doc.name, " ".join(m.group(1).split()), m.group(2))
        for doc in documents(REPO)
        for m in TOKEN_COMMAND.finditer(doc.read_text())
    ]
    assert found, "no token command in the docs"
    for doc, command, target in found:
        path = tmp_path / "token"
        for _ in range(64):
            subprocess.run(["bash", "-c", command.replace(target, str(path))], check=True)
            path.chmod(0o600)
            assert len(read_token_file(str(path))) >= 16, (doc, command)
