"""What every ``kvcr`` subcommand's parser shares: the parser and help classes, option types, progress lines."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from kvcr.domain.errors import KvcrError
from kvcr.domain.transports import CROSS_PROCESS
from kvcr.domain.units import parse_byte_size


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line naming the command and its help."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default; flags that are off by default say nothing more."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in text:
            return text
        return text + " (default: %(default)s)"


def _positive(option: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {value}")
        return value

    parse.__name__ = option
    return parse


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {value}")
    return value


def _sizes(text: str, option: str = "--page-sizes") -> list[int]:
    sizes = [parse_byte_size(part.strip(), name=option) for part in text.split(",") if part.strip()]
    if not sizes:
        raise KvcrError(f"{option}: give at least one size, e.g. 64KiB,2MiB")
    return sizes


def _batches(text: str) -> list[int]:
    try:
        batches = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise KvcrError(f"--batches: give page counts separated by commas, got {text!r}") from None
    if not batches or min(batches) <= 0:
        raise KvcrError(f"--batches: every batch must be a positive page count, got {text!r}")
    return batches


def _transports(text: str) -> list[str]:
    transports = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in transports if t not in CROSS_PROCESS]
    if not transports or unknown:
        raise KvcrError(f"--transport: give one or more of {', '.join(CROSS_PROCESS)} (e.g. nixl,shm), got {text!r}")
    return list(dict.fromkeys(transports))


class _Progress:
    """``[i/n] what ... done in Xs`` on stderr, so a long run shows where it is."""

    def __init__(self, total: int, quiet: bool = False) -> None:
        self.total, self.done, self.quiet = total, 0, quiet

    def step(self, what: str, call: Callable[[], Any]) -> Any:
        self.done += 1
        if not self.quiet:
            print(f"[{self.done}/{self.total}] {what} ...", end="", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            result = call()
        except BaseException:
            if not self.quiet:
                print(" failed", file=sys.stderr, flush=True)
            raise
        if not self.quiet:
            print(f" done in {time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)
        return result
