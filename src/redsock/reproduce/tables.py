"""The report's pure part: bounds per series, points and tables from parsed rows (no I/O)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import results as report
from ..bench.bounds import GOODPUT_FACTOR, host_nic_factor, link_goodput_GBps
from ..bench.suite import SERIES_LABELS, check_ddp
from ..errors import ConfigError

#: The algorithm between hosts of a hierarchical series, in words.
_INTER = {"server": "reducers", "ring": "ring", "small": "recursive doubling", "none": "nothing"}


# ----------------------------------------------------------------------------- bounds per series

def series_algo(series: str) -> str:
    """The algorithm behind a series: ``server`` for the reducers', ``auto`` (chosen by size)
    for auto's, else a ring (gloo's, redsock's over one socket or Fast Socket)."""
    return "server" if series.startswith("server") else "auto" if series.startswith("auto") else "ring"


def traffic_factor(series: str, world: int, hosts: int | None = None, scheme: str = "flat") -> float:
    """Bytes each host's link carries each way per byte of all-reduce buffer, ``world`` ranks
    on ``hosts`` hosts (default: one rank per host): with one rank per host 2(N-1)/N for a
    ring (gloo's too) and 1 for the reducers (S out, S in); with L ranks per host see
    :func:`~.testbed_launch.host_nic_factor` (ring 2(N-1)/N flat, 2(H-1)/H hierarchical;
    reducers L flat, 1 hierarchical)."""
    hosts = world if hosts is None else hosts
    if world < 2 or hosts < 2:
        raise ConfigError(f"world and hosts must be >= 2, got {world} ranks on {hosts} hosts")
    factor = host_nic_factor(series_algo(series), world, hosts, scheme)
    if factor is None:
        raise ConfigError(f"no traffic bound for series {series!r}")
    return factor


def algbw_bound_GBps(series: str, world: int, rate_bps: float, factor: float = GOODPUT_FACTOR,
                     hosts: int | None = None, scheme: str = "flat") -> float:
    """The algbw a link-bound all-reduce reaches: link goodput / bytes per byte of buffer."""
    return link_goodput_GBps(rate_bps, factor) / traffic_factor(series, world, hosts, scheme)


def ideal_over_gloo(series: str, world: int, hosts: int | None = None, scheme: str = "flat") -> float | None:
    """algbw ratio against gloo's flat ring when both are link-bound (None for gloo itself)."""
    if series == "gloo" or series == "auto":
        return None
    return traffic_factor("gloo", world, hosts) / traffic_factor(series, world, hosts, scheme)


def latency_growth_model(series: str, n_lo: int, n_hi: int) -> float | None:
    """How a link-latency-bound small all-reduce should grow from n_lo to n_hi workers:
    ring 2(N-1) steps, recursive doubling log2 N, reducers 2 hops whatever N."""
    if series in ("ring", "ring1"):
        return (n_hi - 1) / (n_lo - 1)
    if series == "auto":
        return math.log2(n_hi) / math.log2(n_lo)
    if series == "server":
        return 1.0
    return None


# ----------------------------------------------------------------------------- transport (pure)

@dataclass(frozen=True)
class TransportPoint:
    bytes: int
    label: str
    nsocks: int
    classes_hit: tuple[int, ...]
    gbps: float
    bound_gbps: float  #: the sum of all path class rates x goodput factor
    over_static: float | None = None
    over_one_socket: float | None = None

    @property
    def of_bound(self) -> float:
        return self.gbps / self.bound_gbps


def _transport_label(r: dict[str, Any]) -> str:
    if r["impl"] == "plain":
        return "one socket (fastest class)"
    return ("Fast Socket, dynamic slicing" if r["balance"] == "dynamic"
            else "static even split (NCCL socket)") + f" x{r['nsocks']}"


def transport_points(rows: Sequence[dict[str, Any]]) -> list[TransportPoint]:
    """Per row of ``bench transport --testbed``: throughput, bound, and for dynamic runs
    the ratios to the static split (same size and streams) and to one socket (same size)."""
    out = []
    for r in rows:
        e = r.get("extra", {})
        rates = e.get("rates")
        if not rates:
            raise ConfigError("transport row without extra.rates (not from --testbed perflow?)")
        bound = sum(rates) * float(e.get("goodput_factor", GOODPUT_FACTOR)) / 1e9
        static = plain = None
        if r["impl"] == "redsock" and r["balance"] == "dynamic":
            s = next((x for x in rows if x["impl"] == "redsock" and x["balance"] == "static"
                      and x["bytes"] == r["bytes"] and x["nsocks"] == r["nsocks"] and x["gbps"] > 0), None)
            p = next((x for x in rows if x["impl"] == "plain" and x["bytes"] == r["bytes"] and x["gbps"] > 0), None)
            static = r["gbps"] / s["gbps"] if s else None
            plain = r["gbps"] / p["gbps"] if p else None
        out.append(TransportPoint(int(r["bytes"]), _transport_label(r), int(r["nsocks"]),
                                  tuple(e.get("classes_hit", ())), float(r["gbps"]), bound, static, plain))
    return sorted(out, key=lambda p: (p.bytes, _TRANSPORT_ORDER.get(p.label.split(" x")[0], 9), p.nsocks))


_TRANSPORT_ORDER = {"Fast Socket, dynamic slicing": 0, "static even split (NCCL socket)": 1,
                    "one socket (fastest class)": 2}


def ratio(x: float | None, fmt: str = "{:.2f}x") -> str:
    return "-" if x is None else fmt.format(x)


def transport_table(points: Sequence[TransportPoint]) -> str:
    """Markdown: throughput against the classes' goodput, and the Fast Socket ratios."""
    lines = [("| size | configuration | classes hit | Gbit/s | bound Gbit/s | / bound | dynamic / static | "
              "dynamic / one socket |"),
             "|---:|:---|:---:|---:|---:|---:|---:|---:|"]
    for p in points:
        lines.append(f"| {report.human_size(p.bytes)} | {p.label} | {','.join(map(str, p.classes_hit)) or '-'} "
                     f"| {p.gbps:.3f} | {p.bound_gbps:.3f} | {100 * p.of_bound:.1f}% "
                     f"| {ratio(p.over_static)} | {ratio(p.over_one_socket)} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- all-reduce (pure)

@dataclass(frozen=True)
class ArPoint:
    """One all-reduce row with its series, bound and ratios."""

    series: str
    row: report.Row
    rate_bps: float
    bound_GBps: float | None  #: None where no host link is crossed or the algorithm has no closed form
    over_gloo: float | None
    ideal_over_gloo: float | None
    over_one_socket: float | None  #: Fast Socket ring / ring over 1 socket, same size
    scheme: str = "flat"  #: "hierarchical" where the ranks of a host reduced among themselves first
    inter: str = "ring"  #: the algorithm between hosts

    @property
    def of_bound(self) -> float | None:
        return self.row.algbw_GBps / self.bound_GBps if self.bound_GBps else None

    @property
    def label(self) -> str:
        label = SERIES_LABELS.get(self.series, self.series)
        if self.scheme == "hierarchical":
            return f"{label}: hierarchical, {_INTER.get(self.inter, self.inter)} between hosts"
        return label


def _testbed_meta(r: report.Row) -> tuple[float, float, str]:
    tb = r.extra.get("testbed", {})
    if "rate_bps" not in tb:
        raise ConfigError(f"all-reduce row without extra.testbed.rate_bps ({r.label}, {r.bytes} B)")
    return float(tb["rate_bps"]), float(tb.get("goodput_factor", GOODPUT_FACTOR)), tb.get("profile", "uniform")


def placement(r: report.Row) -> tuple[int, str, str]:
    """(worker hosts, scheme, algorithm between hosts) of a tagged row.  Rows of one rank per
    host may name no ranks per host; rows that record no route (``allreduce.route``) ran
    their series' algorithm flat; gloo's ring is always flat."""
    hosts = int(r.extra.get("testbed", {}).get("workers", r.world))
    series = r.extra["series"]
    if series.startswith("gloo"):
        return hosts, "flat", "ring"
    return hosts, r.extra.get("scheme", "flat"), r.extra.get("inter", series_algo(series))


def allreduce_points(rows: Iterable[report.Row]) -> dict[tuple[str, int], list[ArPoint]]:
    """Tagged rows (see :func:`tag_rows`) grouped per (profile, N), each with its bound
    and its ratios to gloo and to the one-socket ring of the same size."""
    groups: dict[tuple[str, int], list[report.Row]] = {}
    for r in rows:
        groups.setdefault((_testbed_meta(r)[2], r.world), []).append(r)
    out: dict[tuple[str, int], list[ArPoint]] = {}
    for (profile, world), rs in sorted(groups.items()):
        by = {(r.extra["series"], r.bytes): r for r in rs}
        by_step = {(r.extra["step"], r.bytes): r for r in rs if r.extra["series"].startswith("gloo")}
        pts = []
        for r in rs:
            series = r.extra["series"]
            rate, gf, _ = _testbed_meta(r)
            hosts, scheme, inter = placement(r)
            # gloo of the same run first (a section may run several), else of the same N
            gloo = (by_step.get((r.extra["step"], r.bytes), by.get(("gloo", r.bytes)))
                    if not series.startswith("gloo") else None)
            one = by.get(("ring1", r.bytes)) if series == "ring" else None
            factor = host_nic_factor(inter, world, hosts, scheme)
            ideal = None if series.startswith("gloo") or not factor else traffic_factor("gloo", world, hosts) / factor
            pts.append(ArPoint(
                series, r, rate, link_goodput_GBps(rate, gf) / factor if factor else None,
                r.algbw_GBps / gloo.algbw_GBps if gloo and gloo.algbw_GBps > 0 else None, ideal,
                r.algbw_GBps / one.algbw_GBps if one and one.algbw_GBps > 0 else None, scheme, inter))
        order = list(SERIES_LABELS)
        out[(profile, world)] = sorted(pts, key=lambda p: (p.row.bytes, order.index(p.series)
                                                           if p.series in order else 99))
    return out


def us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.0f}" if us >= 1000 else f"{us:.1f}"


def allreduce_table(points: Sequence[ArPoint]) -> str:
    """Markdown for one (profile, N): algbw and busbw, the bound and the ratios."""
    lines = [("| size | series | time (µs) | algbw (GB/s) | busbw (GB/s) | bound algbw (GB/s) | algbw / bound "
              "| / gloo | ideal / gloo | Fast Socket / 1 socket | machine busy |"),
             "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        r = p.row
        lines.append(f"| {report.human_size(r.bytes)} | {p.label} | {us(r.median_s)} "
                     f"| {r.algbw_GBps:.4f} | {r.busbw_GBps:.4f} | {ratio(p.bound_GBps, '{:.4f}')} "
                     f"| {ratio(None if p.of_bound is None else 100 * p.of_bound, '{:.1f}%')} "
                     f"| {ratio(p.over_gloo)} | {ratio(p.ideal_over_gloo)} | {ratio(p.over_one_socket)} "
                     f"| {report.percent(r.extra.get('machine_busy'))} |")
    return "\n".join(lines)


def latency_matrix(rows: Iterable[report.Row]) -> dict[tuple[int, str], dict[int, report.Row]]:
    """{(bytes, series): {N: row}} from tagged latency rows."""
    out: dict[tuple[int, str], dict[int, report.Row]] = {}
    for r in rows:
        out.setdefault((r.bytes, r.extra["series"]), {})[r.world] = r
    return out


def latency_table(rows: Iterable[report.Row]) -> str:
    """Markdown: median time per (size, series) for every N, the growth from the smallest
    to the largest N, and the growth a latency-bound algorithm would show."""
    m = latency_matrix(rows)
    ns = sorted({n for by in m.values() for n in by})
    if not ns:
        return "(no rows)"
    lo, hi = ns[0], ns[-1]
    grow = lo != hi  # growth columns only with two N or more
    head = "| size | series | " + " | ".join(f"N={n} (µs)" for n in ns) + " |"
    head += f" N={hi} / N={lo} | model |" if grow else ""
    lines = [head, "|---:|:---|" + "---:|" * (len(ns) + 2 * grow)]
    order = list(SERIES_LABELS)
    for (size, series), by in sorted(m.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1])
                                                                 if kv[0][1] in order else 99)):
        cells = [us(by[n].median_s) if n in by else "-" for n in ns]
        line = f"| {report.human_size(size)} | {SERIES_LABELS.get(series, series)} | " + " | ".join(cells) + " |"
        if grow:
            growth = by[hi].median_s / by[lo].median_s if lo in by and hi in by else None
            line += f" {ratio(growth)} | {ratio(latency_growth_model(series, lo, hi))} |"
        lines.append(line)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- DDP (pure)

def ddp_points(objs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each result plus: ratio to gloo (same workers), the ideal ratio, the steps/s a step
    that were only its gradient all-reduce at link goodput would reach, and the cost per
    step (host-seconds, reducer hosts counted) against gloo's."""
    check_ddp(objs)
    out = []
    for o in objs:
        # Results of one rank per host name no ranks per host, world and scheme.
        n, world, scheme = int(o["workers"]), int(o.get("world", o["workers"])), o.get("scheme", "flat")
        gloo = next((g for g in objs if g["algo"] == "gloo" and int(g["workers"]) == n
                     and int(g.get("world", n)) == world), None)
        # "auto" is whatever redsock chose per bucket: no closed form
        factor = None if o["algo"] == "auto" else host_nic_factor(series_algo(o["algo"]), world, n, scheme)
        bytes_per_step = float(o["grad_bytes"]) * (factor or 0.0)
        bound = link_goodput_GBps(float(o["rate_bps"])) * 1e9 / bytes_per_step if bytes_per_step > 0 else None
        p = dict(o)
        p["over_gloo"] = (o["steps_per_s"] / gloo["steps_per_s"]
                          if gloo and gloo is not o and gloo["steps_per_s"] > 0 else None)
        p["ideal_over_gloo"] = (None if o["algo"] == "gloo" or not factor
                                else traffic_factor("gloo", world, n) / factor)
        p["comm_bound_steps_per_s"] = bound
        p["of_bound"] = o["steps_per_s"] / bound if bound else None
        p["cost_over_gloo"] = (o["host_s_per_step"] / gloo["host_s_per_step"]
                               if gloo and gloo is not o and gloo["host_s_per_step"] > 0 else None)
        out.append(p)
    order = {"gloo": 0, "ring": 1, "server": 2, "auto": 3}
    return sorted(out, key=lambda p: (int(p["workers"]), order.get(p["algo"], 9)))


def ddp_table(points: Sequence[dict[str, Any]]) -> str:
    lines = [("| workers | algo | backend | reducer hosts | steps/s | / gloo | ideal / gloo | comm-bound steps/s "
              "| / bound | hosts | host-s / step | cost / gloo | final loss |"),
             "|---:|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        lines.append(
            f"| {p['workers']} | {p['algo']} | {p['backend']} | {p['servers']} | {p['steps_per_s']:.3f} "
            f"| {ratio(p['over_gloo'])} | {ratio(p['ideal_over_gloo'])} "
            f"| {ratio(p['comm_bound_steps_per_s'], '{:.3f}')} | {ratio(p['of_bound'], '{:.0%}')} | {p['hosts']} "
            f"| {p['host_s_per_step']:.3f} | {ratio(p['cost_over_gloo'])} | {p['final_loss']:.4f} |")
    return "\n".join(lines)
