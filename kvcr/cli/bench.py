"""``kvcr bench``: its subcommands' options and what each runs (measure, print the table, write JSON and PNG)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any

from kvcr.cli.common import _batches, _port, _positive, _Progress, _sizes, _transports
from kvcr.domain.errors import KvcrError
from kvcr.domain.units import format_byte_size

# ---------------------------------------------------------------------- bench


def _measure_local(args: argparse.Namespace, progress: _Progress) -> list[Any]:
    from kvcr.bench.local import run_local

    return [
        progress.step(
            f"local: {format_byte_size(s)} pages x {args.pages}", partial(run_local, s, args.pages, args.reps)
        )
        for s in _sizes(args.page_sizes)
    ]


def _bench_request() -> AbstractContextManager[object]:
    """The request scope kvcr's plugin gives SGLang's hit query and prefetch (the lease is booked for the read)."""
    from kvcr.integrations.shared import hints_bridge

    return hints_bridge.active("bench")


def _measure_sglang(args: argparse.Namespace, progress: _Progress) -> tuple[list[Any], list[Any]]:
    from kvcr.bench.sglang import run_sglang, run_sglang_remote
    from kvcr.testing.sglang import LAYER_BYTES

    # SGLang warns on import that its GPU-only quantizers are unusable on a CPU; not news here, and
    # the replica process it starts inherits the same filter.
    warnings.filterwarnings("ignore", message="Only CUDA", category=UserWarning)
    os.environ.setdefault("PYTHONWARNINGS", "ignore:Only CUDA:UserWarning")
    sizes = _sizes(args.page_sizes)
    for size in sizes:
        if size % LAYER_BYTES:
            raise KvcrError(f"--page-sizes: {size} is not a multiple of one layer ({LAYER_BYTES} bytes)")
    local = [
        progress.step(
            f"sglang: {format_byte_size(s)} pages x {args.pages} (local)",
            partial(run_sglang, s // LAYER_BYTES, args.pages, args.reps),
        )
        for s in sizes
    ]
    remote = []
    if not args.local_only:
        remote = [
            progress.step(
                f"sglang: {format_byte_size(s)} pages x {args.pages} (hinted remote, {transport})",
                partial(
                    run_sglang_remote,
                    s // LAYER_BYTES,
                    args.pages,
                    args.reps,
                    request=_bench_request,
                    transport=transport,
                ),
            )
            for transport in _transports(args.transport)
            for s in sizes
        ]
    return local, remote


def _measure_remote(args: argparse.Namespace, progress: _Progress) -> list[Any]:
    from kvcr.bench.remote import run_remote, run_remote_apart, run_remote_netns

    batches = _batches(args.batches)
    if getattr(args, "netns", False):
        if os.geteuid() != 0:
            raise KvcrError("--netns creates network namespaces and a veth pair: run it as root")
        sizes = _sizes(args.page_sizes)
        return list(
            progress.step(
                f"remote across two network namespaces (UCX over tcp): pages {args.page_sizes}, batches {args.batches}",
                partial(run_remote_netns, sizes, batches, args.reps),
            )
        )
    results: list[Any] = []
    transports = _transports(args.transport)
    for i, size in enumerate(_sizes(args.page_sizes)):
        for j, transport in enumerate(transports):
            port = args.port + 10 * (i * len(transports) + j) if args.port else None
            # ucxx must load before NIXL in a process: each ucx measurement gets a process of its own
            measure = partial(run_remote_apart, size, batches, args.reps, port, transport)
            if transport != "ucx":
                measure = partial(run_remote, size, batches, args.reps, port=port, transport=transport)
            results.extend(
                progress.step(
                    f"remote: {format_byte_size(size)} pages over {transport}, batches {args.batches}", measure
                )
            )
    return results


def _bench_local(args: argparse.Namespace) -> int:
    from kvcr.bench.local import as_dict, local_table
    from kvcr.bench.plot import plot_local

    results = _measure_local(args, _Progress(len(_sizes(args.page_sizes))))
    print(local_table(results))
    _write(args, [as_dict(r) for r in results], lambda png: plot_local(results, png))
    return 0


def _bench_sglang(args: argparse.Namespace) -> int:
    from kvcr.bench.plot import plot_sglang
    from kvcr.bench.sglang import as_dict, sglang_remote_table, sglang_table

    steps = len(_sizes(args.page_sizes)) * (1 if args.local_only else 1 + len(_transports(args.transport)))
    local, remote = _measure_sglang(args, _Progress(steps))
    print(sglang_table(local))
    if remote:
        print()
        print(sglang_remote_table(remote))
    data = {"local": [as_dict(r) for r in local], "remote": [as_dict(r) for r in remote]}
    _write(args, data, lambda png: plot_sglang(local, remote, png))
    return 0


def _bench_remote(args: argparse.Namespace) -> int:
    from kvcr.bench.plot import plot_remote
    from kvcr.bench.remote import NETNS_LINK, as_dict, remote_table

    steps = 1 if args.netns else len(_sizes(args.page_sizes)) * len(_transports(args.transport))
    results = _measure_remote(args, _Progress(steps))
    if args.netns:
        print(f"link: {NETNS_LINK}; ratios are against a raw NIXL READ over the same link, in this run")
    print(remote_table(results))
    _write(args, [as_dict(r) for r in results], lambda png: plot_remote(results, png))
    return 0


def _lengths(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise KvcrError(f"--lengths: give token counts separated by commas, got {text!r}") from None


def _run_real(args: argparse.Namespace, what: str, run: Callable[[list[int], Path | None], Any]) -> Any:
    """``run(lengths, workdir)`` on the real-model fleet: ``--lengths`` checked before any server starts,
    its failures (no model, a server that did not start or restore) one line."""
    from kvcr.bench.engine import check_lengths
    from kvcr.testing.engine import EngineError
    from kvcr.testing.real_model import RealModelError

    lengths = _lengths(args.lengths)
    workdir = Path(args.workdir) if args.workdir else None
    try:
        check_lengths(lengths)
        return _Progress(1).step(
            f"{what}: four SGLang servers on SmolLM2-135M, prompts of {args.lengths} tokens",
            partial(run, lengths, workdir),
        )
    except (EngineError, RealModelError) as exc:
        raise KvcrError(str(exc).splitlines()[0]) from None


def _bench_engine(args: argparse.Namespace) -> int:
    from kvcr.bench.engine import as_dict, engine_table, run_engine
    from kvcr.bench.plot import plot_engine

    results = _run_real(
        args,
        f"engine, {args.reps} per length",
        lambda lengths, workdir: run_engine(lengths, args.reps, workdir=workdir),
    )
    print(engine_table(results))
    _write(args, [as_dict(r) for r in results], lambda png: plot_engine(results, png))
    return 0 if all(r.same_first_token for r in results) else 1


def _bench_accuracy(args: argparse.Namespace) -> int:
    from kvcr.bench.accuracy import accuracy_table, as_dict, run_accuracy

    results, check = _run_real(
        args,
        "accuracy, then the control",
        lambda lengths, workdir: run_accuracy(lengths, new_tokens=args.new_tokens, workdir=workdir),
    )
    print(accuracy_table(results, check))
    if args.json:
        print(f"wrote {_save_json(Path(args.json), as_dict(results, check))}", file=sys.stderr)
    return 0 if all(r.ok for r in results) and check.caught else 1


def _bench_scale(args: argparse.Namespace) -> int:
    from kvcr.demo.scale import ScaleOptions, run_scale, scale_table, write_json

    if args.workers < 2:
        raise KvcrError(f"--workers must be at least 2, got {args.workers}")
    options = ScaleOptions(
        workers=args.workers, requests=args.requests, concurrency=args.concurrency, workdir=args.workdir
    )
    result = _Progress(1).step(
        f"scale: {args.workers} kvcr workers behind Dynamo's KV router, {args.requests} requests",
        partial(run_scale, options),
    )
    print(scale_table(result))
    if args.json:
        write_json(result, Path(args.json))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if not result.failed else 1


def _bench_all(args: argparse.Namespace) -> int:
    from kvcr.bench.local import as_dict as local_dict
    from kvcr.bench.plot import plot_local, plot_remote, plot_sglang
    from kvcr.bench.remote import as_dict as remote_dict
    from kvcr.bench.report import BenchSet, write_report
    from kvcr.bench.sglang import as_dict as sglang_dict

    out = Path(args.out_dir)
    from kvcr.cli import build_parser  # the bench defaults are the parser's

    defaults = build_parser().parse_args(["bench", "local"]), build_parser().parse_args(["bench", "sglang"])
    local_args, sglang_args = defaults
    remote_args = build_parser().parse_args(["bench", "remote", "--transport", "nixl,ucx,shm"])
    for one in (local_args, sglang_args, remote_args):
        one.reps = max(1, round(one.reps * args.reps_scale))
    progress = _Progress(
        len(_sizes(local_args.page_sizes))
        + len(_sizes(sglang_args.page_sizes)) * (1 + len(_transports(sglang_args.transport)))
        + len(_sizes(remote_args.page_sizes)) * len(_transports(remote_args.transport))
    )
    results = BenchSet()
    results.local = _measure_local(local_args, progress)
    results.sglang_local, results.sglang_remote = _measure_sglang(sglang_args, progress)
    results.remote = _measure_remote(remote_args, progress)
    _save_json(out / "local.json", [local_dict(r) for r in results.local])
    _save_json(
        out / "sglang.json",
        {
            "local": [sglang_dict(r) for r in results.sglang_local],
            "remote": [sglang_dict(r) for r in results.sglang_remote],
        },
    )
    _save_json(out / "remote.json", [remote_dict(r) for r in results.remote])
    written = [out / "local.json", out / "sglang.json", out / "remote.json"]
    written.append(plot_local(results.local, out / "local.png"))
    written.append(plot_sglang(results.sglang_local, results.sglang_remote, out / "sglang.png"))
    written.append(plot_remote(results.remote, out / "remote.png"))
    written += write_report(results, out, Path(args.figure), Path(args.readme) if args.update_readme else None)
    print("\n".join(f"wrote {path}" for path in written))
    return 0


def _bench_report(args: argparse.Namespace) -> int:
    from kvcr.bench.report import load, write_report

    results = load(Path(args.from_dir))
    if not results.local:
        raise KvcrError(f"--from {args.from_dir}: no local.json there; run `kvcr bench all` first")
    readme = Path(args.readme) if args.update_readme else None
    for path in write_report(results, Path(args.from_dir), Path(args.figure), readme):
        print(f"wrote {path}")
    return 0


def _write(args: argparse.Namespace, data: object, plot: Callable[[Path], Path]) -> None:
    if not args.json:
        return
    path = _save_json(Path(args.json), data)
    if not args.no_plot:
        print(f"wrote {path} and {plot(path.with_suffix('.png'))}", file=sys.stderr)
    else:
        print(f"wrote {path}", file=sys.stderr)


def _save_json(path: Path, data: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path


def _json_option(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--json", default=default, help="where to write the results; a PNG is written beside it")
    parser.add_argument("--no-plot", action="store_true", help="write the JSON only, no PNG")


def add_bench_commands(commands: Any, command: Callable[[Any, str, str], argparse.ArgumentParser]) -> None:
    """``kvcr bench <which>`` under ``commands`` (``command`` makes one subparser)."""
    bench = command(commands, "bench", "benchmarks (ratios against a baseline measured in the same run)")
    which = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    local = command(which, "local", "local backup/restore vs memcpy of the same bytes")
    local.add_argument("--page-sizes", default="64KiB,2MiB,8MiB", help="page sizes to measure, comma-separated")
    local.add_argument("--pages", type=_positive("--pages"), default=128, help="pages per batch")
    local.add_argument("--reps", type=_positive("--reps"), default=15, help="timed repetitions per page size")
    _json_option(local, "bench-results/local.json")
    local.set_defaults(func=_bench_local)

    sglang = command(which, "sglang", "batch_set_v1/batch_get_v1 on SGLang's real host pool vs memcpy")
    sglang.add_argument("--page-sizes", default="1MiB,2MiB,8MiB", help="page sizes (multiples of 256KiB, one layer)")
    sglang.add_argument("--pages", type=_positive("--pages"), default=128, help="pages per batch")
    sglang.add_argument("--reps", type=_positive("--reps"), default=10, help="timed repetitions per page size")
    sglang.add_argument("--local-only", action="store_true", help="skip the hinted remote part (two processes)")
    sglang.add_argument(
        "--transport",
        default="nixl,auto",
        help="both replicas' data plane in the hinted remote part, comma-separated (auto on one host: shm)",
    )
    _json_option(sglang, "bench-results/sglang.json")
    sglang.set_defaults(func=_bench_sglang)

    remote = command(which, "remote", "peer restore over NIXL vs raw NIXL READ vs memcpy (2 processes)")
    remote.add_argument("--page-sizes", default="64KiB,2MiB,8MiB", help="page sizes to measure, comma-separated")
    remote.add_argument("--batches", default="32,128", help="pages per restore, comma-separated")
    remote.add_argument("--reps", type=_positive("--reps"), default=20, help="timed repetitions per configuration")
    remote.add_argument("--port", type=_port, default=0, help="first of the loopback ports to use (0: free ones)")
    remote.add_argument(
        "--transport",
        default="nixl",
        help="kvcr's data planes for read and restore, comma-separated: nixl, ucx, shm, auto (e.g. shm,nixl,ucx; "
        "the baseline is always a raw NIXL READ)",
    )
    remote.add_argument(
        "--netns",
        action="store_true",
        help="run source and target in two network namespaces joined by a veth pair this run creates and removes "
        "(root), UCX over tcp as between hosts without RDMA; the raw NIXL READ baseline crosses the same link",
    )
    _json_option(remote, "bench-results/remote.json")
    remote.set_defaults(func=_bench_remote)

    engine = command(
        which,
        "engine",
        "TTFT on a real model (SmolLM2-135M) under real SGLang servers (CPU): recompute vs restored from local "
        "kvcr DRAM, a peer over NIXL, a same-host peer",
    )
    engine.add_argument("--lengths", default="1024,2048,4096,8160", help="prompt lengths in tokens, comma-separated")
    engine.add_argument("--reps", type=_positive("--reps"), default=2, help="fresh prompts per length")
    engine.add_argument("--workdir", default=None, help="keep the servers' logs here")
    _json_option(engine, "bench-results/engine.json")
    engine.set_defaults(func=_bench_engine)

    accuracy = command(
        which,
        "accuracy",
        "a real model's greedy answers and logprobs from scratch vs after each kind of kvcr restore, and a "
        "corrupted-page control",
    )
    accuracy.add_argument("--lengths", default="1024,4096,8160", help="prompt lengths in tokens, comma-separated")
    accuracy.add_argument("--new-tokens", type=_positive("--new-tokens"), default=16, help="answer tokens compared")
    accuracy.add_argument("--workdir", default=None, help="keep the servers' logs here")
    accuracy.add_argument(
        "--json", default="bench-results/accuracy.json", help="where to write the results ('' for none)"
    )
    accuracy.set_defaults(func=_bench_accuracy)

    scale = command(
        which, "scale", "KV-event bytes per prefill token and the router's index update rate from a local fleet"
    )
    scale.add_argument("--workers", type=int, default=8, help="stand-in kvcr workers behind the router")
    scale.add_argument("--requests", type=_positive("--requests"), default=320, help="completions to send")
    scale.add_argument("--concurrency", type=_positive("--concurrency"), default=8, help="requests in flight")
    scale.add_argument("--workdir", default=None, help="keep the processes' logs and reports here")
    scale.add_argument("--json", default="bench-results/scale.json", help="where to write the results ('' for none)")
    scale.set_defaults(func=_bench_scale)

    every = command(which, "all", "run local, sglang and remote with their defaults; regenerate the README's part")
    every.add_argument("--out-dir", default="bench-results", help="where the JSON, PNGs and README-tables.md go")
    every.add_argument("--figure", default="docs/bench.png", help="the overview figure the README shows")
    every.add_argument("--readme", default="README.md", help="the README whose marked block --update-readme rewrites")
    every.add_argument("--update-readme", action="store_true", help="rewrite the README's generated benchmark block")
    every.add_argument("--reps-scale", type=float, default=1.0, help="multiply every benchmark's repetitions")
    every.set_defaults(func=_bench_all)

    report = command(which, "report", "rebuild the README's tables and figure from existing JSON (no measuring)")
    report.add_argument("--from", dest="from_dir", default="bench-results", help="where the JSON files are")
    report.add_argument("--figure", default="docs/bench.png", help="the overview figure the README shows")
    report.add_argument("--readme", default="README.md", help="the README whose marked block --update-readme rewrites")
    report.add_argument("--update-readme", action="store_true", help="rewrite the README's generated benchmark block")
    report.set_defaults(func=_bench_report)
