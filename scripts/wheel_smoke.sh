#!/usr/bin/env bash
# kvcr-runner as an operator installs it: build the sdist and the wheel (python -m build), make a
# fresh venv that already holds SGLang 0.5.23 (the CPU recipe: CPU torch first, SGLang and triton
# --no-deps, then scripts/sglang-cpu.txt), run the README's install commands there, check `pip check`,
# and run tests/packaging/smoke_installed.py with that venv's interpreter. The dev venv (.venv) is
# only used to run `build`; nothing is installed into it.
#
# Work folder: $KVCR_SMOKE_DIR (default <repo>/.cache/wheel-smoke), rebuilt on every run; its venv is
# removed after a pass unless KVCR_SMOKE_KEEP=1. KVCR_SMOKE_DYNAMO=0 skips the Dynamo-worker part.
# About 2.5 minutes on the 2-core CPU machine, mostly pip downloading and unpacking SGLang's set.
# See docs/install.md.
set -euo pipefail
unset PYTHONPATH  # the dev tree's stubs must not leak into "the operator's" environment

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${KVCR_SMOKE_DIR:-$REPO/.cache/wheel-smoke}"
DEV_PY="${KVCR_VENV:-$REPO/.venv}/bin/python"
CONSTRAINTS="$REPO/constraints.txt"
START=$SECONDS

log() { printf '[wheel_smoke %4ds] %s\n' "$((SECONDS - START))" "$*" >&2; }
# pip noise: find-links dirs without the package, and its post-install conflict report for the parts
# installed --no-deps on purpose (SGLang on CPU, ai-dynamo without aisimulate); `pip check` below is
# the gate for everything else.
quiet() {
    sed -u -e '/is ignored: it is neither a file nor a directory/d' \
        -e "/^ERROR: pip's dependency resolver does not currently take into account/d" \
        -e '/^sglang 0\.5\.23 requires /d' -e '/^ai-dynamo 1\.6\.1 requires aisimulate/d' >&2
}

PY="${KVCR_PYTHON:-}"
if [ -z "$PY" ]; then
    if command -v python3.11 >/dev/null 2>&1; then PY=python3.11; else PY=python3; fi
fi

rm -rf "$WORK"
mkdir -p "$WORK/dist"

# 1. sdist + wheel, the way a release is built (isolated build environment); the wheel is built
#    from the unpacked sdist, which proves the sdist is complete.
log "python -m build"
"$DEV_PY" -m build --outdir "$WORK/dist" "$REPO" >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log" >&2; exit 1; }
WHEEL="$(ls "$WORK"/dist/kvcr_runner-*.whl)"  # a platform wheel: it carries the _stream and _board extensions
SDIST="$(ls "$WORK"/dist/kvcr_runner-*.tar.gz)"
log "built $(basename "$SDIST") and $(basename "$WHEEL")"
"$DEV_PY" - "$WHEEL" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
tops = sorted({n.split("/")[0] for n in names})
bad = [t for t in tops if t != "kvcr" and not t.endswith(".dist-info")]
assert not bad, f"the wheel installs more than the kvcr package: {bad}"
assert "kvcr/compat.py" in names and "kvcr/integrations/sglang/plugin.py" in names, "the wheel misses modules"
for ext in ("_stream", "_board"):
    assert any(n.startswith(f"kvcr/adapters/shm/{ext}.") and n.endswith(".so") for n in names), f"no {ext} extension"
PY
for source in _stream.c _board.c; do
    grep -q "/kvcr/adapters/shm/$source\$" <<<"$(tar -tzf "$SDIST")" || { echo "the sdist lacks $source" >&2; exit 1; }
done

# 2. "the operator's SGLang deployment": a fresh venv with SGLang 0.5.23 installed the CPU way.
log "fresh venv $WORK/venv with SGLang 0.5.23 (CPU recipe)"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
PIP=("$VPY" -m pip --disable-pip-version-check --no-input -q)
"${PIP[@]}" install -c "$CONSTRAINTS" torch==2.13.0 2>&1 | quiet
"${PIP[@]}" install -c "$CONSTRAINTS" --no-deps sglang triton 2>&1 | quiet
"${PIP[@]}" install -c "$CONSTRAINTS" -r "$REPO/scripts/sglang-cpu.txt" 2>&1 | quiet
# SGLang imports torchvision unconditionally and PyPI's torchvision cannot load beside CPU torch: the
# CPU recipe uses the dev tree's import-only stub (a GPU deployment has the real one).
SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp -r "$REPO/kvcr/testing/stubs/torchvision" "$REPO/kvcr/testing/stubs/torchvision-0.0.0+stub.dist-info" "$SITE/"
ENGINE_BEFORE="$("$VPY" -c 'import importlib.metadata as m; print(m.version("torch"), m.version("sglang"))')"

# 3. the README's SGLang command, as typed by an operator (no kvcr constraints file).
log "pip install \"kvcr-runner[nixl]\" (the wheel)"
"${PIP[@]}" install "${WHEEL}[nixl]" 2>&1 | quiet
ENGINE_AFTER="$("$VPY" -c 'import importlib.metadata as m; print(m.version("torch"), m.version("sglang"))')"
[ "$ENGINE_BEFORE" = "$ENGINE_AFTER" ] || { echo "the install changed the engine: $ENGINE_BEFORE -> $ENGINE_AFTER" >&2; exit 1; }

# pip check: only SGLang's own complaints (installed --no-deps on CPU) are expected.
pip_check() {
    local allowed="$1" out
    out="$("$VPY" -m pip --disable-pip-version-check check 2>&1 || true)"
    local rest
    rest="$(printf '%s\n' "$out" | grep -v -E "$allowed" | grep -v -E '^No broken requirements found' || true)"
    if [ -n "$rest" ]; then
        printf 'pip check found more than the expected complaints:\n%s\n' "$rest" >&2
        exit 1
    fi
    log "pip check: $(printf '%s\n' "$out" | grep -c -E "$allowed" || true) expected complaint(s) ($2), nothing else"
}
# Expected: requirements SGLang's --no-deps install leaves out, and its CUDA torch pin (CPU torch here).
# A version conflict with anything else (python-dateutil 4 against SGLang's <3, say) fails the check.
SGLANG_EXPECTED='^sglang 0\.5\.23 (requires [^ ]+, which is not installed\.|has requirement torch[=<>~!]=?[^ ]*, but you have torch [^ ]+\+cpu\.)$'
pip_check "$SGLANG_EXPECTED" "SGLang's, installed --no-deps on CPU"

# 4. the smoke test, from outside the checkout so only the installed wheel can be imported.
log "smoke test (installed wheel)"
(
    cd "$WORK"
    export SGLANG_CACHE_DIR="$WORK/cache/sglang" TORCH_EXTENSIONS_DIR="$WORK/cache/torch_extensions"
    export TRITON_CACHE_DIR="$WORK/cache/triton" HF_HOME="$WORK/cache/huggingface" UCX_NET_DEVICES=lo
    # a warm page-hash extension build from the dev tree saves ~7 s of compiling
    [ -d "$REPO/.cache/torch_extensions" ] && mkdir -p "$WORK/cache" && cp -r "$REPO/.cache/torch_extensions" "$WORK/cache/"
    "$VPY" -I "$REPO/tests/packaging/smoke_installed.py"
)

# 5. the README's Dynamo-worker commands in the same environment: kvcr's dynamo extra, then Dynamo
#    itself without its planner-only aisimulate (whose sdist fetches a wheel from outside PyPI).
if [ "${KVCR_SMOKE_DYNAMO:-1}" != "0" ]; then
    log "pip install \"kvcr-runner[dynamo,nixl]\" && pip install --no-deps ai-dynamo==1.6.1"
    "${PIP[@]}" install "${WHEEL}[dynamo,nixl]" 2>&1 | quiet
    "${PIP[@]}" install --no-deps "ai-dynamo==1.6.1" 2>&1 | quiet
    pip_check "$SGLANG_EXPECTED|^ai-dynamo 1\.6\.1 requires aisimulate" "SGLang's and ai-dynamo's aisimulate"
    (
        cd "$WORK"
        "$VPY" -I -c '
from kvcr import compat
found = compat.ensure_supported("sglang", "nixl", "dynamo", "dynamo-runtime", environ={})
import dynamo.common.backend, dynamo.llm  # the worker API and the runtime kvcr uses
print("  ok    dynamo worker environment:", "; ".join(f.found for f in found))
'
    )
fi

log "passed ($(du -sh "$WORK/venv" | cut -f1) venv; sdist $(du -h "$SDIST" | cut -f1), wheel $(du -h "$WHEEL" | cut -f1))"
# the venv is several GB: keep it only when asked (KVCR_SMOKE_KEEP=1) or when a step failed (set -e)
[ "${KVCR_SMOKE_KEEP:-0}" = "1" ] || rm -rf "$WORK/venv" "$WORK/cache"
