"""SGLang 0.5.23's real classes on CPU: caches stay in the repo, torchvision is an import-only stub."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
for var, sub in (
    ("SGLANG_CACHE_DIR", "sglang"),
    ("TORCH_EXTENSIONS_DIR", "torch_extensions"),
    ("TRITON_CACHE_DIR", "triton"),
    ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
    ("HF_HOME", "huggingface"),
):
    os.environ.setdefault(var, str(REPO / ".cache" / sub))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
_STUBS = str(REPO / "kvcr" / "testing" / "stubs")
if _STUBS not in sys.path:
    sys.path.append(_STUBS)


def pytest_collection_modifyitems(items):
    for item in items:
        if "integration/sglang" in str(item.fspath):
            item.add_marker(pytest.mark.sglang)


@pytest.fixture(scope="session", autouse=True)
def _parallel_context():
    """SGLang reads its parallel layout from a process-wide context; stamp a single-rank one."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
