"""The commands and configs that README.md and docs/*.md show an operator, pulled out for checking.

``tests/unit/test_docs.py`` checks each one the way an operator would run it: a ``kvcr ...`` line
must parse with kvcr's own parser, a ``python -m X`` module must exist, a ``bash scripts/...``
script too, a pip extra must be one the wheel declares, and every
``--hicache-storage-backend-extra-config`` JSON must pass kvcr's settings validation. A block an
author means to fail is preceded by the line ``<!-- docs-test: expect-failure -->``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

EXPECT_FAILURE = "<!-- docs-test: expect-failure -->"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_PLACEHOLDER = re.compile(r"<[^<>]+>")
_SEPARATORS = {"&&", "||", ";", "|", "&"}


@dataclass(frozen=True, slots=True)
class Command:
    """One shell command of a doc's code block: where it is, its words, whether it should fail."""

    doc: str
    line: int
    words: tuple[str, ...]
    expect_failure: bool

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def documents(repo: Path) -> list[Path]:
    """README.md and every page under docs/."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def commands(doc: Path, repo: Path) -> Iterator[Command]:
    """Every command in the doc's ``bash`` blocks (and unlabelled ones that start with ``$``-free shell)."""
    text = doc.read_text()
    name = str(doc.relative_to(repo))
    for fence in _FENCE.finditer(text):
        if fence.group(1) != "bash":
            continue
        before = text[: fence.start()].rstrip().rsplit("\n", 1)[-1].strip()
        first_line = text.count("\n", 0, fence.start()) + 2
        body = fence.group(2)
        for offset, logical in _logical_lines(body):
            for words in _split(logical):
                yield Command(name, first_line + offset, words, before == EXPECT_FAILURE)


def _logical_lines(body: str) -> Iterator[tuple[int, str]]:
    """Lines joined across trailing backslashes and open quotes, with their offset in the block."""
    pending, start = "", 0
    for offset, raw in enumerate(body.splitlines()):
        if not pending:
            start = offset
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        pending += raw
        if _quotes_open(pending):
            pending += "\n"
            continue
        yield start, pending
        pending = ""
    if pending:
        yield start, pending


def _quotes_open(line: str) -> bool:
    try:
        list(_split(line))
    except ValueError:  # shlex: "No closing quotation"
        return True
    return False


def _split(line: str) -> Iterator[tuple[str, ...]]:
    """The simple commands of one shell line (``a && b; c | d``), comments and placeholders handled."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words: list[str] = []
    for token in lexer:
        if token in _SEPARATORS:
            if words:
                yield tuple(words)
            words = []
        else:
            words.append(token)
    if words:
        yield tuple(words)


_INLINE = re.compile(r"`(kvcr [a-z][^`|\[:]*)`")  # not a message (`kvcr worker: ...`)
_INLINE_VALUES = {"N": "2", "P": "9464", "FILE": "report.json"}


def inline_commands(doc: Path, repo: Path) -> Iterator[Command]:
    """``kvcr ...`` in inline code spans (prose), with ``N``-style placeholders given values."""
    text = doc.read_text()
    for match in _INLINE.finditer(text):
        words = tuple(_INLINE_VALUES.get(word, word) for word in match.group(1).split())
        yield Command(str(doc.relative_to(repo)), text.count("\n", 0, match.start()) + 1, words, False)


def without_env(words: tuple[str, ...]) -> tuple[str, ...]:
    """The command after leading ``VAR=value`` assignments."""
    index = 0
    while index < len(words) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[index]):
        index += 1
    return words[index:]


def fill_placeholders(text: str, values: dict[str, str]) -> str:
    """``<port>`` and friends replaced by what a check can use; unknown ones by ``placeholder``."""
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(0), "placeholder"), text)


def option(words: tuple[str, ...], name: str) -> str | None:
    """The value of ``name`` in ``words`` (``--name value`` or ``--name=value``)."""
    for index, word in enumerate(words):
        if word == name and index + 1 < len(words):
            return words[index + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def setting_tables(doc: Path) -> Iterator[tuple[int, str]]:
    """Each setting name in the doc's tables whose first column is headed ``key`` or ``setting``."""
    in_table = False
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells and cells[0] in ("key", "setting"):
            in_table = True
            continue
        if in_table and not set(cells[0]) <= {"-", ":"}:
            for name in re.findall(r"`([^`]+)`", cells[0]):
                yield number, name
