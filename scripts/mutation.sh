#!/usr/bin/env bash
# Mutation testing (docs/mutation.md): mutmut mutates one package's code, runs the package's fast tests
# against each mutant, and reports the kill rate and every mutant no test killed.
#
#   bash scripts/mutation.sh [domain|runner|sglang|all] [--check] [--jobs N] [--keep]
#
# --check  fail when a package's kill rate is below its recorded `floor` (pyproject.toml [tool.mutmut.*]),
#          or when a package's run outlives KVCR_MUTATION_TIMEOUT seconds (default 900): the CI variant
# --jobs   parallel mutants (default: the CPU count); runs are niced, the machine stays usable
# --keep   reuse .mutation/PKG from the last run: only changed functions and new tests are rerun
#
# Packages, their files and their tests: pyproject.toml [tool.mutmut.*]. Work and results stay in
# .mutation/PKG (ignored by git): `cd .mutation/PKG && ../../.venv/bin/mutmut show NAME` shows a mutant.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
BIN="${KVCR_VENV:-$REPO/.venv}/bin"
[ -x "$BIN/mutmut" ] || bash scripts/install.sh
export SGLANG_CACHE_DIR="$REPO/.cache/sglang" TORCH_EXTENSIONS_DIR="$REPO/.cache/torch_extensions"
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}" PYTHONDONTWRITEBYTECODE=1

packages=() check=() jobs="$(nproc)" keep=0
while [ $# -gt 0 ]; do
    case "$1" in
        --check) check=(--check) ;;
        --jobs) jobs="$2"; shift ;;
        --keep) keep=1 ;;
        all) read -r -a packages <<<"$("$BIN/python" scripts/mutation_report.py packages)" ;;
        -*) echo "mutation.sh: unknown option $1" >&2; exit 2 ;;
        *) packages+=("$1") ;;
    esac
    shift
done
[ ${#packages[@]} -gt 0 ] || read -r -a packages <<<"$("$BIN/python" scripts/mutation_report.py packages)"

status=0
for pkg in "${packages[@]}"; do
    work="$REPO/.mutation/$pkg"
    [ "$keep" = 1 ] || rm -rf "$work"
    mkdir -p "$work"
    # mutmut works in the current directory: kvcr and tests by link, the package's own config.
    ln -sfn "$REPO/kvcr" "$work/kvcr"
    ln -sfn "$REPO/tests" "$work/tests"
    for doc in README.md docs scripts; do ln -sfn "$REPO/$doc" "$work/$doc"; done  # the doc tests read them
    "$BIN/python" scripts/mutation_report.py config "$pkg" >"$work/pyproject.toml"
    started=$SECONDS
    printf '\n== mutation %s (%s jobs, log: %s)\n' "$pkg" "$jobs" "$work/run.log"
    limit=()
    [ ${#check[@]} -eq 0 ] || limit=(timeout "${KVCR_MUTATION_TIMEOUT:-900}")
    if ! (cd "$work" && "${limit[@]}" nice -n 10 "$BIN/mutmut" run --max-children "$jobs") >"$work/run.log" 2>&1; then
        tail -n 40 "$work/run.log" | tr '\r' '\n' | tail -n 20 >&2
        echo "mutation $pkg: mutmut failed or ran out of time after $((SECONDS - started)) s (log: $work/run.log)" >&2
        status=1
        continue
    fi
    grep -a -E 'mutations/second' "$work/run.log" | tail -n 1 || true
    echo "mutation $pkg: $((SECONDS - started)) s"
    "$BIN/python" scripts/mutation_report.py report "$pkg" "$work" "${check[@]}" || status=1
done
exit "$status"
