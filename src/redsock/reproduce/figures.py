"""The report's PNG figures, one per section with data (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from .. import results as report
from ..bench.suite import SERIES_LABELS, StepResult
from .render import RunInfo, section_data
from .tables import (
    ArPoint,
    TransportPoint,
    allreduce_points,
    ddp_points,
    latency_growth_model,
    latency_matrix,
    transport_points,
)


def _size_axis(ax: Any, sizes: Iterable[int]) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    sizes = [s for s in sizes if s > 0]
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(report._size_ticks(min(sizes), max(sizes))))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: report.human_size(v, sep="")))
    ax.grid(True, alpha=0.3)


def _new_figure(nrows: int, ncols: int, size: tuple[float, float]) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def plot_transport(points: Sequence[TransportPoint], path: Path) -> Path:
    fig, axes = _new_figure(2, 1, (8, 6.5))
    top, bottom = axes[0][0], axes[1][0]
    series: dict[str, list[TransportPoint]] = {}
    for p in points:
        series.setdefault(p.label, []).append(p)
    for label, ps in series.items():
        (line,) = top.plot([p.bytes for p in ps], [p.gbps for p in ps], marker="o", label=label)
        bottom.plot([p.bytes for p in ps], [p.of_bound for p in ps], marker="o", color=line.get_color())
    bound = points[0].bound_gbps
    top.axhline(bound, ls="--", color="k", label=f"bound {bound:.2f} Gbit/s (classes' goodput)")
    bottom.axhline(1.0, ls="--", color="k")
    top.set_ylim(bottom=0, top=1.1 * max(bound, max(p.gbps for p in points)))
    bottom.set_ylim(bottom=0)
    top.set_ylabel("Gbit/s")
    bottom.set_ylabel("throughput / bound")
    bottom.set_xlabel("message size")
    top.legend(fontsize="small")
    for ax in (top, bottom):
        _size_axis(ax, [p.bytes for p in points])
    fig.suptitle("Fast Socket under per-flow path imbalance")
    fig.savefig(path, dpi=100)
    return path


def plot_allreduce(groups: dict[tuple[str, int], list[ArPoint]], path: Path, title: str) -> Path:
    keys = sorted(groups, key=lambda k: k[1])
    fig, axes = _new_figure(2, len(keys), (4.5 * len(keys) + 1, 7))
    for col, key in enumerate(keys):
        pts = groups[key]
        top, bottom = axes[0][col], axes[1][col]
        series: dict[str, list[ArPoint]] = {}
        for p in pts:
            series.setdefault(p.series, []).append(p)
        for name, ps in series.items():
            ps = sorted(ps, key=lambda p: p.row.bytes)
            x = [p.row.bytes for p in ps]
            (line,) = top.plot(x, [p.row.algbw_GBps for p in ps], marker="o", label=ps[0].label)
            bottom.plot(x, [p.of_bound or float("nan") for p in ps], marker="o", color=line.get_color())
        bounds: dict[float, list[str]] = {}  # one line per distinct bound, naming its series
        for ps in series.values():
            if ps[0].bound_GBps:
                bounds.setdefault(round(ps[0].bound_GBps, 6), []).append(ps[0].label)
        for (bound, names), ls in zip(sorted(bounds.items()), ("--", ":", "-.", (0, (1, 3)))):
            top.axhline(bound, ls=ls, color="k", lw=0.8, label=f"bound {bound:.3f}: {', '.join(names)}")
        bottom.axhline(1.0, ls="--", color="k")
        top.set_ylim(bottom=0)
        bottom.set_ylim(bottom=0)
        top.set_title(f"N={key[1]} ({key[0]})")
        top.set_ylabel("algbw (GB/s)")
        bottom.set_ylabel("algbw / bound")
        bottom.set_xlabel("message size per rank")
        top.legend(fontsize="x-small")
        for ax in (top, bottom):
            _size_axis(ax, [p.row.bytes for p in pts])
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return path


def plot_latency(rows: Sequence[report.Row], path: Path) -> Path:
    m = latency_matrix(rows)
    sizes = sorted({b for b, _ in m})
    fig, axes = _new_figure(1, len(sizes), (4.5 * len(sizes) + 1, 4.5))
    for col, size in enumerate(sizes):
        ax = axes[0][col]
        for series, label in SERIES_LABELS.items():
            by = m.get((size, series))
            if not by:
                continue
            ns = sorted(by)
            (line,) = ax.plot(ns, [by[n].median_s * 1e6 for n in ns], marker="o", label=label)
            model = [latency_growth_model(series, ns[0], n) for n in ns] if len(ns) > 1 else []
            growth = [x for x in model if x is not None]
            if model and len(growth) == len(model):
                ax.plot(ns, [by[ns[0]].median_s * 1e6 * x for x in growth], ls=":", color=line.get_color())
        ax.set_title(f"{report.human_size(size)} (dotted: latency-bound model)")
        ax.set_xlabel("workers N")
        ax.set_ylabel("median time (µs)")
        ax.set_ylim(bottom=0)
        ax.set_xticks(sorted({n for by in m.values() for n in by}))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.suptitle("small-message all-reduce latency against N")
    fig.savefig(path, dpi=100)
    return path


def plot_ddp(points: Sequence[dict[str, Any]], path: Path) -> Path:
    fig, axes = _new_figure(1, 2, (10, 4.5))
    left, right = axes[0][0], axes[0][1]
    labels = [f"{p['algo']}\nN={p['workers']}" for p in points]
    x = list(range(len(points)))
    colors = [{"gloo": "tab:blue", "ring": "tab:green", "server": "tab:red"}.get(p["algo"], "tab:gray")
              for p in points]
    bars = left.bar(x, [p["steps_per_s"] for p in points], color=colors)
    left.bar_label(bars, [f"{p['over_gloo']:.2f}x gloo" if p["over_gloo"] else "" for p in points],
                   fontsize="small")
    bounds = [p["comm_bound_steps_per_s"] or float("nan") for p in points]
    left.scatter(x, bounds, marker="_", s=600, color="k", label="comm-bound steps/s")
    left.set_ylabel("steps/s")
    left.legend(fontsize="small")
    bars = right.bar(x, [p["host_s_per_step"] for p in points], color=colors)
    right.bar_label(bars, [f"{p['cost_over_gloo']:.2f}x gloo" if p["cost_over_gloo"] else "" for p in points],
                    fontsize="small")
    right.set_ylabel("host-seconds per step (reducer hosts counted)")
    for ax in (left, right):
        ax.set_xticks(x, labels)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("DDP training of examples/train_lm.py")
    fig.savefig(path, dpi=100)
    return path


def write_figures(info: RunInfo, results: Sequence[StepResult], results_dir: Path) -> None:
    """One PNG per section that has data; a plot that fails is noted, not fatal."""
    transport, uniform, latency, perflow, ddp, multirank = (
        section_data(results, sec) for sec in ("transport", "allreduce", "latency", "perflow", "ddp", "multirank"))
    jobs: list[tuple[str, str, Callable[[Path], Path]]] = []
    if transport:
        jobs.append(("transport", "transport.png", lambda p: plot_transport(transport_points(transport), p)))
    if uniform:
        jobs.append(("allreduce", "allreduce.png", lambda p: plot_allreduce(
            allreduce_points(uniform), p, "all-reduce algbw against the link bounds (uniform links)")))
    if latency:
        jobs.append(("latency", "latency.png", lambda p: plot_latency(latency, p)))
    if perflow:
        jobs.append(("perflow", "allreduce-perflow.png", lambda p: plot_allreduce(
            allreduce_points(perflow), p, "all-reduce under per-flow imbalance")))
    if ddp:
        jobs.append(("ddp", "ddp.png", lambda p: plot_ddp(ddp_points(ddp), p)))
    if multirank:
        jobs.append(("multirank", "allreduce-multirank.png", lambda p: plot_allreduce(
            allreduce_points(multirank), p, "all-reduce with several ranks per host against the host-link bounds")))
    for section, name, fn in jobs:
        try:
            fn(results_dir / name)
            info.figures[section] = name
        except Exception as e:  # noqa: BLE001 - a broken plot must not lose the report
            info.figure_errors[section] = f"{type(e).__name__}: {e}"
