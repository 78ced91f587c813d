"""The ``kvcr`` command: ``demo``, ``worker``, ``bench``, ``soak`` and ``doctor``.

Every option says what it does and its default (``--help``). A mistake is one line naming the
option to change; nothing here prints a traceback for an expected failure.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvcr.cli.bench import _save_json, add_bench_commands
from kvcr.cli.common import _Help, _Parser, _port, _positive
from kvcr.domain.errors import ConfigError, KvcrError
from kvcr.domain.transports import CROSS_PROCESS
from kvcr.domain.units import parse_byte_size

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
        transport=args.transport,
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
    try:
        from kvcr.demo.dynamo.worker import main as worker_main
    except ImportError as exc:  # its --help too: the parser lives beside Dynamo's backend API
        raise ConfigError(
            f"needs Dynamo's Python backend API, which does not import here ({exc}): "
            'pip install "kvcr-runner[dynamo]" && pip install --no-deps "ai-dynamo==1.6.1"; see docs/install.md'
        ) from None
    return worker_main(list(argv))


def _keygen(args: argparse.Namespace) -> int:
    from kvcr.adapters.zmq.identity import write_node_key
    from kvcr.domain.hints import Endpoint

    try:
        base = Endpoint.parse(args.endpoint, require_scheme=False)
    except ValueError as exc:
        raise ConfigError(f"--endpoint {args.endpoint!r}: {exc}") from exc
    public = write_node_key(args.key_file).decode()
    print(f"# {args.key_file}: this node's secret key (mode 0600). Add these lines to every node's peer directory:")
    for rank in range(args.ranks):
        print(f"{base.offset(rank)} {public}")
    return 0


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

    add_bench_commands(commands, command)

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
    soak.add_argument(
        "--transport",
        default="auto",
        help="kvcr's data plane on every replica: auto (the default: shm between these same-host replicas), "
        "nixl, ucx or shm",
    )
    soak.add_argument("--metrics-port", type=_port, help="serve the soak's figures on this /metrics port (loopback)")
    soak.add_argument("--json", help="also write the full report here")
    soak.set_defaults(func=_soak)

    keygen = command(
        commands,
        "keygen",
        "make this node's own CURVE key (per-node identities: node_key_file) and print its peer directory lines",
    )
    keygen.add_argument("key_file", help="where to write the secret key (a new file, mode 0600)")
    keygen.add_argument(
        "--endpoint", required=True, help="the node's control endpoint as peers dial it (tcp://host:port)"
    )
    keygen.add_argument(
        "--ranks", type=_positive("--ranks"), default=1, help="ranks serving port, port + 1, ... (SGLang's TP ranks)"
    )
    keygen.set_defaults(func=_keygen)

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
        try:
            return _worker(argv[1:])  # its own parser: the options are the worker's
        except KvcrError as exc:
            print(f"kvcr worker: {exc}", file=sys.stderr)
            return 2
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
