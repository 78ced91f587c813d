#!/usr/bin/env bash
# The SGLang tests against the oldest SGLang kvcr supports (kvcr/compat.py's minimum, 0.5.22 today),
# so a window is proven at both ends: the rest of the suite runs against the newest (0.5.23, in .venv).
#
#   bash scripts/oldest_sglang.sh [extra pytest args]     (runs tests/integration/sglang)
#
# Only the sglang package differs: it goes --no-deps into .cache/alt/sglang-X (ignored by git) and
# comes first on PYTHONPATH, in front of .venv's 0.5.23, with .venv's torch and every other
# dependency. 0.5.22's own pins differ from 0.5.23's only in CUDA kernels, flashinfer, timm and
# openai, none of which a CPU test imports. About 3.5 minutes on two cores (docs/install.md).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
BIN="${KVCR_VENV:-$REPO/.venv}/bin"
[ -x "$BIN/python" ] || bash scripts/install.sh
export SGLANG_CACHE_DIR="$REPO/.cache/sglang" TORCH_EXTENSIONS_DIR="$REPO/.cache/torch_extensions"
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"

VERSION="$(PYTHONPATH= "$BIN/python" -c 'from kvcr.compat import SUPPORTED; print(SUPPORTED["sglang"].minimum)')"
TARGET="$REPO/.cache/alt/sglang-$VERSION"
if [ ! -f "$TARGET/sglang-$VERSION.dist-info/METADATA" ]; then
    rm -rf "$TARGET"
    PYTHONPATH= "$BIN/python" -m pip --disable-pip-version-check --no-input install -q --no-deps \
        --target "$TARGET" "sglang==$VERSION" 2>&1 | sed -u '/is ignored: it is neither a file nor a directory/d' >&2
fi
export PYTHONPATH="$TARGET"
# the overlay must be what the tests import, or this run proves nothing
"$BIN/python" - "$VERSION" <<'EOF'
import importlib.metadata, os, sys
import sglang
found = importlib.metadata.version("sglang")
if found != sys.argv[1] or not sglang.__file__.startswith(os.environ["PYTHONPATH"]):
    sys.exit(f"oldest_sglang.sh: expected sglang {sys.argv[1]} from the overlay, found {found} at {sglang.__file__}")
print(f"sglang {found} from {sglang.__file__}")
EOF
exec "$BIN/python" -m pytest tests/integration/sglang "$@"
