"""Benchmark results: nccl-tests tables, comparisons against gloo, JSON Lines and plots.

Pure formatting: the only I/O is writing (and reading back) the files asked for.

Bandwidths follow nccl-tests exactly (``doc/PERFORMANCE.md`` there):
``algbw = bytes / 1e9 / time`` and ``busbw = algbw * factor`` with the factor of the
collective; for all-reduce ``2(n-1)/n``, the same for every algorithm, so a reduction
server shows a busbw above the link rate.  As in nccl-tests, a single rank has
factor 0, hence busbw 0: nothing crosses a bus.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ConfigError

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "BUS_FACTORS", "Row", "bus_factor", "compare_table", "format_table", "human_size",
    "plot", "read_json", "rich_tables", "write_json",
]

#: nccl-tests' bus-bandwidth factor per collective, as a function of the world size.
BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "reducescatter": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}


def bus_factor(coll: str, world: int) -> float:
    """busbw / algbw for collective ``coll`` on ``world`` ranks (nccl-tests' factors)."""
    if world < 1:
        raise ConfigError(f"world must be >= 1, got {world}")
    try:
        return BUS_FACTORS[coll](world)
    except KeyError:
        raise ConfigError(f"unknown collective {coll!r}; known: {', '.join(BUS_FACTORS)}") from None


@dataclass(frozen=True)
class Row:
    """One measured message size of one implementation/algorithm: a line of the table."""

    impl: str  #: "redsock", "gloo", "mpi", ...
    algo: str  #: "ring", "small", "server", "gloo", ...
    world: int
    bytes: int  #: message size per rank
    count: int  #: elements per rank
    dtype: str  #: numpy name: "float32", "bfloat16", ...
    op: str  #: "sum", "avg", ... ("none" for transfers without a reduction)
    median_s: float
    min_s: float
    max_s: float
    algbw_GBps: float
    busbw_GBps: float
    wrong: int = -1  #: elements that failed the check, -1 when not checked
    coll: str = "allreduce"
    extra: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.world < 1 or self.bytes < 0 or self.count < 0 or self.wrong < -1:
            raise ConfigError(f"bad row: world={self.world} bytes={self.bytes} "
                              f"count={self.count} wrong={self.wrong}")

    @classmethod
    def from_times(cls, impl: str, algo: str, world: int, nbytes: int, count: int, dtype: Any, op: Any,
                   times: Sequence[float], wrong: int = -1, *, coll: str = "allreduce",
                   extra: dict[str, Any] | None = None) -> Row:
        """A row from per-iteration wall times in seconds (median, min, max; bandwidths
        from the median). ``dtype`` may be a numpy dtype, ``op`` a :class:`~redsock.ops.ReduceOp`.

        Raises :class:`ConfigError` for no times, a non-positive or non-finite time, or an
        unknown collective.
        """
        if len(times) == 0:
            raise ConfigError("from_times needs at least one time")
        if not all(math.isfinite(t) and t > 0 for t in times):
            raise ConfigError(f"times must be positive seconds, got {list(times)!r}")
        median = statistics.median(times)
        algbw = nbytes / 1e9 / median
        return cls(
            impl=impl, algo=algo, world=world, bytes=nbytes, count=count,
            dtype=dtype if isinstance(dtype, str) else np.dtype(dtype).name,
            op=op if isinstance(op, str) else op.name.lower(),
            median_s=median, min_s=min(times), max_s=max(times),
            algbw_GBps=algbw, busbw_GBps=algbw * bus_factor(coll, world),
            wrong=wrong, coll=coll, extra=dict(extra or {}),
        )

    @property
    def label(self) -> str:
        """"impl/algo", or just "gloo" where they coincide."""
        return self.impl if self.impl == self.algo else f"{self.impl}/{self.algo}"


# ------------------------------------------------------------------ sizes

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def percent(x: float | None) -> str:
    """A share 0..1 as a whole percentage; "-" for none."""
    return "-" if x is None else f"{100 * x:.0f}%"


def human_size(n: float, sep: str = " ") -> str:
    """8 -> "8 B", 1024 -> "1 KiB", 1536 -> "1.5 KiB", 64 << 20 -> "64 MiB" (binary units).

    Parsing goes the other way in :func:`redsock.config.parse_size`.
    """
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:.4g}{sep}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


def per_half(times: Mapping[int, float]) -> dict[int, float | None]:
    """Each size's time over the time of half its size, where that was timed too (else None):
    how steeply time grows with size (a cliff: twice the bytes, more than about twice the time)."""
    return {n: t / times[n // 2] if n % 2 == 0 and times.get(n // 2) else None for n, t in times.items()}


def times_x(ratio: float | None) -> str:
    """A ratio as "1.23x"; "-" for none."""
    return "-" if ratio is None else f"{ratio:.2f}x"


# ------------------------------------------------------------------ nccl-tests table

# (name, unit, width): widths include the separating blanks; nccl-tests' layout.
_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("size", "(B)", 12), ("count", "(elements)", 14), ("type", "", 10), ("redop", "", 7),
    ("time", "(us)", 10), ("algbw", "(GB/s)", 8), ("busbw", "(GB/s)", 8), ("#wrong", "", 8),
)


def _time_us(seconds: float) -> str:
    us = seconds * 1e6  # nccl-tests: fewer decimals as the number grows, to keep the width
    return f"{us:.0f}" if us >= 10000 else f"{us:.1f}" if us >= 100 else f"{us:.2f}"


#: Beside #wrong in a table whose rows were checked on a 16-bit wire: the largest relative error.
_MAX_ERR_COLUMN = ("maxerr", "(rel)", 10)


def _columns(rows: Sequence[Row]) -> tuple[tuple[str, str, int], ...]:
    return _COLUMNS + ((_MAX_ERR_COLUMN,) if any("max_rel_err" in r.extra for r in rows) else ())


def _cells(r: Row, columns: Sequence[tuple[str, str, int]] = _COLUMNS) -> tuple[str, ...]:
    cells: tuple[str, ...] = (str(r.bytes), str(r.count), r.dtype, r.op, _time_us(r.median_s),
             f"{r.algbw_GBps:.2f}", f"{r.busbw_GBps:.2f}", "N/A" if r.wrong < 0 else str(r.wrong))
    if len(columns) > len(_COLUMNS):
        err = r.extra.get("max_rel_err")
        cells += ("N/A" if err is None else f"{err:.2e}",)
    return cells


def _groups(rows: Iterable[Row]) -> dict[tuple[str, str, int, str], list[Row]]:
    """Rows per table, in order of first appearance."""
    groups: dict[tuple[str, str, int, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.impl, r.algo, r.world, r.coll), []).append(r)
    return groups


def _group_title(rows: list[Row]) -> str:
    r = rows[0]
    wires = sorted({w for w in (q.extra.get("wire_dtype") for q in rows) if w})
    on = f" on the {'/'.join(wires)} wire" if wires else ""
    return f"{r.label}{on}: {r.coll}, {r.world} rank{'s' if r.world != 1 else ''}"


def _footer(rows: list[Row]) -> list[str]:
    checked = [r.wrong for r in rows if r.wrong >= 0]
    wrong = sum(checked)
    status = "N/A" if not checked else f"{wrong} {'OK' if wrong == 0 else 'FAILED'}"
    avg = statistics.fmean(r.busbw_GBps for r in rows)
    return [f"Out of bounds values : {status}", f"Avg bus bandwidth    : {avg:g}"]


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)).rstrip()


def format_table(rows: Iterable[Row], title: str | None = None) -> str:
    """The nccl-tests table, one per (impl, algo, world, collective), as plain text.

    Header and footer lines start with "#" like nccl-tests'; the footer has the
    total of wrong elements and the average bus bandwidth over the sizes.
    """
    out: list[str] = [f"# {title}", "#"] if title else []
    groups = _groups(rows)
    if not groups:
        return "\n".join([*out, "# no results"]) + "\n"
    for group in groups.values():
        columns = _columns(group)
        widths = [w for _, _, w in columns]
        names, units = [name for name, _, _ in columns], [unit for _, unit, _ in columns]
        out += [f"# {_group_title(group)}", "#"]
        out += ["#" + _line(names, widths)[1:], "#" + _line(units, widths)[1:]]
        out += [_line(_cells(r, columns), widths) for r in group]
        out += [f"# {line}" for line in _footer(group)]
        out.append("#")
    return "\n".join(out[:-1]) + "\n"


def rich_tables(rows: Iterable[Row], title: str | None = None) -> list[Table]:
    """The same tables as :func:`format_table` as ``rich`` tables (``console.print(*tables)``)."""
    from rich.table import Table

    tables = []
    for group in _groups(rows).values():
        name = _group_title(group)
        table = Table(title=f"{title}: {name}" if title else name, caption="  ".join(_footer(group)))
        columns = _columns(group)
        for col, unit, _ in columns:
            table.add_column(f"{col} {unit}".strip(), justify="right")
        for r in group:
            table.add_row(*_cells(r, columns))
        tables.append(table)
    return tables


# ------------------------------------------------------------------ comparison

def compare_table(rows: Iterable[Row], baseline_algo: str = "gloo") -> str:
    """Side by side per message size: every (impl, algo)'s busbw and median time, and
    its ratios against the baseline measured in the same run.

    ``bw/<base>`` is busbw / baseline busbw (above 1: faster), ``t/<base>`` is median
    time / baseline median time (below 1: faster); "-" where there is no baseline
    row for that size (or its busbw is 0, as with one rank). One table per
    (collective, world, dtype, op); where a series has several rows for one size
    the last one counts.
    """
    cases: dict[tuple[str, int, str, str], dict[str, dict[int, Row]]] = {}
    for r in rows:
        series = cases.setdefault((r.coll, r.world, r.dtype, r.op), {})
        series.setdefault(r.label, {})[r.bytes] = r
    if not cases:
        return "# no results\n"
    out: list[str] = []
    for (coll, world, dtype, op), series in cases.items():
        base_label = next((lab for lab, by in series.items()
                           if next(iter(by.values())).algo == baseline_algo), None)
        labels = sorted(series, key=lambda lab: lab != base_label)  # baseline first, stable
        sizes = sorted({b for by in series.values() for b in by})
        head1, head2, widths = ["size"], [""], [10]
        ratios = [f"bw/{baseline_algo}", f"t/{baseline_algo}"]
        with_ratios = {lab: base_label is not None and lab != base_label for lab in labels}
        for lab in labels:
            sub = ["busbw", "time(us)", *(ratios if with_ratios[lab] else [])]
            head1 += [lab] + [""] * (len(sub) - 1)
            head2 += sub
            widths += [9, 10] + [max(9, len(s) + 2) for s in sub[2:]]
        out.append(f"# {coll} {dtype} {op}, {world} ranks: busbw in GB/s, median time in us"
                   + (f"; ratios against {base_label} in this run" if base_label
                      else f"; no {baseline_algo} baseline in this run"))
        out.append("#" + _group_header(head1, widths)[1:])
        out.append("#" + _line(head2, widths)[1:])
        for size in sizes:
            cells = [human_size(size)]
            base = series[base_label].get(size) if base_label else None
            for lab in labels:
                cur = series[lab].get(size)
                if cur is None:
                    cells += ["-"] * (4 if with_ratios[lab] else 2)
                    continue
                cells += [f"{cur.busbw_GBps:.3f}", _time_us(cur.median_s)]
                if with_ratios[lab]:
                    bw = f"{cur.busbw_GBps / base.busbw_GBps:.2f}" if base and base.busbw_GBps > 0 else "-"
                    cells += [bw, f"{cur.median_s / base.median_s:.2f}" if base else "-"]
            out.append(_line(cells, widths))
        out.append("#")
    return "\n".join(out[:-1]) + "\n"


def _group_header(labels: Sequence[str], widths: Sequence[int]) -> str:
    """A header line where each non-empty label spans its column and the empty ones after it."""
    line = ""
    i = 0
    while i < len(labels):
        j = i + 1
        while j < len(labels) and labels[j] == "":
            j += 1
        span = sum(widths[i:j])
        line += labels[i].rjust(span) if i == 0 else "  " + labels[i].ljust(span - 2)
        i = j
    return line.rstrip()


# ------------------------------------------------------------------ JSON Lines

_FIELDS = {f.name: f for f in fields(Row)}
_INT_FIELDS = ("world", "bytes", "count", "wrong")
_FLOAT_FIELDS = ("median_s", "min_s", "max_s", "algbw_GBps", "busbw_GBps")


def write_json(rows: Iterable[Row], path: str | Path, append: bool = False) -> Path:
    """One JSON object per row and line (JSON Lines), every field of :class:`Row`.

    Strict JSON: a NaN or infinity in ``extra`` raises ``ValueError``.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a" if append else "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(asdict(r), allow_nan=False) + "\n")
    return p


def read_json(path: str | Path) -> list[Row]:
    """Rows written by :func:`write_json`. Keys that are not Row fields go into ``extra``.

    Raises :class:`ConfigError` naming the line for malformed JSON or a missing field.
    """
    rows = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            known = {k: v for k, v in obj.items() if k in _FIELDS}
            extra = {**known.pop("extra", {}), **{k: v for k, v in obj.items() if k not in _FIELDS}}
            for k in _INT_FIELDS:
                if k in known:
                    known[k] = int(known[k])
            for k in _FLOAT_FIELDS:
                if k in known:
                    known[k] = float(known[k])
            rows.append(Row(**known, extra=extra))
        except (ValueError, TypeError, AttributeError) as e:
            raise ConfigError(f"{path}:{lineno}: not a benchmark row: {e}") from None
    return rows


# ------------------------------------------------------------------ plot

_METRIC_LABELS = {
    "busbw_GBps": "bus bandwidth (GB/s)",
    "algbw_GBps": "algorithm bandwidth (GB/s)",
}


def _size_ticks(lo: int, hi: int, max_ticks: int = 12) -> list[int]:
    """Powers of two spanning [lo, hi], thinned to at most ``max_ticks``."""
    e_lo, e_hi = math.floor(math.log2(lo)), math.ceil(math.log2(hi))
    step = max(1, math.ceil((e_hi - e_lo + 1) / max_ticks))
    return [2**e for e in range(e_lo, e_hi + 1) if (e - e_lo) % step == 0]


def plot(rows: Iterable[Row], path: str | Path, metric: str = "busbw_GBps", title: str | None = None) -> Path:
    """PNG of ``metric`` (top) and median latency in µs (bottom, log scale, min-max band)
    against message size (log2 axis, "8B".."64MiB"), one line per (impl, algo).

    Rows with 0 bytes cannot sit on a log axis and are left out. Uses matplotlib's Agg
    canvas directly, so it neither needs a display nor touches pyplot's global state.
    Raises :class:`ConfigError` for an unknown metric or nothing to plot.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    if metric not in _METRIC_LABELS:
        raise ConfigError(f"unknown metric {metric!r}; known: {', '.join(_METRIC_LABELS)}")
    pts = [r for r in rows if r.bytes > 0]
    if not pts:
        raise ConfigError("nothing to plot: no rows with a non-zero size")
    # One line per (impl, algo); the other keys join the label only where they vary.
    varying = [k for k in ("coll", "world", "dtype", "op") if len({getattr(r, k) for r in pts}) > 1]
    series: dict[str, list[Row]] = {}
    for r in pts:
        label = " ".join([r.label] + [f"{k}={getattr(r, k)}" for k in varying])
        series.setdefault(label, []).append(r)

    fig = Figure(figsize=(9, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r.bytes)
        x = [r.bytes for r in rs]
        (line,) = top.plot(x, [getattr(r, metric) for r in rs], marker="o", ms=4, label=label)
        bottom.plot(x, [r.median_s * 1e6 for r in rs], marker="o", ms=4, color=line.get_color(), label=label)
        bottom.fill_between(x, [r.min_s * 1e6 for r in rs], [r.max_s * 1e6 for r in rs],
                            color=line.get_color(), alpha=0.15, linewidth=0)
    ticks = _size_ticks(min(r.bytes for r in pts), max(r.bytes for r in pts))
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: human_size(v, sep="")))
        ax.grid(True, which="major", alpha=0.3)
    top.set_ylabel(_METRIC_LABELS[metric])
    top.legend(loc="upper left", fontsize="small")
    bottom.set_yscale("log")
    bottom.set_ylabel("median time (µs)")
    bottom.set_xlabel("message size per rank")
    if title:
        fig.suptitle(title)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    return p
