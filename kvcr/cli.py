"""The ``kvcr`` command: ``demo``, ``worker``, ``bench``, ``soak`` and ``doctor``.

Every option says what it does and its default (``--help``). A mistake is one line naming the
option to change; nothing here prints a traceback for an expected failure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

from kvcr.domain.errors import KvcrError
from kvcr.domain.transports import CROSS_PROCESS
from kvcr.domain.units import format_byte_size, parse_byte_size


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line naming the command and its help."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default; flags that are off by default say nothing more."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in text:
            return text
        return text + " (default: %(default)s)"


def _positive(option: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {value}")
        return value

    parse.__name__ = option
    return parse


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {value}")
    return value


def _sizes(text: str, option: str = "--page-sizes") -> list[int]:
    sizes = [parse_byte_size(part.strip(), name=option) for part in text.split(",") if part.strip()]
    if not sizes:
        raise KvcrError(f"{option}: give at least one size, e.g. 64KiB,2MiB")
    return sizes


def _batches(text: str) -> list[int]:
    try:
        batches = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise KvcrError(f"--batches: give page counts separated by commas, got {text!r}") from None
    if not batches or min(batches) <= 0:
        raise KvcrError(f"--batches: every batch must be a positive page count, got {text!r}")
    return batches


def _transports(text: str) -> list[str]:
    transports = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in transports if t not in CROSS_PROCESS]
    if not transports or unknown:
        raise KvcrError(f"--transport: give one or more of {', '.join(CROSS_PROCESS)} (e.g. nixl,shm), got {text!r}")
    return list(dict.fromkeys(transports))


class _Progress:
    """``[i/n] what ... done in Xs`` on stderr, so a long run shows where it is."""

    def __init__(self, total: int, quiet: bool = False) -> None:
        self.total, self.done, self.quiet = total, 0, quiet

    def step(self, what: str, call: Callable[[], Any]) -> Any:
        self.done += 1
        if not self.quiet:
            print(f"[{self.done}/{self.total}] {what} ...", end="", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            result = call()
        except BaseException:
            if not self.quiet:
                print(" failed", file=sys.stderr, flush=True)
            raise
        if not self.quiet:
            print(f" done in {time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)
        return result


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
    from kvcr.bench.remote import run_remote, run_remote_netns

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
            results.extend(
                progress.step(
                    f"remote: {format_byte_size(size)} pages over {transport}, batches {args.batches}",
                    partial(run_remote, size, batches, args.reps, port=port, transport=transport),
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


def _bench_engine(args: argparse.Namespace) -> int:
    from kvcr.bench.engine import as_dict, engine_table, run_engine

    try:
        lengths = [int(part) for part in args.lengths.split(",") if part.strip()]
    except ValueError:
        raise KvcrError(f"--lengths: give token counts separated by commas, got {args.lengths!r}") from None
    if not lengths or min(lengths) < 2 * 16 or max(lengths) > 3072:
        raise KvcrError(f"--lengths: each between 32 and 3072 tokens (the tiny model's context is 4096), got {lengths}")
    workdir = Path(args.workdir) if args.workdir else None
    results = _Progress(1).step(
        f"engine: two SGLang servers, prompts of {args.lengths} tokens x {args.reps}",
        partial(run_engine, lengths, args.reps, layers=args.layers, workdir=workdir),
    )
    print(engine_table(results))
    if args.json:
        print(f"wrote {_save_json(Path(args.json), [as_dict(r) for r in results])}", file=sys.stderr)
    return 0


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


# ---------------------------------------------------------------------- soak


def _soak(args: argparse.Namespace) -> int:
    try:
        from kvcr.soak.run import SoakOptions, run_soak
    except ImportError as exc:
        raise KvcrError(f"needs SGLang and NIXL (pip install 'kvcr-runner[sglang,nixl]'): {exc}") from None

    options = SoakOptions(
        replicas=args.replicas,
        minutes=args.minutes,
        page_kib=args.page_kib,
        dram_pages=args.dram_pages,
        host_pages=args.host_pages,
        prompt_pages=args.prompt_pages,
        prompts=args.prompts,
        pause_ms=args.pause_ms,
        remote_share=args.remote_share,
        seed=args.seed,
        operation_timeout_ms=args.operation_timeout_ms,
        tls=args.tls,
        report_every_s=args.report_every_s,
    )
    # SGLang warns on import that its GPU-only quantizers are unusable on a CPU; not news here.
    warnings.filterwarnings("ignore", message="Only CUDA", category=UserWarning)
    os.environ.setdefault("PYTHONWARNINGS", "ignore:Only CUDA:UserWarning")
    report = run_soak(
        options, progress=lambda line: print(line, file=sys.stderr, flush=True), metrics_port=args.metrics_port
    )
    print(report.table())
    if args.json:
        print(f"wrote {_save_json(Path(args.json), report.as_dict())}", file=sys.stderr)
    return 0 if report.ok else 1


# ---------------------------------------------------------------------- doctor, demo


def _doctor(args: argparse.Namespace) -> int:
    from kvcr.doctor import CHECKS, DoctorOptions, exit_code, run_doctor, summary

    skip = frozenset(s.strip() for s in (args.skip or "").split(",") if s.strip())
    unknown = skip - set(CHECKS)
    if unknown:
        raise KvcrError(f"--skip: unknown check(s) {', '.join(sorted(unknown))}; known: {', '.join(CHECKS)}")
    options = DoctorOptions(
        sglang_config=args.sglang_config,
        control_host=args.control_host,
        control_port=args.control_port,
        tp_size=args.tp_size,
        metrics_port=args.metrics_port,
        token_file=args.token_file,
        read_bytes=parse_byte_size(args.read_bytes, name="--read-bytes"),
        skip=skip,
    )
    findings = run_doctor(options, lambda finding: print(finding.line(), flush=True))
    print(summary(findings))
    return exit_code(findings)


def _demo(args: argparse.Namespace) -> int:
    if args.local_only:
        from kvcr.demo import run_local_demo

        return run_local_demo(verbose=not args.quiet)
    turns = args.turns if args.turns is not None else (3 if args.engine == "sglang" else 4)
    for option, value, low in (("--workers", args.workers, 2), ("--turns", turns, 1)):
        if value < low:
            raise SystemExit(f"kvcr demo: {option} must be at least {low}, got {value}")
    from kvcr.demo.dynamo.control_plane import missing

    absent = missing(args.discovery, args.event_plane)
    if absent:
        raise SystemExit(f"kvcr demo: --discovery {args.discovery} --event-plane {args.event_plane}: {absent}")
    if args.engine == "sglang":
        return _engine_demo(args, turns)
    from kvcr.demo import DemoOptions, run_cluster_demo

    if args.page_kib < 16 or args.page_kib % 16:
        raise SystemExit(f"kvcr demo: --page-kib must be a positive multiple of 16, got {args.page_kib}")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise SystemExit(f"kvcr demo: --plot must name a .png file, got {args.plot!r}")
    options = DemoOptions(
        workers=args.workers,
        turns=turns,
        page_kib=args.page_kib,
        conversations=args.conversations,
        plot=args.plot,
        workdir=args.workdir,
        quiet=args.quiet,
        transport=args.transport,
        metrics_port=args.metrics_port,
        discovery=args.discovery,
        event_plane=args.event_plane,
    )
    return run_cluster_demo(options)


def _engine_demo(args: argparse.Namespace, turns: int) -> int:
    """The demo on ``python -m dynamo.sglang`` workers; the stand-in workers' own options are refused."""
    from kvcr.demo.engines import EngineDemoOptions, run_engine_demo

    others = [
        option
        for option, given in (
            ("--page-kib", args.page_kib != 64),
            ("--plot", args.plot is not None),
            ("--transport", args.transport != "auto"),
            ("--metrics-port", args.metrics_port is not None),
        )
        if given
    ]
    if others:
        raise SystemExit(
            f"kvcr demo: {', '.join(others)}: an option of the stand-in workers (add --engine stand-in); the "
            "SGLang workers run NIXL with the model's own page size and serve /metrics on their system port"
        )
    options = EngineDemoOptions(
        workers=args.workers,
        conversations=args.conversations or 2 * args.workers,
        turns=turns,
        workdir=args.workdir,
        quiet=args.quiet,
        discovery=args.discovery,
        event_plane=args.event_plane,
    )
    return run_engine_demo(options)


def _worker(argv: Sequence[str]) -> int:
    from kvcr.demo.dynamo.worker import main as worker_main

    return worker_main(list(argv))


# ---------------------------------------------------------------------- parser


def _json_option(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--json", default=default, help="where to write the results; a PNG is written beside it")
    parser.add_argument("--no-plot", action="store_true", help="write the JSON only, no PNG")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvcr", description="KV-cache reuse runner", formatter_class=_Help)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(group: Any, name: str, text: str) -> argparse.ArgumentParser:
        made: argparse.ArgumentParser = group.add_parser(name, help=text, description=text, formatter_class=_Help)
        return made

    demo = command(
        commands, "demo", "Dynamo's frontend and KV router in front of workers with kvcr as L3, a multi-turn workload"
    )
    demo.add_argument("--workers", type=int, default=2, help="workers behind the router (at least 2)")
    demo.add_argument(
        "--engine",
        choices=("sglang", "stand-in"),
        default="sglang",
        help="the workers: Dynamo's own dynamo.sglang on real SGLang engines (CPU), or kvcr's stand-in-model "
        "worker (starts in seconds; many workers, byte-checked pages, --plot)",
    )
    demo.add_argument("--turns", type=int, default=None, help="turns per conversation (default: 3; 4 with stand-in)")
    demo.add_argument("--conversations", type=int, default=None, help="conversations (default: 2 per worker)")
    demo.add_argument("--page-kib", type=int, default=64, help="KV bytes per 16-token page, in KiB")
    demo.add_argument("--plot", default=None, metavar="FILE.png", help="also plot each request's pages and latency")
    demo.add_argument("--workdir", default=None, help="keep the processes' logs and reports here")
    demo.add_argument("--quiet", action="store_true", help="print only failures and the final table")
    demo.add_argument(
        "--transport", choices=CROSS_PROCESS, default="auto", help="the workers' data plane for peer reads"
    )
    demo.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        help="worker i serves kvcr's /metrics on this loopback port + i (default: none)",
    )
    demo.add_argument(
        "--discovery",
        choices=("file", "etcd"),
        default="file",
        help="Dynamo's discovery: a shared directory, or an etcd the demo starts (Dynamo's production default)",
    )
    demo.add_argument(
        "--event-plane",
        choices=("zmq", "nats"),
        default="zmq",
        help="how KV events reach the router: Dynamo's zmq plane, or a NATS server the demo starts",
    )
    demo.add_argument(
        "--local-only", action="store_true", help="the single-process demo instead: one runner's local tier"
    )
    demo.set_defaults(func=_demo)
    commands.add_parser(
        "worker",
        add_help=False,
        help="a kvcr Dynamo worker (python -m kvcr.demo.dynamo.worker; `kvcr worker --help`)",
    )

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
        which, "engine", "TTFT on real SGLang servers (CPU): recomputed vs restored from local kvcr DRAM vs from a peer"
    )
    engine.add_argument("--lengths", default="1024,2048", help="prompt lengths in tokens, comma-separated")
    engine.add_argument("--reps", type=_positive("--reps"), default=3, help="fresh prompts per length")
    engine.add_argument("--layers", type=_positive("--layers"), default=8, help="layers of the tiny model")
    engine.add_argument("--workdir", default=None, help="keep the model and the servers' logs here")
    engine.add_argument("--json", default="bench-results/engine.json", help="where to write the results ('' for none)")
    engine.set_defaults(func=_bench_engine)

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

    soak = command(
        commands,
        "soak",
        "replica processes (SGLang host pools, kvcr over NIXL) under mixed backups with eviction, local and "
        "hinted remote restores for N minutes; counts wrong bytes, hangs, exceptions, memory and leaks",
    )
    soak.add_argument("--replicas", type=_positive("--replicas"), default=4, help="replica processes (at least 2)")
    soak.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    soak.add_argument("--page-kib", type=_positive("--page-kib"), default=256, help="KV page size (multiple of 256)")
    soak.add_argument(
        "--dram-pages",
        type=_positive("--dram-pages"),
        default=48,
        help="kvcr DRAM per replica, in pages (small: evicts)",
    )
    soak.add_argument("--host-pages", type=_positive("--host-pages"), default=128, help="SGLang host pool per replica")
    soak.add_argument("--prompt-pages", type=_positive("--prompt-pages"), default=8, help="pages per prompt")
    soak.add_argument("--prompts", type=_positive("--prompts"), default=24, help="prompts each replica owns")
    soak.add_argument("--pause-ms", type=float, default=5.0, help="pause after each call of each load thread")
    soak.add_argument("--remote-share", type=float, default=0.5, help="share of restores that are hinted remote ones")
    soak.add_argument("--seed", type=int, default=0, help="seed of the load and of the page bytes")
    soak.add_argument(
        "--operation-timeout-ms",
        type=_positive("--operation-timeout-ms"),
        default=2000,
        help="the backend's operation_timeout_ms; a call slower than it + 1 s counts as a hang",
    )
    soak.add_argument(
        "--tls", choices=("default", "tcp"), default="default", help="UCX transports: UCX's choice, or tcp only"
    )
    soak.add_argument("--report-every-s", type=float, default=10.0, help="seconds between progress lines")
    soak.add_argument("--metrics-port", type=_port, help="serve the soak's figures on this /metrics port (loopback)")
    soak.add_argument("--json", help="also write the full report here")
    soak.set_defaults(func=_soak)

    doctor = command(commands, "doctor", "check this host before enabling kvcr; one line per check")
    doctor.add_argument(
        "--sglang-config",
        help="the JSON given to SGLang's --hicache-storage-backend-extra-config (or @file): checked, and "
        "its control_host, control_port and auth_token_file used below",
    )
    doctor.add_argument("--control-host", help="address the peer control server binds (default: config, 127.0.0.1)")
    doctor.add_argument(
        "--control-port", type=_port, help="rank 0's control port; rank r uses it + r (default: config)"
    )
    doctor.add_argument("--tp-size", type=_positive("--tp-size"), default=1, help="TP ranks, one control port each")
    doctor.add_argument("--metrics-port", type=_port, help="also check that this --metrics-port is free")
    doctor.add_argument("--token-file", help="the cluster token file (default: the config's auth_token_file)")
    doctor.add_argument("--read-bytes", default="64MiB", help="size of the loopback READ that measures the transport")
    doctor.add_argument("--skip", help="checks to skip, comma-separated: " + ", ".join(_doctor_checks()))
    doctor.set_defaults(func=_doctor)
    return parser


def _doctor_checks() -> tuple[str, ...]:
    from kvcr.doctor import CHECKS

    return CHECKS


# What each command imports beyond kvcr's base dependencies, and the extra that installs it.
_EXTRAS = {"rich": "demo", "matplotlib": "bench", "dynamo": "dynamo"}


def _needs(args: argparse.Namespace) -> list[str]:
    plots = not getattr(args, "no_plot", False)
    if args.command == "demo":
        if args.local_only:
            return []
        return ["rich", "dynamo", *(["matplotlib"] if args.plot else [])]
    if args.command == "bench" and args.bench == "scale":
        return ["dynamo"]  # its workers are Dynamo workers; it draws nothing
    if args.command == "bench" and plots and args.bench != "engine":  # engine draws nothing either
        return ["matplotlib"]
    return []


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _missing_extras(args: argparse.Namespace, installed: Callable[[str], bool] = _installed) -> str | None:
    """One line naming what the command needs and the pip command that installs it, before it starts."""
    missing = [module for module in _needs(args) if not installed(module)]
    if not missing:
        return None
    extras = sorted({_EXTRAS[module] for module in missing})
    fix = f'pip install "kvcr-runner[{",".join(extras)}]"'
    if "dynamo" in missing:
        fix += ' && pip install --no-deps "ai-dynamo==1.6.1"'
    no_plot = " (or --no-plot)" if args.command == "bench" else ""
    return f"needs {', '.join(missing)}, which is not installed: {fix}{no_plot}; see docs/install.md"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        return _worker(argv[1:])  # its own parser: the options are the worker's
    args = build_parser().parse_args(argv)
    name = " ".join(part for part in ("kvcr", args.command, getattr(args, "bench", None)) if part)
    missing = _missing_extras(args)
    if missing:
        print(f"{name}: {missing}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except KvcrError as exc:  # bad input or a refused setting: one line naming it
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as exc:  # the run itself failed (a peer process, a verification)
        print(f"{name} failed: {' '.join(str(exc).split()) or type(exc).__name__}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
