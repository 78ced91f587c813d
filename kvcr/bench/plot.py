"""Figures of benchmark results: throughput against page size, each kvcr path beside its baseline.

Reads the result objects the benchmarks return (or rebuilt from their JSON) and writes PNGs with
matplotlib's Agg backend (no display needed). Ratios on the right-hand panels are the same ones
the tables print: each kvcr path over the baseline measured in the same run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcr.domain.units import format_byte_size

GB = 1e9


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _axes(title: str, panels: int = 2) -> tuple[Any, list[Any]]:
    plt = _pyplot()
    figure, axes = plt.subplots(1, panels, figsize=(6.0 * panels, 4.2), squeeze=False)
    figure.suptitle(title)
    return figure, list(axes[0])


def _page_axis(ax: Any, sizes: Sequence[int], ylabel: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sizes), [format_byte_size(s) for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel("page size")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _save(figure: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    _pyplot().close(figure)
    return path


def _line(ax: Any, xs: Sequence[int], ys: Sequence[float], label: str, style: str = "-o") -> None:
    ax.plot(list(xs), list(ys), style, label=label, markersize=4)


def plot_local(results: Sequence[Any], path: Path) -> Path:
    """``kvcr bench local``: memcpy, backup and restore GB/s; backup and restore over memcpy."""
    figure, (speed, ratio) = _axes(f"kvcr local tier ({results[0].pages} pages per batch)")
    sizes = [r.page_bytes for r in results]
    _line(speed, sizes, [r.memcpy_gbps for r in results], "memcpy", "--s")
    _line(speed, sizes, [r.backup_gbps for r in results], "kvcr backup")
    _line(speed, sizes, [r.restore_gbps for r in results], "kvcr restore")
    _page_axis(speed, sizes, "GB/s (p50)")
    _line(ratio, sizes, [r.backup_ratio for r in results], "backup / memcpy")
    _line(ratio, sizes, [r.restore_ratio for r in results], "restore / memcpy")
    ratio.axhline(1.0, color="grey", linewidth=0.8)
    _page_axis(ratio, sizes, "x memcpy")
    return _save(figure, path)


def plot_remote(results: Sequence[Any], path: Path) -> Path:
    """``kvcr bench remote``: one line per path, transport and batch size; kvcr over raw NIXL on the right."""
    figure, (speed, ratio) = _axes("kvcr peer restore (source in another process)")
    transports = list(dict.fromkeys(getattr(r, "transport", "nixl") for r in results))
    for transport in transports:
        for batch in sorted({r.pages for r in results}):
            rows = sorted(
                (r for r in results if r.pages == batch and getattr(r, "transport", "nixl") == transport),
                key=lambda r: r.page_bytes,
            )
            sizes = [r.page_bytes for r in rows]
            tag = f"x{batch}"
            kvcr = f"kvcr over {transport}" if len(transports) > 1 else "kvcr"
            if transport == transports[0]:  # memcpy and raw NIXL are the same for every transport
                _line(speed, sizes, [r.gbps(r.memcpy_p50_ms) for r in rows], f"memcpy {tag}", "--s")
                _line(speed, sizes, [r.gbps(r.raw_p50_ms) for r in rows], f"raw NIXL READ {tag}", ":^")
            _line(speed, sizes, [r.gbps(r.restore_p50_ms) for r in rows], f"{kvcr} restore {tag}")
            _line(ratio, sizes, [r.read_vs_raw for r in rows], f"{kvcr} leased read / raw {tag}", ":o")
            _line(ratio, sizes, [r.restore_vs_raw for r in rows], f"{kvcr} restore / raw {tag}")
    all_sizes = sorted({r.page_bytes for r in results})
    _page_axis(speed, all_sizes, "GB/s (p50)")
    ratio.axhline(1.0, color="grey", linewidth=0.8)
    _page_axis(ratio, all_sizes, "x raw NIXL READ")
    return _save(figure, path)


def plot_sglang(local: Sequence[Any], remote: Sequence[Any], path: Path) -> Path:
    """``kvcr bench sglang``: SGLang's batch calls through kvcr against memcpy and raw NIXL."""
    figure, (speed, ratio) = _axes("kvcr through SGLang's storage calls")
    sizes = [r.page_bytes for r in local]
    _line(speed, sizes, [r.memcpy_out_gbps for r in local], "memcpy", "--s")
    _line(speed, sizes, [r.set_gbps for r in local], "batch_set_v1 (backup)")
    _line(speed, sizes, [r.get_gbps for r in local], "batch_get_v1 (local restore)")
    _line(ratio, sizes, [r.set_ratio for r in local], "set / memcpy")
    _line(ratio, sizes, [r.get_ratio for r in local], "get / memcpy")
    if remote:
        remote_sizes = [r.page_bytes for r in remote]
        _line(speed, remote_sizes, [r.raw_gbps for r in remote], "raw NIXL READ", ":^")
        _line(speed, remote_sizes, [r.get_gbps for r in remote], "hinted batch_get_v1 (remote)")
        _line(ratio, remote_sizes, [r.get_vs_raw for r in remote], "hinted get / raw NIXL")
        sizes = sorted({*sizes, *remote_sizes})
    _page_axis(speed, sizes, "GB/s (p50)")
    ratio.axhline(1.0, color="grey", linewidth=0.8)
    _page_axis(ratio, sizes, "x baseline")
    return _save(figure, path)


def plot_overview(local: Sequence[Any], remote: Sequence[Any], path: Path) -> Path:
    """The README figure: memcpy, raw NIXL, kvcr local and remote restore against page size.

    Remote figures are those of the largest batch, the steady state of a long prefix.
    """
    figure, (speed, ratio) = _axes("kvcr restore throughput against page size")
    sizes = [r.page_bytes for r in local]
    _line(speed, sizes, [r.memcpy_gbps for r in local], f"memcpy (x{local[0].pages})", "--s")
    _line(speed, sizes, [r.restore_gbps for r in local], f"kvcr local restore (x{local[0].pages})")
    _line(ratio, sizes, [r.restore_ratio for r in local], "local restore / memcpy")
    if remote:
        batch = max(r.pages for r in remote)
        rows = sorted(
            (r for r in remote if r.pages == batch and getattr(r, "transport", "nixl") == "nixl"),
            key=lambda r: r.page_bytes,
        )
        remote_sizes = [r.page_bytes for r in rows]
        _line(speed, remote_sizes, [r.gbps(r.raw_p50_ms) for r in rows], f"raw NIXL READ (x{batch})", ":^")
        _line(speed, remote_sizes, [r.gbps(r.restore_p50_ms) for r in rows], f"kvcr remote restore (x{batch})")
        _line(ratio, remote_sizes, [r.restore_vs_raw for r in rows], "remote restore / raw NIXL READ")
        sizes = sorted({*sizes, *remote_sizes})
    _page_axis(speed, sizes, "GB/s (p50)")
    ratio.axhline(1.0, color="grey", linewidth=0.8)
    _page_axis(ratio, sizes, "x baseline of the same run")
    return _save(figure, path)


def plot_engine(results: Sequence[Any], path: Path) -> Path:
    """``kvcr bench engine``: TTFT against prompt length per path; each restored path over recompute."""
    figure, (ttft, ratio) = _axes("Time to first token, SmolLM2-135M on SGLang (CPU), kvcr as L3")
    lengths = [r.prompt_tokens for r in results]
    paths = (
        ("recompute", "recompute_ms", None, "C0"),
        ("local kvcr DRAM", "local_ms", "local_ratio", "C1"),
        ("peer over NIXL", "peer_nixl_ms", "peer_nixl_ratio", "C2"),
        ("same-host peer (auto)", "peer_same_host_ms", "peer_same_host_ratio", "C3"),
    )  # one colour per path in both panels
    for label, ms, ratio_field, colour in paths:
        ttft.plot(lengths, [getattr(r, ms) / 1e3 for r in results], "-o", label=label, markersize=4, color=colour)
        if ratio_field:
            values = [getattr(r, ratio_field) for r in results]
            ratio.plot(lengths, values, "-o", label=label, markersize=4, color=colour)
    ratio.axhline(0.5, color="grey", linestyle=":", linewidth=1, label="0.5x recompute")
    for ax, ylabel in ((ttft, "TTFT (s)"), (ratio, "restored / recompute")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ratio.set_ylim(bottom=0)
    return _save(figure, path)
