"""The CLI explains itself: every option has help with its default, mistakes are one line."""

import argparse

import pytest

from kvcr.cli import _missing_extras, build_parser, main
from kvcr.cli.common import _Help


def subparsers(parser, path=("kvcr",)):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from subparsers(sub, (*path, name))


def test_every_option_has_help_that_shows_its_default():
    found = 0
    for path, parser in subparsers(build_parser()):
        formatter = _Help(prog=" ".join(path))
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            found += 1
            assert action.help, f"{' '.join(path)} {action.option_strings} has no help"
            text = formatter._get_help_string(action) % {"default": action.default}
            if action.default not in (None, False):
                assert f"(default: {action.default})" in text, (path, action.option_strings)
    assert found > 25


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench", "local", "--pages", "0"], "argument --pages: must be positive, got 0"),
        (["bench", "remote", "--port", "70000"], "argument --port: must be 0..65535, got 70000"),
        (["bench", "locl"], "invalid choice: 'locl'"),
    ],
)
def test_a_bad_option_is_one_line_naming_it(argv, says, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and says in err and err.count("\n") == 1 and "--help" in err


def test_a_bad_value_found_while_running_is_one_line_without_a_traceback(capsys):
    assert main(["bench", "local", "--page-sizes", "64KB?", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcr bench local: ") and "--page-sizes" in err and err.count("\n") == 1
    assert main(["bench", "remote", "--batches", "8,x"]) == 2
    assert "--batches" in capsys.readouterr().err
    for lengths in (
        "1024,x",
        "16",
        "64",
        "8192",
    ):  # refused before any server starts (64: below the prefetch threshold)
        assert main(["bench", "engine", "--lengths", lengths]) == 2
        assert "--lengths" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "absent", "says"),
    [
        (
            ["bench", "local"],
            {"matplotlib"},
            'needs matplotlib, which is not installed: pip install "kvcr-runner[bench]" (or --no-plot)',
        ),
        (["demo"], {"rich"}, 'needs rich, which is not installed: pip install "kvcr-runner[demo]";'),
        (
            ["demo", "--plot", "p.png"],
            {"rich", "matplotlib", "dynamo"},
            'pip install "kvcr-runner[bench,demo,dynamo]" && pip install --no-deps "ai-dynamo==1.6.1"',
        ),
    ],
)
def test_a_command_whose_extra_is_missing_says_which_pip_command_installs_it(argv, absent, says):
    """Both ended in a traceback after the documented install (matplotlib, rich were not named)."""
    message = _missing_extras(build_parser().parse_args(argv), installed=lambda module: module not in absent)
    assert message is not None and says in message


def test_a_command_with_its_extras_or_without_plots_needs_nothing_more():
    parse = build_parser().parse_args
    assert _missing_extras(parse(["bench", "local", "--no-plot"]), installed=lambda module: False) is None
    assert _missing_extras(parse(["demo", "--local-only"]), installed=lambda module: False) is None
    assert _missing_extras(parse(["demo"])) is None  # this checkout's venv has every extra


def test_kvcr_worker_without_dynamo_is_one_line_naming_the_pip_command():
    import subprocess
    import sys

    probe = "import sys; sys.modules['dynamo'] = None; from kvcr.cli import main; sys.exit(main(['worker', '--help']))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip()
    assert line.startswith("kvcr worker: needs Dynamo's Python backend API") and "\n" not in line, line
    assert 'pip install --no-deps "ai-dynamo==1.6.1"' in line
