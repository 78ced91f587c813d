"""The distribution's metadata composes with the engine's own pins and states what kvcr.compat checks.

The bug this guards against: an extra that pinned torch==2.13.0 while SGLang 0.5.23 pins
torch==2.14.1, so `pip install "kvcr-runner[sglang]"` could never resolve. The pins compared here
are read from the installed SGLang, NIXL and Dynamo metadata, not restated.
"""

import importlib.metadata as md
import tomllib
from pathlib import Path
from typing import cast

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from kvcr.compat import SUPPORTED, installed_version

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
ENGINE_OWNED = {"torch", "torchvision", "torchaudio", "triton"}


def ours(*extras: str) -> list[Requirement]:
    found = [Requirement(r) for r in PROJECT["dependencies"]]
    for extra in extras:
        found.extend(Requirement(r) for r in EXTRAS[extra])
    return found


def by_name(requirements: list[Requirement], name: str) -> Requirement:
    (match,) = [r for r in requirements if canonicalize_name(r.name) == name]
    return match


def pinned_versions() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonicalize_name(name)] = version
    return pins


def runtime_requirements(distribution: str) -> list[Requirement]:
    """A distribution's requirements that apply here without extras (what pip resolves for it)."""
    env = cast("dict[str, str]", dict(default_environment(), extra=""))  # Environment: a TypedDict of str
    found = []
    for text in md.requires(distribution) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(env):
            found.append(req)
    return found


def test_the_extras_state_the_ranges_kvcr_compat_checks():
    assert len(EXTRAS["sglang"]) == 1  # SGLang and nothing else: it brings its own pins
    for extra, name, key in (
        ("sglang", "sglang", "sglang"),
        ("nixl", "nixl", "nixl"),
        ("dynamo", "ai-dynamo-runtime", "dynamo-runtime"),
    ):
        assert by_name(ours(extra), name).specifier == SpecifierSet(SUPPORTED[key].spec), extra


@pytest.mark.parametrize("extra", ["", "sglang", "nixl", "dynamo"])
def test_torch_is_left_to_the_engine(extra):
    names = {canonicalize_name(r.name) for r in ours(*([extra] if extra else []))}
    assert not names & ENGINE_OWNED


def admits_a_common_version(a: SpecifierSet, b: SpecifierSet, candidates: set[str]) -> bool:
    for text in candidates:
        try:
            version = Version(text)
        except InvalidVersion:
            continue
        if a.contains(version, prereleases=True) and b.contains(version, prereleases=True):
            return True
    return False


@pytest.mark.parametrize("theirs", ["sglang", "nixl-cu13", "ai-dynamo-runtime"])
def test_every_shared_requirement_admits_a_version_both_sides_accept(theirs):
    pins = pinned_versions()
    mine = {canonicalize_name(r.name): r for r in ours("sglang", "nixl", "dynamo")}
    shared = 0
    for req in runtime_requirements(theirs):
        name = canonicalize_name(req.name)
        if name not in mine:
            continue
        shared += 1
        candidates = {s.version for s in (*req.specifier, *mine[name].specifier) if s.operator in ("==", ">=", "<=")}
        candidates |= {v for v in (pins.get(name), installed_version(name)) if v}
        assert admits_a_common_version(mine[name].specifier, req.specifier, candidates), (
            f"kvcr-runner needs {mine[name]}, {theirs} needs {req}"
        )
    assert shared, f"{theirs} shares no requirement with kvcr-runner: the check compared nothing"


def test_the_installed_metadata_is_this_pyproject():
    meta = md.metadata("kvcr-runner")
    assert set(meta.get_all("Provides-Extra") or []) == set(EXTRAS)
    plugins = {ep.name: ep.value for ep in md.entry_points(group="sglang.srt.plugins")}
    assert plugins["kvcr"] == "kvcr.integrations.sglang.plugin:load"
