"""Which SGLang, NIXL and Dynamo this kvcr supports, checked before any of them is imported.

kvcr hooks SGLang's internals and calls NIXL's and Dynamo's APIs as they are in the versions below;
another version would fail deep inside the engine. Every entry point (the SGLang backend, its
plugin, the NIXL data plane, the Dynamo worker, ``kvcr doctor``) calls :func:`ensure_supported`
first and an operator gets one line naming what was found and what is supported.

It also detects the import-name clash with NVIDIA's KV Cache Runner: the PyPI distribution ``kvcr``
installs an import package ``kvcr`` too, so installing both into one environment silently
overwrites one with the other (``kvcr/__init__.py`` is in both).

Standard library only (``importlib.metadata``): it must work when everything else is broken.
``python -m kvcr.compat`` prints every finding and exits 1 on a problem.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from kvcr.domain.errors import KvcrError

log = logging.getLogger(__name__)

DISTRIBUTION = "kvcr-runner"
IMPORT_PACKAGE = "kvcr"
ALLOW_ENV = "KVCR_ALLOW_UNSUPPORTED"


@dataclass(frozen=True, slots=True)
class Supported:
    """One part kvcr runs against: the distributions that carry it and the versions verified."""

    key: str
    label: str
    distributions: tuple[str, ...]
    minimum: str
    below: str
    needed_for: str
    install: str

    @property
    def spec(self) -> str:
        return f">={self.minimum},<{self.below}"


# pyproject.toml states the same ranges in its extras (tests/packaging/test_metadata.py).
SUPPORTED: Mapping[str, Supported] = {
    s.key: s
    for s in (
        Supported(
            "sglang",
            "SGLang",
            ("sglang",),
            "0.5.22",
            "0.5.24",
            "the HiCache backend and its plugin",
            'pip install "sglang>=0.5.22,<0.5.24"',
        ),
        Supported(
            "nixl",
            "NIXL",
            ("nixl", "nixl-cu13", "nixl-cu12"),
            "1.5.1",
            "1.6",
            "transport 'nixl'",
            'pip install "kvcr-runner[nixl]"',
        ),
        Supported(
            "dynamo-runtime",
            "Dynamo runtime",
            ("ai-dynamo-runtime",),
            "1.6.1",
            "1.7",
            "Dynamo hints and the Dynamo worker",
            'pip install "kvcr-runner[dynamo]"',
        ),
        Supported(
            "dynamo",
            "Dynamo",
            ("ai-dynamo",),
            "1.6.1",
            "1.7",
            "the Dynamo worker",
            'pip install --no-deps "ai-dynamo>=1.6.1,<1.7"',
        ),
    )
}


class Status(str, Enum):
    OK = "ok"
    MISSING = "missing"
    UNSUPPORTED = "unsupported"
    CLASH = "clash"


@dataclass(frozen=True, slots=True)
class Finding:
    """The outcome of one check; ``line`` is what an operator reads."""

    check: str
    status: Status
    found: str
    supported: str
    line: str

    @property
    def ok(self) -> bool:
        return self.status is Status.OK


class IncompatibleEnvironment(KvcrError, RuntimeError):
    """A required part is missing, unsupported or shadowed; raised at start-up, the message is one line."""


VersionLookup = Callable[[str], str | None]


def installed_version(distribution: str) -> str | None:
    try:
        return md.version(distribution)
    except md.PackageNotFoundError:
        return None


def own_version() -> str:
    return installed_version(DISTRIBUTION) or "(not installed)"


_RELEASE = re.compile(r"\s*v?(\d+(?:\.\d+)*)(.*)", re.IGNORECASE)
_PRE = re.compile(r"[-_.]?(a|alpha|b|beta|c|rc|pre|preview|dev)\d*", re.IGNORECASE)


def _release(version: str) -> tuple[tuple[int, ...], bool]:
    """PEP 440 release numbers and whether it is a pre- or dev-release (post and local parts ignored)."""
    match = _RELEASE.fullmatch(version)
    if not match:
        raise ValueError(f"not a version: {version!r}")
    numbers = tuple(int(n) for n in match.group(1).split("."))
    rest = match.group(2).split("+", 1)[0]
    return numbers, bool(_PRE.match(rest))


def _padded(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)), b + (0,) * (width - len(b))


def in_range(version: str, minimum: str, below: str) -> bool:
    """``minimum <= version < below``; a pre-release of ``minimum`` is below it, as in PEP 440."""
    try:
        numbers, pre = _release(version)
    except ValueError:
        return False
    low, _ = _release(minimum)
    high, _ = _release(below)
    v, lo = _padded(numbers, low)
    if v < lo or (v == lo and pre):
        return False
    v, hi = _padded(numbers, high)
    return v < hi


def check(key: str, *, version_of: VersionLookup = installed_version) -> Finding:
    """Whether the part ``key`` of :data:`SUPPORTED` is installed in a supported version."""
    part = SUPPORTED[key]
    supported = f"{part.label} {part.spec}"
    found = [(d, v) for d in part.distributions if (v := version_of(d)) is not None]
    if not found:
        return Finding(
            key,
            Status.MISSING,
            "not installed",
            supported,
            f"kvcr: {part.label} is not installed; kvcr-runner {own_version()} needs {supported} for "
            f"{part.needed_for} ({part.install})",
        )
    text = ", ".join(f"{d} {v}" for d, v in found)
    bad = [(d, v) for d, v in found if not in_range(v, part.minimum, part.below)]
    if bad:
        return Finding(
            key,
            Status.UNSUPPORTED,
            text,
            supported,
            f"kvcr: found {', '.join(f'{d} {v}' for d, v in bad)}; kvcr-runner {own_version()} supports "
            f"{supported} for {part.needed_for} ({part.install}; {ALLOW_ENV}=1 starts anyway)",
        )
    return Finding(key, Status.OK, text, supported, f"kvcr: {text}: supported ({supported})")


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def check_import_package(
    *,
    owners: Sequence[str] | None = None,
    version_of: VersionLookup = installed_version,
    loaded: object | None = None,
) -> Finding:
    """Whether any distribution but kvcr-runner installs the import package ``kvcr``.

    ``owners`` defaults to what the installed metadata says (``top_level.txt`` or ``RECORD``);
    ``loaded`` to the imported ``kvcr`` package, whose ``__init__`` must be kvcr-runner's own.
    """
    names = owners if owners is not None else md.packages_distributions().get(IMPORT_PACKAGE, [])
    others = sorted({n for n in names if _normalized(n) != DISTRIBUTION})
    package = loaded if loaded is not None else sys.modules.get(IMPORT_PACKAGE)
    overwritten = package is not None and getattr(package, "__distribution__", None) != DISTRIBUTION
    supported = f"only {DISTRIBUTION} installs '{IMPORT_PACKAGE}'"
    if not others and not overwritten:
        return Finding("import-package", Status.OK, DISTRIBUTION, supported, f"kvcr: {supported}")
    who = ", ".join(f"{n} {version_of(n) or '?'}" for n in others) or "another distribution"
    where = getattr(package, "__file__", None) or "?"
    what = f"{where} is not kvcr-runner's; " if overwritten else ""
    return Finding(
        "import-package",
        Status.CLASH,
        who,
        supported,
        f"kvcr: the import package '{IMPORT_PACKAGE}' is also installed by {who} (NVIDIA's KV Cache Runner "
        f"uses the same name); {what}one overwrites the other. Keep them in separate environments: "
        f'pip uninstall {" ".join(others) or "kvcr"} && pip install --force-reinstall --no-deps "{DISTRIBUTION}"',
    )


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0]


def check_base_dependencies(*, version_of: VersionLookup = installed_version) -> Finding:
    """Whether every base dependency kvcr-runner declares is installed (an install with --no-deps)."""
    requires = md.requires(DISTRIBUTION) if installed_version(DISTRIBUTION) else None
    if requires is None:
        return Finding("base", Status.MISSING, "not installed", DISTRIBUTION, f"kvcr: {DISTRIBUTION} is not installed")
    names = [_requirement_name(r) for r in requires if "extra" not in r.partition(";")[2]]
    missing = [n for n in names if version_of(n) is None]
    supported = f"{DISTRIBUTION} base dependencies"
    if missing:
        return Finding(
            "base",
            Status.MISSING,
            ", ".join(missing) + " missing",
            supported,
            f'kvcr: {", ".join(missing)} not installed; {DISTRIBUTION} needs them (pip install "{DISTRIBUTION}")',
        )
    return Finding("base", Status.OK, ", ".join(names), supported, f"kvcr: base dependencies installed ({len(names)})")


def doctor_findings(*, version_of: VersionLookup = installed_version) -> list[Finding]:
    """Every check, for ``kvcr doctor``: a MISSING part is a problem only where it is used."""
    found = [check_import_package(version_of=version_of), check_base_dependencies(version_of=version_of)]
    found.extend(check(key, version_of=version_of) for key in SUPPORTED)
    return found


def ensure_supported(
    *keys: str,
    version_of: VersionLookup = installed_version,
    environ: Mapping[str, str] = os.environ,
) -> list[Finding]:
    """The start-up gate: the name clash and the parts ``keys`` (of :data:`SUPPORTED`).

    Raises :class:`IncompatibleEnvironment` with one line for a missing part, an unsupported
    version or a name clash. ``KVCR_ALLOW_UNSUPPORTED=1`` turns the last two into a logged warning
    (a part that is missing fails at import anyway). Returns every finding.
    """
    unknown = [k for k in keys if k not in SUPPORTED]
    if unknown:
        raise ValueError(f"unknown compatibility check {unknown[0]!r}; known: {', '.join(SUPPORTED)}")
    findings = [check_import_package(version_of=version_of)]
    findings.extend(check(key, version_of=version_of) for key in keys)
    allow = environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes")
    for finding in findings:
        if finding.ok:
            continue
        if finding.status is Status.MISSING or not allow:
            raise IncompatibleEnvironment(finding.line)
        log.warning("%s [%s=1: starting anyway]", finding.line, ALLOW_ENV)
    return findings


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvcr.compat``: one line per check; exit 1 on a clash, an unsupported version or a
    missing base dependency (an optional part that is not installed is reported, not failed)."""
    del argv
    findings = doctor_findings()
    for finding in findings:
        print(finding.line)
    return 1 if any(is_problem(f) for f in findings) else 0


def is_problem(finding: Finding) -> bool:
    """For ``kvcr doctor``: a clash, an unsupported version or a missing base dependency; an optional part
    that is not installed is not (the entry point that needs it refuses to start instead)."""
    return finding.status in (Status.CLASH, Status.UNSUPPORTED) or (
        finding.check == "base" and finding.status is Status.MISSING
    )


if __name__ == "__main__":
    sys.exit(main())
