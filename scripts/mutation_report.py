"""The two halves of scripts/mutation.sh around `mutmut run`: a package's config, and its report.

``config PKG``: the pyproject.toml a package's run reads, i.e. the repo's with ``[tool.mutmut]``
flattened to the shared table plus ``[tool.mutmut.PKG]`` (mutmut reads one table from the working
directory; the package tables are ours).

``report PKG WORKDIR [--check]``: the kill rate of a finished run and every mutant that was not
killed, less the equivalent ones listed in tests/mutation/equivalent.txt; with ``--check`` it fails
when the rate is below the package's ``floor``. A listed mutant counts as equivalent only while its
mutated function is the one that was reviewed (a hash of its source), so a renumbered mutant after
a code change is reported, never silently excused.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import json
import re
import sys
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EQUIVALENT = REPO / "tests" / "mutation" / "equivalent.txt"
_OWN_KEYS = {"floor"}  # package-table keys mutmut does not know
_HEADER = re.compile(r"^\[\[?([^\]]+)\]\]?\s*(#.*)?$")

# mutmut's exit codes per mutant (mutmut/stats.py), grouped the way this report counts them.
_KILLED = {1: "killed", 3: "killed", 37: "type check"}
_TIMEOUT = {36, 24, -24, 152, 255}
# The test process died (SIGSEGV, SIGABRT, or 75: kvcr's fail-stop ended it): the mutant is detected.
_CRASHED = {-11, -6, 75}
_SURVIVED = {0: "survived", 5: "no tests", 33: "no tests"}
_DETECTED = frozenset({"killed", "type check", "timeout", "crashed"})


def _packages() -> dict[str, dict[str, object]]:
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mutmut"]
    return {k: v for k, v in tool.items() if isinstance(v, dict)}


def _shared() -> dict[str, object]:
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mutmut"]
    return {k: v for k, v in tool.items() if not isinstance(v, dict)}


def write_config(package: str) -> str:
    packages = _packages()
    if package not in packages:
        raise SystemExit(f"mutation: unknown package {package!r}; pyproject.toml has {sorted(packages)}")
    kept: list[str] = []
    skipping = False
    for line in (REPO / "pyproject.toml").read_text().splitlines():
        header = _HEADER.match(line.strip())
        if header:
            name = header.group(1).strip()
            skipping = name == "tool.mutmut" or name.startswith("tool.mutmut.")
        if not skipping:
            kept.append(line)
    table = {**_shared(), **{k: v for k, v in packages[package].items() if k not in _OWN_KEYS}}
    kept += ["", "[tool.mutmut]"]
    kept += [f"{key} = {json.dumps(value)}" for key, value in table.items()]  # JSON scalars and lists are TOML
    return "\n".join(kept) + "\n"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # source file, relative to the repo
    status: str
    fingerprint: str  # hash of the mutated function's source, its own name removed
    diff: str  # the changed lines against the original function


def _functions(mutated: Path) -> dict[str, str]:
    """Source of every top-level function and method in a mutated file, by mutmut's mangled name."""
    text = mutated.read_text()
    tree = ast.parse(text)
    lines = text.splitlines()  # once: ast.get_source_segment splits the whole file on every call

    def segment(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
        # what get_source_segment returns: from col_offset on the first line to end_col_offset on
        # the last (offsets count UTF-8 bytes)
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        end_col = node.end_col_offset if node.end_col_offset is not None else len(lines[last].encode())
        if first == last:
            return lines[first].encode()[node.col_offset : end_col].decode()
        head = lines[first].encode()[node.col_offset :].decode()
        tail = lines[last].encode()[:end_col].decode()
        return "\n".join([head, *lines[first + 1 : last], tail])

    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found[node.name] = segment(node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    found[item.name] = segment(item)
    return found


def _fingerprint(source: str, mangled: str) -> str:
    return hashlib.sha256(source.replace(mangled, "MUTANT").encode()).hexdigest()[:12]


def _diff(original: str, mutated: str) -> str:
    lines = difflib.unified_diff(original.splitlines(), mutated.splitlines(), lineterm="", n=0)
    return "\n".join(f"      {line.strip()}" for line in lines if line[:1] in "+-" and line[:3] not in ("+++", "---"))


def collect(workdir: Path) -> list[Mutant]:
    mutants_dir = workdir / "mutants"
    found: list[Mutant] = []
    for meta in sorted(mutants_dir.rglob("*.py.meta")):
        source = meta.relative_to(mutants_dir).as_posix()[: -len(".meta")]
        codes = json.loads(meta.read_text()).get("exit_code_by_key", {})
        if not codes:
            continue
        functions = _functions(mutants_dir / source)
        for name, code in sorted(codes.items()):
            mangled = name.rsplit(".", 1)[-1]
            status = _status(code)
            base = mangled.rsplit("__mutmut_", 1)[0]
            mutated = functions.get(mangled, "")
            diff = ""
            if status not in _DETECTED:  # only a mutant left standing is shown with its change
                original = functions.get(base + "__mutmut_orig", "").replace(base + "__mutmut_orig", mangled)
                diff = _diff(original, mutated)
            found.append(Mutant(name, source, status, _fingerprint(mutated, mangled), diff))
    return found


def _status(code: int | None) -> str:
    if code in _KILLED:
        return _KILLED[code]
    if code in _TIMEOUT:
        return "timeout"
    if code in _CRASHED:
        return "crashed"
    if code in _SURVIVED:
        return _SURVIVED[code]
    return "not checked" if code is None else f"other ({code})"


def equivalents() -> dict[str, tuple[str, str]]:
    """name -> (fingerprint, reason) from tests/mutation/equivalent.txt."""
    listed: dict[str, tuple[str, str]] = {}
    if not EQUIVALENT.exists():
        return listed
    for number, raw in enumerate(EQUIVALENT.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(maxsplit=2)
        if len(parts) != 3:
            raise SystemExit(f"{EQUIVALENT}:{number}: expected '<mutant> <fingerprint> <reason>'")
        listed[parts[0]] = (parts[1], parts[2])
    return listed


def report(package: str, workdir: Path, check: bool, diffs: bool = False) -> int:
    floor = float(_packages()[package].get("floor", 0.0))  # type: ignore[arg-type]
    mutants = collect(workdir)
    if not mutants:
        print(f"mutation {package}: no results in {workdir}/mutants (did mutmut run?)")
        return 1
    listed = equivalents()
    counts = Counter(m.status for m in mutants)
    detected = _DETECTED
    equivalent = [m for m in mutants if m.status not in detected and listed.get(m.name, ("",))[0] == m.fingerprint]
    stale = [m for m in mutants if m.name in listed and listed[m.name][0] != m.fingerprint]
    open_ = [m for m in mutants if m.status not in detected and m not in equivalent]
    killed = sum(counts[s] for s in detected)
    counted = len(mutants) - len(equivalent)
    rate = 100.0 * killed / counted if counted else 100.0
    raw = 100.0 * killed / len(mutants)
    print(f"\nmutation {package}: {len(mutants)} mutants, " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    print(f"mutation {package}: {len(equivalent)} listed as equivalent (tests/mutation/equivalent.txt)")
    print(f"mutation {package}: kill rate {rate:.1f} % of {counted} non-equivalent mutants ({raw:.1f} % of all)")
    for m in stale:
        print(f"  stale equivalent entry (its function changed; review it again): {m.name} {m.fingerprint}")
    if open_:
        print(f"mutation {package}: {len(open_)} not killed (show one: cd {workdir} && mutmut show NAME):")
        for m in open_:
            print(f"  {m.status:9} {m.name} {m.fingerprint}")
            if diffs:
                print(m.diff)
    if check and rate < floor:
        print(f"mutation {package}: FAILED, kill rate {rate:.1f} % is below the recorded {floor:.1f} % (pyproject)")
        return 1
    if check:
        print(f"mutation {package}: ok, kill rate {rate:.1f} % >= the recorded {floor:.1f} %")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mutation_report.py")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("config").add_argument("package")
    rep = sub.add_parser("report")
    rep.add_argument("package")
    rep.add_argument("workdir", type=Path)
    rep.add_argument("--check", action="store_true")
    rep.add_argument("--diffs", action="store_true", help="print each open mutant's change")
    sub.add_parser("packages")
    args = parser.parse_args(argv)
    if args.command == "config":
        sys.stdout.write(write_config(args.package))
        return 0
    if args.command == "packages":
        print(" ".join(_packages()))
        return 0
    return report(args.package, args.workdir, args.check, args.diffs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
