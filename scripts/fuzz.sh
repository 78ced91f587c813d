#!/usr/bin/env bash
# The fuzz suite (tests/fuzz, marker `fuzz`; docs/fuzzing.md says what it covers).
#
#   bash scripts/fuzz.sh           the short budget CI runs inside scripts/test.sh (derandomized)
#   bash scripts/fuzz.sh --long    the long variant: over 100,000 random cases in all
#
# Extra arguments go to pytest (e.g. `-k hints`). KVCR_FUZZ_REPORT=path also writes the cases run
# per target as JSON. A failure prints the @reproduce_failure line; the long variant keeps
# Hypothesis' example database under .hypothesis/, so the next run tries the failing case first.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PROFILE=ci
if [ "${1:-}" = "--long" ]; then
  PROFILE=long
  shift
fi
bash scripts/install.sh
BIN="${KVCR_VENV:-$REPO/.venv}/bin"
export SGLANG_CACHE_DIR="$REPO/.cache/sglang" TORCH_EXTENSIONS_DIR="$REPO/.cache/torch_extensions"
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
export KVCR_FUZZ_PROFILE="$PROFILE"
LIMIT=300
[ "$PROFILE" = long ] && LIMIT=7200  # one long target may run for many minutes
exec "$BIN/python" -m pytest tests/fuzz -m fuzz --timeout="$LIMIT" --durations=0 "$@"
