"""The ``kvcr`` command: ``demo`` and ``bench``."""

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
    from kvcr.bench.sglang import as_dict, run_sglang, run_sglang_remote, sglang_remote_table, sglang_table
    from kvcr.testing.sglang import LAYER_BYTES

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
    from kvcr.demo import run_demo

    return run_demo(verbose=not args.quiet, peer=not args.local_only)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcr", description="KV-cache reuse runner")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="back up, query and restore pages through a real runner")
    demo.add_argument("--quiet", action="store_true")
    demo.add_argument("--local-only", action="store_true", help="skip the two-replica NIXL part")
    demo.set_defaults(func=_demo)

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
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
