"""A real SGLang 0.5.23 server on the CPU with kvcr as its HiCache L3 backend (tests, benchmarks, demo).

:func:`write_model` writes a tiny Llama (a few layers, a word-level vocabulary, a chat template,
weights drawn from a seed) that SGLang loads like any checkpoint. :class:`EngineServer` starts
``python -m sglang.launch_server`` on it in its own process group, with kvcr selected through the
documented ``--hicache-storage-backend dynamic`` route, waits a bounded time for ``/health``, and
stops it by process group. Its log goes to a file whose tail every failure message carries.

On a CPU-only machine the server needs the shims in ``engine_shims/`` (see its ``sitecustomize``):
only the launched process gets them, through ``PYTHONPATH``. The CPU-only flags are in
:data:`CPU_FLAGS`; docs/engine-on-cpu.md explains each.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcr.testing.ports import free_port_block

REPO = Path(__file__).resolve().parents[2]
SHIMS = Path(__file__).resolve().parent / "engine_shims"
STUBS = Path(__file__).resolve().parent / "stubs"  # the import-only torchvision (shipped in the wheel)
SPECIAL = ("<unk>", "<s>", "</s>")
ROLES = ("system:", "user:", "assistant:")
PAGE_SIZE = 16
# What a CPU-only server needs beyond the GPU launch (docs/engine-on-cpu.md says why for each).
CPU_FLAGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--hicache-io-backend", "direct",
    "--hicache-mem-layout", "page_first_direct",
    "--skip-server-warmup",
    "--sleep-on-idle",
)  # fmt: skip


def word(i: int) -> str:
    return f"w{i}"


def token_id(i: int) -> int:
    """The token id of ``word(i)``."""
    return len(SPECIAL) + i


def prompt_ids(length: int, seed: int = 0, words: int = 1000) -> list[int]:
    """``length`` token ids of words, a fixed pseudo-random sequence per ``seed``."""
    state = seed * 2654435761 + 12345
    ids = []
    for _ in range(length):
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        ids.append(token_id((state >> 33) % words))
    return ids


def write_model(directory: Path, *, seed: int = 0, words: int = 1000, layers: int = 2, hidden: int = 64) -> Path:
    """A tiny Llama checkpoint SGLang serves (idempotent for the same arguments); returns ``directory``."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {text: i for i, text in enumerate([*SPECIAL, *(word(i) for i in range(words)), *ROLES])}
    heads, kv_heads, intermediate = 4, 2, 2 * hidden
    head_dim = hidden // heads
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "vocab_size": len(vocab),
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, text in enumerate(SPECIAL)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }  # fmt: skip
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 4096,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}",
    }
    gen = torch.Generator().manual_seed(seed)

    def weight(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": weight(len(vocab), hidden, scale=1.0),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": weight(len(vocab), hidden, scale=0.5),
    }
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        tensors |= {
            prefix + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            prefix + "self_attn.q_proj.weight": weight(heads * head_dim, hidden, scale=0.5),
            prefix + "self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden, scale=0.5),
            prefix + "self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden, scale=0.3),
            prefix + "self_attn.o_proj.weight": weight(hidden, heads * head_dim, scale=0.3),
            prefix + "mlp.gate_proj.weight": weight(intermediate, hidden, scale=0.3),
            prefix + "mlp.up_proj.weight": weight(intermediate, hidden, scale=0.3),
            prefix + "mlp.down_proj.weight": weight(hidden, intermediate, scale=0.3),
        }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    for name, content in (
        ("config.json", config),
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", {"bos_token_id": 1, "eos_token_id": 2}),
    ):
        (directory / name).write_text(json.dumps(content))
    return directory


def kvcr_extra_config(control_port: int, **settings: Any) -> dict[str, Any]:
    """The ``--hicache-storage-backend-extra-config`` selecting kvcr (docs/sglang.md), for loopback."""
    return {
        "backend_name": "kvcr",
        "module_path": "kvcr.integrations.sglang",
        "class_name": "KvcrHiCacheStorage",
        "interface_v1": 1,
        "hicache_storage_pass_prefix_keys": True,
        "transport": "nixl",
        "control_host": "127.0.0.1",
        "control_port": control_port,
        "dram_bytes": "64MiB",
        "prefetch_timeout_base": 15.0,
        **settings,
    }


def kvcr_l3_args(extra_config: Mapping[str, Any]) -> tuple[str, ...]:
    """SGLang's flags for HiCache with kvcr as its L3 (write-through, the documented dynamic backend)."""
    return (
        "--enable-hierarchical-cache",
        "--hicache-write-policy", "write_through",
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-backend-extra-config", json.dumps(dict(extra_config)),
    )  # fmt: skip


def cpu_engine_environment(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` plus what a CPU SGLang engine needs: shims and stubs first on its path, caches in the repo."""
    env = dict(base)
    for var, sub in (
        ("SGLANG_CACHE_DIR", "sglang"),
        ("TORCH_EXTENSIONS_DIR", "torch_extensions"),
        ("TRITON_CACHE_DIR", "triton"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("HF_HOME", "huggingface"),
        ("OUTLINES_CACHE_DIR", "outlines"),
    ):
        env.setdefault(var, str(REPO / ".cache" / sub))
    path = [str(SHIMS), str(REPO), env.get("PYTHONPATH", ""), str(STUBS)]
    env["PYTHONPATH"] = os.pathsep.join(part for part in path if part)
    # torch's OpenMP threads spin after each parallel region by default; two engines computing at
    # once on a small machine then wait on each other's spinning threads (docs/engine-on-cpu.md).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env |= {
        "SGLANG_USE_CPU_ENGINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    return env


def stop_process_group(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM ``proc``'s process group (SIGCONT first, in case a test froze it), SIGKILL after ``grace_s``."""
    for sig in (signal.SIGCONT, signal.SIGTERM):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the scheduler and detokenizer children too
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as ``{'name{labels}': value}``."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                samples[name] = float(value)
    return samples


def metric_sum(samples: Mapping[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples that carry ``labels`` (and any others)."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(v for sample, v in samples.items() if sample.startswith(name + "{") and all(w in sample for w in wanted))


class EngineError(RuntimeError):
    """The server did not start, died, or answered an error; the message ends with its log's tail."""


@dataclass
class EngineServer:
    """One SGLang server process (group) with kvcr as L3. Use as a context manager or call start/stop."""

    model: Path
    log_path: Path
    max_total_tokens: int = 4096
    kvcr_settings: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    extra_args: Sequence[str] = ()
    port: int = 0
    control_port: int = 0
    reuse: bool = True  # False: no HiCache, no kvcr, no radix cache (the answers computed without reuse)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def control_endpoint(self) -> str:
        """What a hint names to make another replica read from this one."""
        return f"tcp://127.0.0.1:{self.control_port}"

    def command(self) -> list[str]:
        extra = kvcr_extra_config(self.control_port, **self.kvcr_settings)
        cache = kvcr_l3_args(extra) if self.reuse else ("--disable-radix-cache",)
        return [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port),
            *CPU_FLAGS,
            "--page-size", str(PAGE_SIZE),
            "--max-total-tokens", str(self.max_total_tokens),
            *cache,
            "--enable-metrics",
            *self.extra_args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        return cpu_engine_environment(os.environ) | dict(self.env)

    def start(self, timeout_s: float = 180.0) -> EngineServer:
        """Start the server and wait until it serves (``/health`` answers 200), at most ``timeout_s``."""
        self.launch()
        return self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the process (its own process group) without waiting; see :meth:`wait_ready`."""
        if not self.port:
            self.port = free_port_block(1)
        if not self.control_port:
            self.control_port = free_port_block(1)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                cwd=REPO,
                start_new_session=True,  # its own process group: stop() reaches the scheduler too
            )

    def wait_ready(self, timeout_s: float = 180.0) -> EngineServer:
        """Wait until ``/health`` answers, at most ``timeout_s``; stop the server and raise if it does not."""
        if self.proc is None:
            raise EngineError("the server was never launched")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError(f"the server exited with {self.proc.returncode} while starting{self.log_tail()}")
            with contextlib.suppress(OSError, EngineError):
                self._request("GET", "/health", timeout_s=2.0)
                return self
            time.sleep(0.5)
        self.stop()
        raise EngineError(f"the server did not answer /health within {timeout_s:.0f} s{self.log_tail()}")

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group (SIGCONT first, in case a test froze it), SIGKILL after ``grace_s``."""
        if self.proc is not None:
            stop_process_group(self.proc, grace_s)

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the whole server (SIGSTOP freezes it, SIGKILL kills it); a server already gone is fine."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"\n--- last {len(text)} lines of {self.log_path} ---\n" + "\n".join(text)

    def generate(
        self,
        input_ids: Sequence[int],
        *,
        max_new_tokens: int = 8,
        kv_hints: Any = None,
        timeout_s: float = 60.0,
        ignore_eos: bool = True,
        logprobs: bool = True,
    ) -> dict[str, Any]:
        """Greedy ``/generate`` (logprobs unless told not); SGLang's answer (``text``, ``output_ids``, ...)."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos},
            "return_logprob": logprobs,
        }
        if kv_hints is not None:
            body["kv_hints"] = kv_hints
        answer = self._request("POST", "/generate", body, timeout_s=timeout_s)
        if not isinstance(answer, dict):
            raise EngineError(f"/generate answered {answer!r}{self.log_tail()}")
        return answer

    def flush_cache(self) -> None:
        """Empty the device radix cache (host and kvcr tiers keep their pages)."""
        self._request("POST", "/flush_cache", timeout_s=30.0)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{'name{labels}': value}`` (kvcr's series join SGLang's)."""
        return parse_metrics(str(self._request("GET", "/metrics", timeout_s=10.0, raw=True)))

    def kvcr_pages(self, path: str, outcome: str = "ok") -> int:
        """``kvcr_pages_total{path, outcome}`` summed over the server's ranks."""
        return int(self.metric("kvcr_pages_total", path=path, outcome=outcome))

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples on ``/metrics`` that carry ``labels`` (and any others)."""
        return metric_sum(self.metrics(), name, **labels)

    def _request(self, method: str, path: str, body: Any = None, *, timeout_s: float, raw: bool = False) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                payload = response.read().decode()
        except urllib.error.HTTPError as exc:
            raise EngineError(f"{method} {path} answered {exc.code}: {exc.read()[:500]!r}") from exc
        if raw:
            return payload
        try:
            return json.loads(payload) if payload else {}
        except json.JSONDecodeError:
            return payload


def start_all(servers: Sequence[EngineServer], timeout_s: float = 240.0) -> None:
    """Launch every server at once (start-up is mostly imports, so they overlap), then wait for each.

    On any failure every server is stopped before the error propagates.
    """
    deadline = time.monotonic() + timeout_s
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        for server in servers:
            server.stop()
        raise


def stop_all(servers: Sequence[EngineServer], grace_s: float = 15.0) -> None:
    """Stop every server, their shutdowns overlapping (SGLang's takes ~5 s after SIGTERM)."""
    for server in servers:
        server.signal(signal.SIGCONT)
        server.signal(signal.SIGTERM)
    for server in servers:
        server.stop(grace_s)


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms until it holds; raise naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise EngineError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


def fetch_hint(source: EngineServer, input_ids: Sequence[int]) -> dict[str, Any]:
    """The ``kv_hints`` envelope (Dynamo's ``kv.fetch@1.0``) naming ``source`` for the prompt's full pages."""
    from kvcr.domain.keys import page_hashes, router_id

    pages = len(input_ids) // PAGE_SIZE
    hashes = page_hashes(list(input_ids[: pages * PAGE_SIZE]), PAGE_SIZE)
    action = {
        "action_id": "fetch-0",
        "action_type": "kv.fetch",
        "action_version": "1.0",
        "payload": {
            "source_control_endpoint": source.control_endpoint,
            "block_hashes": [router_id(h) for h in hashes],
            "mode": "copy",
        },
    }
    return {"protocol_version": "0.1", "message_id": "kvcr-engine-test", "actions": [action]}
