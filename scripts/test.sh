#!/usr/bin/env bash
# The README's test command: install everything (scripts/install.sh), then lint, type-check,
# check the import contracts and run the whole test suite, real NIXL, SGLang and Dynamo included.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not multiprocess" -x`).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
bash scripts/install.sh
BIN="${KVCR_VENV:-$REPO/.venv}/bin"
export SGLANG_CACHE_DIR="$REPO/.cache/sglang" TORCH_EXTENSIONS_DIR="$REPO/.cache/torch_extensions"
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
step() { printf '\n== %s\n' "$*"; }
step "ruff";          "$BIN/ruff" check . && "$BIN/ruff" format --check .
step "mypy --strict"; "$BIN/mypy"
step "import-linter"; "$BIN/lint-imports"
SMOKE="${KVCR_WHEEL_SMOKE:-$(($# == 0))}"  # the full run (CI) smoke-tests the wheel; =1 forces, =0 skips
step "wheel smoke";   if [ "$SMOKE" = 1 ]; then bash scripts/wheel_smoke.sh; else echo "skipped (KVCR_WHEEL_SMOKE=1 runs it)"; fi
step "pytest";        "$BIN/python" -m pytest "$@"
step "pytest, oldest SGLang"; if [ "${KVCR_OLDEST_SGLANG:-$(($# == 0))}" = 1 ]; then bash scripts/oldest_sglang.sh; else echo "skipped (KVCR_OLDEST_SGLANG=1 runs it)"; fi
step "mutation (domain)"; if [ "${KVCR_MUTATION:-$(($# == 0))}" = 1 ]; then bash scripts/mutation.sh domain --check; else echo "skipped (KVCR_MUTATION=1 runs it)"; fi
