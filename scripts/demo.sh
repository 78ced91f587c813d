#!/usr/bin/env bash
# The README's demo command: install, then run `kvcr demo` (options pass through: --workers, --turns,
# --discovery etcd, --event-plane nats, --engine stand-in with --page-kib and --plot FILE.png, --local-only).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/install.sh"
exec "${KVCR_VENV:-$REPO/.venv}/bin/kvcr" demo "$@"
