"""The ``kvcr`` command: ``demo``, ``worker`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvcr.domain.units import parse_byte_size


def _sizes(text: str) -> list[int]:
    return [parse_byte_size(part, name="--page-sizes") for part in text.split(",") if part]


def _bench_local(args: argparse.Namespace) -> int:
    from kvcr.bench.local import as_dict, local_table, run_local

    results = []
    for size in _sizes(args.page_sizes):
        results.append(run_local(size, args.pages, args.reps))
        print(f"  measured {size} B pages", file=sys.stderr)
    print(local_table(results))
    _write_json(args.json, [as_dict(r) for r in results])
    return 0


def _bench_sglang(args: argparse.Namespace) -> int:
    from kvcr.bench.sglang import LAYER_BYTES, as_dict, run_sglang, run_sglang_remote, sglang_remote_table, sglang_table

    sizes = _sizes(args.page_sizes)
    for size in sizes:
        if size % LAYER_BYTES:
            raise SystemExit(f"--page-sizes: {size} is not a multiple of one layer ({LAYER_BYTES} bytes)")
    results = []
    for size in sizes:
        results.append(run_sglang(size // LAYER_BYTES, args.pages, args.reps))
        print(f"  measured {size} B pages (local)", file=sys.stderr)
    print(sglang_table(results))
    remote = []
    if not args.local_only:
        for size in sizes:
            remote.append(run_sglang_remote(size // LAYER_BYTES, args.pages, args.reps))
            print(f"  measured {size} B pages (hinted remote)", file=sys.stderr)
        print()
        print(sglang_remote_table(remote))
    _write_json(args.json, {"local": [as_dict(r) for r in results], "remote": [as_dict(r) for r in remote]})
    return 0


def _bench_remote(args: argparse.Namespace) -> int:
    from kvcr.bench.remote import as_dict, remote_table, run_remote

    batches = [int(b) for b in args.batches.split(",") if b]
    results = []
    for i, size in enumerate(_sizes(args.page_sizes)):
        results.extend(run_remote(size, batches, args.reps, port=args.port + 10 * i if args.port else None))
        print(f"  measured {size} B pages", file=sys.stderr)
    print(remote_table(results))
    _write_json(args.json, [as_dict(r) for r in results])
    return 0


def _write_json(path_text: str | None, data: object) -> None:
    if path_text:
        path = Path(path_text)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2))


def _demo(args: argparse.Namespace) -> int:
    if args.local_only:
        from kvcr.demo import run_local_demo

        return run_local_demo(verbose=not args.quiet)
    from kvcr.demo import DemoOptions, run_cluster_demo

    for option, value, low in (
        ("--workers", args.workers, 2),
        ("--turns", args.turns, 1),
        ("--page-kib", args.page_kib, 16),
    ):
        if value < low:
            raise SystemExit(f"kvcr demo: {option} must be at least {low}, got {value}")
    if args.page_kib % 16:
        raise SystemExit(f"kvcr demo: --page-kib must be a multiple of 16, got {args.page_kib}")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise SystemExit(f"kvcr demo: --plot must name a .png file, got {args.plot!r}")
    options = DemoOptions(
        workers=args.workers,
        turns=args.turns,
        page_kib=args.page_kib,
        conversations=args.conversations,
        plot=args.plot,
        workdir=args.workdir,
        quiet=args.quiet,
    )
    return run_cluster_demo(options)


def _worker(argv: Sequence[str]) -> int:
    from kvcr.integrations.dynamo.worker import main as worker_main

    return worker_main(list(argv))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcr", description="KV-cache reuse runner")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo", help="Dynamo's frontend and KV router in front of kvcr workers, a multi-turn workload over HTTP"
    )
    demo.add_argument("--workers", type=int, default=2, help="kvcr workers behind the router (at least 2)")
    demo.add_argument("--turns", type=int, default=4, help="turns per conversation")
    demo.add_argument("--conversations", type=int, default=None, help="conversations (default: 2 per worker)")
    demo.add_argument("--page-kib", type=int, default=64, help="KV bytes per 16-token page, in KiB")
    demo.add_argument("--plot", default=None, metavar="FILE.png", help="also plot each request's pages and latency")
    demo.add_argument("--workdir", default=None, help="keep the processes' logs and reports here")
    demo.add_argument("--quiet", action="store_true")
    demo.add_argument(
        "--local-only", action="store_true", help="the single-process demo instead: one runner's local tier"
    )
    demo.set_defaults(func=_demo)
    commands.add_parser(
        "worker",
        add_help=False,
        help="a kvcr Dynamo worker (python -m kvcr.integrations.dynamo.worker; `kvcr worker --help`)",
    )

    bench = commands.add_parser("bench", help="benchmarks (ratios against a baseline in the same run)")
    which = bench.add_subparsers(dest="bench", required=True)
    local = which.add_parser("local", help="local backup/restore vs memcpy of the same bytes")
    local.add_argument("--page-sizes", default="64KiB,2MiB,8MiB")
    local.add_argument("--pages", type=int, default=128)
    local.add_argument("--reps", type=int, default=15)
    local.add_argument("--json", default="bench-results/local.json")
    local.set_defaults(func=_bench_local)
    sglang = which.add_parser("sglang", help="batch_set_v1/batch_get_v1 on SGLang's real host pool vs memcpy")
    sglang.add_argument("--page-sizes", default="1MiB,2MiB,8MiB")
    sglang.add_argument("--pages", type=int, default=128)
    sglang.add_argument("--reps", type=int, default=10)
    sglang.add_argument("--json", default="bench-results/sglang.json")
    sglang.add_argument("--local-only", action="store_true", help="skip the hinted remote part (two processes)")
    sglang.set_defaults(func=_bench_sglang)
    remote = which.add_parser("remote", help="peer restore over NIXL vs raw NIXL READ vs memcpy (2 processes)")
    remote.add_argument("--page-sizes", default="64KiB,2MiB,8MiB")
    remote.add_argument("--batches", default="32,128")
    remote.add_argument("--reps", type=int, default=20)
    remote.add_argument("--port", type=int, default=0, help="first of the loopback ports to use (default: free ones)")
    remote.add_argument("--json", default="bench-results/remote.json")
    remote.set_defaults(func=_bench_remote)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        return _worker(argv[1:])  # its own parser: the options are the worker's
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
