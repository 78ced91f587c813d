"""kvcr doctor's SGLang checks against the installed SGLang (0.5.23, or the oldest supported in CI)."""

import os
import subprocess
import sys
from pathlib import Path

from kvcr.doctor import Status, check_page_keys, check_sglang_version
from tests.integration.sglang import sg

REPO = Path(__file__).resolve().parents[3]
PROBE = (
    "import kvcr.doctor as d\n"
    "f = d.check_sglang_version()\n"
    "print(f.status.value, f.detail, flush=True)\n"
    "import sglang.srt.mem_cache.pool_host.mha\n"  # the host pool SGLang builds before it loads kvcr
)


def test_the_installed_sglang_is_supported_and_fits():
    finding = check_sglang_version()
    assert finding.status is Status.OK
    assert finding.detail == f"sglang {sg.SGLANG}; kvcr's backend imports and its plugin's hook points fit"


def test_an_sglang_whose_host_pool_cannot_import_fails_the_doctor_as_it_fails_the_backend():
    """Without torchvision (a CPU host without the stub) SGLang's host pool does not import: the
    doctor said "sglang 0.5.23" (ok) while SGLang's factory could not load kvcr's backend."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no torchvision stub on the path
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env, cwd="/")
    verdict = done.stdout.strip().splitlines()[0]
    assert verdict.startswith("FAIL sglang 0.5.23: kvcr's backend cannot import sglang.srt.mem_cache.pool_host.mha")
    assert "torchvision" in verdict and verdict.endswith("on PYTHONPATH, docs/engine-on-cpu.md)")  # where the fix is
    assert done.returncode != 0 and "No module named 'torchvision'" in done.stderr  # what the backend then hits


def test_kvcr_page_keys_equal_sglangs_own_hashes():
    finding = check_page_keys()
    assert finding.status is Status.OK, finding.detail
    widths = "64-bit token ids" if sg.hashes_wide_token_ids() else "32-bit token ids, the widest this SGLang hashes"
    assert f"(page sizes 2, 16, 64; {widths})" in finding.detail
