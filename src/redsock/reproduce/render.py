"""``results.md``: every section of the report, rendered from the steps' results."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from .. import results as report
from ..bench.bounds import GOODPUT_FACTOR, host_nic_factor
from ..bench.suite import PERFLOW_CAVEAT, PLANS, SERIES_LABELS, Settings, StepResult
from ..errors import ConfigError
from ..plan import DEFAULT, lab
from ..testbed.netns import format_rate
from .tables import (
    ArPoint,
    allreduce_points,
    allreduce_table,
    ddp_points,
    ddp_table,
    latency_growth_model,
    latency_matrix,
    latency_table,
    placement,
    ratio,
    traffic_factor,
    transport_points,
    transport_table,
    us,
)

#: The folder of raw outputs beside results.md.
RESULTS = "results"


@dataclass
class RunInfo:
    settings: Settings
    machine: dict[str, str]
    started: datetime
    wall_s: float
    python: str
    prefix: str
    env: dict[str, str] = field(default_factory=dict)  #: inherited REDSOCK_* variables
    figures: dict[str, str] = field(default_factory=dict)  #: section -> PNG file name under results/
    figure_errors: dict[str, str] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)  #: namespaces this run had to remove


def _fence(text: str) -> str:
    return "```\n" + (text.replace("```", "'''").rstrip() or "(no output)") + "\n```"


def _failures(results: Sequence[StepResult]) -> list[str]:
    out = []
    for r in results:
        if r.status == "not run":
            out.append(f"**Not run:** `{r.step.key}` ({r.step.title}): the run stopped before it.")
        elif not r.ok:
            out.append(f"**{r.status.upper()}:** `{r.step.key}` ({r.step.title})"
                       + (f", exit {r.rc}" if r.rc is not None else "") + f" after {r.wall_s:.0f} s:")
            out.append(_fence(r.error))
    return out


def _section_rows(results: Sequence[StepResult], section: str) -> list[StepResult]:
    return [r for r in results if r.step.section == section]


def section_data(results: Sequence[StepResult], *sections: str) -> list[Any]:
    """The raw rows of ``results`` (only those of ``sections``, when given), in step order."""
    return [x for r in results if not sections or r.step.section in sections for x in r.data]


def headline(results: Sequence[StepResult]) -> list[tuple[str, str, str]]:
    """(claim, measured here, bound or ideal) for the summary table; failed steps listed last."""
    out: list[tuple[str, str, str]] = []
    for sections, part in ((("transport",), _headline_transport), (("allreduce", "perflow"), _headline_allreduce),
                           (("latency",), _headline_latency), (("ddp",), _headline_ddp),
                           (("multirank",), _headline_multirank)):
        rows = section_data(results, *sections)
        if not rows:
            continue
        try:
            out += part(rows)
        except (ConfigError, KeyError, TypeError, ValueError) as e:  # the section says more
            out.append((part.__name__.removeprefix("_headline_"), f"unreadable results: {e}", "-"))
    for r in results:
        if not r.ok:
            out.append((f"{r.step.title}", f"**{r.status}** (see its section)", "-"))
    return out


def _headline_transport(rows: list[Any]) -> list[tuple[str, str, str]]:
    out = []
    pts = transport_points(rows)
    dyn = [p for p in pts if p.over_static is not None or p.over_one_socket is not None]
    if dyn:
        p = max(dyn, key=lambda p: (p.bytes, -p.nsocks))
        out.append(("Fast Socket: 60%+ more bandwidth (per-flow imbalance)",
                    (f"{report.human_size(p.bytes)}: {p.gbps:.2f} Gbit/s = {100 * p.of_bound:.0f}% of bound; "
                     f"{ratio(p.over_one_socket)} one socket, {ratio(p.over_static)} static split"),
                    f"{p.bound_gbps:.2f} Gbit/s (classes' goodput)"))
    return out


def _at_largest(rows: list[Any]) -> Iterator[tuple[str, int, int, list[ArPoint]]]:
    """Per (profile, N) of the all-reduce points: the largest size and the points measured at it."""
    for (profile, n), pts in allreduce_points(rows).items():
        top = max(p.row.bytes for p in pts)
        yield profile, n, top, [p for p in pts if p.row.bytes == top]


def _headline_allreduce(rows: list[Any]) -> list[tuple[str, str, str]]:
    out = []
    for profile, n, top, pts in _at_largest(rows):
        big = {p.series: p for p in pts}
        where = f"N={n}, {report.human_size(top)}" + (", per-flow links" if profile == "perflow" else "")
        ring = big.get("ring")
        if ring and ring.over_one_socket is not None:
            out.append((f"Fast Socket ring vs 1 socket ({where})",
                        f"{ratio(ring.over_one_socket)}; ring at {report.percent(ring.of_bound)} of its bound",
                        "1.00x on uniform links (one flow fills a link)" if profile == "uniform"
                        else "sum of the classes hit / the slowest class"))
        srv = big.get("server")
        if srv:
            out.append((f"Reducers vs gloo algbw ({where})",
                        f"{ratio(srv.over_gloo)}; reducers at {report.percent(srv.of_bound)} of link goodput",
                        f"ideal {ratio(srv.ideal_over_gloo)} = 2(N-1)/N"))
    return out


def _headline_multirank(rows: list[Any]) -> list[tuple[str, str, str]]:
    out = []
    for _, n, top, pts in _at_largest(rows):
        hosts = placement(pts[0].row)[0]
        where = f"{hosts} hosts x {n // hosts} ranks, {report.human_size(top)}"
        for p in pts:
            if not p.series.startswith("gloo"):
                mine = host_nic_factor(p.inter, n, hosts, p.scheme)
                out.append((f"{p.label} vs gloo's flat ring ({where})",
                            f"{ratio(p.over_gloo)}; at {report.percent(p.of_bound)} of its bound",
                            f"ideal {ratio(p.ideal_over_gloo)} (bytes per host link: gloo "
                            f"{traffic_factor('gloo', n, hosts):.2f} S, this "
                            + (f"{mine:.2f} S)" if mine else "no closed form)")))
    return out


def _headline_latency(rows: list[Any]) -> list[tuple[str, str, str]]:
    out = []
    m = latency_matrix(rows)
    ns = sorted({n for by in m.values() for n in by})
    small = min(b for b, _ in m)
    for series in ("ring", "server", "auto", "gloo"):
        by = m.get((small, series))
        if by and len(ns) > 1:
            times = ", ".join(f"N={n}: {us(by[n].median_s)} µs" for n in ns if n in by)
            model = latency_growth_model(series, ns[0], ns[-1])
            out.append((f"{report.human_size(small)} all-reduce latency vs N, {SERIES_LABELS[series]}", times,
                        {"ring": "O(N): 2(N-1) steps", "server": "O(1): 2 hops",
                         "auto": "O(log N)"}.get(series, "-")
                        + (f" (x{model:.2f} from N={ns[0]} to N={ns[-1]})" if model else "")))
    return out


def _headline_ddp(rows: list[Any]) -> list[tuple[str, str, str]]:
    out = []
    for p in ddp_points(rows):
        if p["algo"] != "gloo":
            who = {"server": "reducers", "ring": "redsock ring"}.get(p["algo"], f"redsock {p['algo']}")
            out.append((f"DDP training speed-up, {who} vs gloo (N={p['workers']})",
                        (f"{ratio(p['over_gloo'])} steps/s; cost per step {ratio(p['cost_over_gloo'])} gloo's "
                         f"({p['hosts']} hosts)"), f"ideal {ratio(p['ideal_over_gloo'])} if communication-bound"))
    return out


def invocation(s: Settings) -> str:
    """The ``redsock reproduce`` command line that gives these settings."""
    base = PLANS[s.mode] if s.mode in PLANS else PLANS["full"]
    argv = ["redsock", "reproduce"]
    if s.mode == "quick":
        argv.append("--quick")
    elif s.mode != "full":
        argv += ["--plan", s.mode]
    if s.sections != base.sections:
        argv += ["--only", ",".join(s.sections)]
    if s.workers != base.workers:
        argv += ["--workers", ",".join(map(str, s.workers))]
    if s.rate != base.rate:
        argv += ["--rate", s.rate]
    return shlex.join(argv)


def render_markdown(info: RunInfo, results: Sequence[StepResult], results_dir: Path | None = None) -> str:
    """The whole of results.md; with ``results_dir`` (the run's raw outputs), also the plan's
    model against them."""
    s = info.settings
    m = info.machine
    lines = [
        "# redsock: the seed's claims, measured",
        "",
        (f"Generated by `{invocation(s)}` "
         f"({s.mode} mode) on {info.started.strftime('%Y-%m-%d %H:%M UTC')}, "
         f"{info.wall_s / 60:.1f} minutes. Every host is a network namespace on this one machine, "
         "links shaped by tc (no propagation delay: netem is not available); every ratio compares "
         "figures measured in the same run. Raw JSON, benchmark output and plots are in "
         f"[`{RESULTS}/`]({RESULTS}/)."),
        "",
        "## Machine",
        "",
        "| | |", "|:---|:---|",
        *[f"| {k} | {v} |" for k, v in m.items()],
        "",
        "## Settings",
        "",
        "| | |", "|:---|:---|",
        f"| mode | {s.mode} |",
        f"| sections | {', '.join(s.sections)} |",
        f"| link rate (all-reduce, latency, DDP) | {s.rate} each way, per host; goodput = rate x {GOODPUT_FACTOR} |",
        f"| workers N (all-reduce, latency) | {', '.join(map(str, s.workers))}, with as many reducer hosts |",
        (f"| all-reduce sizes | {s.ar_sizes[0]} .. {s.ar_sizes[1]}, x{s.ar_sizes[2]}; -n {s.ar_iters[0]} "
         f"-w {s.ar_iters[1]} (fewer at >= 64 MiB); float32 sum |"),
        (f"| latency sizes | {s.lat_sizes[0]} .. {s.lat_sizes[1]}, x{s.lat_sizes[2]}; -n {s.lat_iters[0]} "
         f"-w {s.lat_iters[1]} |"),
        (f"| Fast Socket streams | {s.nsocks} data streams + 1 control (REDSOCK_NSOCKS); the one-socket "
         "series sets REDSOCK_NSOCKS=1 |"),
        (f"| transport path classes | {s.transport_rates} (per-flow, picked by source port); sizes "
         f"{s.transport_sizes}; {s.transport_iters} messages x {s.transport_reps} reps |"),
        (f"| TCP congestion control | {s.tcp_cc} in the all-reduce/DDP namespaces; the transport pair keeps the "
         f"kernel default ({m.get('TCP congestion control (default)', '?')}) |"),
        (f"| DDP | {', '.join(f'{n}+{n}' for n in s.ddp_workers)} workers+reducers, {s.ddp_steps[0]} steps, "
         f"{s.ddp_steps[1]} warm-up" + (f", median of {s.ddp_repeats} rounds |" if s.ddp_repeats > 1 else " |")),
        (f"| several ranks per host | {s.multirank_hosts} hosts x {s.ranks_per_host} ranks + "
         f"{s.multirank_hosts} reducers at {s.multirank_rate}; sizes {s.multirank_sizes[0]} .. "
         f"{s.multirank_sizes[1]}, x{s.multirank_sizes[2]}; -n {s.multirank_iters[0]} -w {s.multirank_iters[1]} |"),
        f"| python | `{info.python}` (written `python` below) |",
        f"| namespace prefix | {info.prefix} |",
    ]
    if info.env:
        lines.append(f"| inherited REDSOCK_* | {', '.join(f'{k}={v}' for k, v in sorted(info.env.items()))} |")
    lines += ["", "## Summary", "", "| claim (seed) | measured here | bound / ideal |", "|:---|:---|:---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in headline(results)] or ["| (nothing measured) | | |"]
    fails = _failures(results)
    if fails:
        lines += ["", "Not everything ran: see the sections below."]

    for heading, section, body in (
            ("1. Fast Socket under per-flow imbalance", "transport", _transport_body),
            ("2. All-reduce bandwidth against message size", "allreduce", _allreduce_body),
            ("2b. All-reduce under per-flow imbalance", "perflow", _perflow_body),
            ("3. Small-message latency against N", "latency", _latency_body),
            ("4. DDP training: steps/s and cost per step", "ddp", _ddp_body),
            ("5. Several ranks per host", "multirank", _multirank_body)):
        lines += ["", f"## {heading}", ""]
        lines += _section_body(info, results, section, body)

    lines += ["", "## Commands run", "",
              "| step | status | exit | wall (s) | CPU of ranks + reducers (% of all cores) |",
              "|:---|:---|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.step.key} | {r.status} | {'-' if r.rc is None else r.rc} | {r.wall_s:.0f} "
                     f"| {'-' if r.cpu_pct is None else f'{r.cpu_pct}%'} |")
    lines += ["", "```bash"] + [r.step.command() for r in results if r.status != "not run"]
    lines += ["```"]
    if results_dir is not None:
        lines += ["", "## The model (`redsock plan`) against these measurements", ""]
        lines += lab.results_section(results_dir, DEFAULT)
    if info.leftovers:
        lines += ["", f"Namespaces left behind by a step and removed afterwards: {', '.join(info.leftovers)}."]
    return "\n".join(lines) + "\n"


def _section_body(info: RunInfo, results: Sequence[StepResult], section: str,
                  body: Callable[[RunInfo, Sequence[StepResult]], list[str]]) -> list[str]:
    mine = _section_rows(results, section)
    if section not in info.settings.sections:
        if section == "perflow":
            return [f"Not run (opt-in). {PERFLOW_CAVEAT}"]
        return [f"Not run in {info.settings.mode} mode (`--only` left it out)."]
    out = _failures(mine)
    if any(r.data for r in mine):
        try:
            out += body(info, mine)
        except (ConfigError, KeyError, TypeError, ValueError) as e:
            out += [f"**FAILED** to read the results: {e}"]
    elif not out:
        out.append("No results.")
    if section in info.figure_errors:
        out += ["", f"(plot failed: {info.figure_errors[section]})"]
    return out


def _figure(info: RunInfo, section: str, alt: str) -> list[str]:
    name = info.figures.get(section)
    return ["", f"![{alt}]({RESULTS}/{name})"] if name else []


def _transport_body(info: RunInfo, results: Sequence[StepResult]) -> list[str]:
    rows = section_data(results)
    pts = transport_points(rows)
    rates = ", ".join(format_rate(x) for x in rows[0]["extra"]["rates"])
    return [(f"Two namespaces, one link whose egress has path classes of {rates} picked by source-port bits "
             "(ECMP-like: a flow on a slow path is slow although the link is not full). Fast Socket spreads "
             "slices over its streams by each stream's progress; the static split gives every stream one equal "
             "piece (NCCL's socket transport); one socket is put on the fastest class, its best case. "
             f"Bound: the sum of all class rates x {GOODPUT_FACTOR} (tc counts frame headers)."),
            "", transport_table(pts), *_figure(info, "transport", "transport throughput against the bound")]


def _allreduce_body(info: RunInfo, results: Sequence[StepResult], note: str = "") -> list[str]:
    rows = section_data(results)
    out = [note or (
        "nccl-tests figures (float32 sum): algbw = bytes / time, busbw = algbw x 2(N-1)/N for every series. "
        "Bound on algbw: link goodput / (2(N-1)/N) for a ring (gloo's included: each worker sends "
        "2S(N-1)/N), link goodput for the reducers (each worker sends S and receives S). "
        "`ideal / gloo` is the bound's ratio: 2(N-1)/N for the reducers. On uniform links one TCP flow "
        "already fills a link, so Fast Socket and one socket should match here (section 2b adds imbalance).")]
    for (profile, n), pts in allreduce_points(rows).items():
        cpu = [r.cpu_pct for r in results if r.step.world == n and r.cpu_pct is not None]
        rate = pts[0].rate_bps
        head = f"### N = {n} workers ({profile} links at {format_rate(rate)}"
        head += f", {n} reducer hosts)" if any(p.series == "server" for p in pts) else ")"
        out += ["", head, ""]
        cores = os.cpu_count() or 1
        procs = n + (n if any(p.series == "server" for p in pts) else 0)
        if procs > 4 * cores:
            out += [f"CPU-bound: {procs} processes (ranks and reducers) share {cores} cores"
                    + (f", using up to {max(cpu)}% of them over the runs (start-up included)" if cpu else "")
                    + ": shortfalls from the bound here measure the CPU as much as the network.", ""]
        out.append(allreduce_table(pts))
    out += _figure(info, "allreduce" if not note else "perflow", "all-reduce algbw against the bounds")
    return out


def _prose_and_table(info: RunInfo, section: str, prose: str, table: str, alt: str) -> list[str]:
    return [prose, "", table, *_figure(info, section, alt)]


def _latency_body(info: RunInfo, results: Sequence[StepResult]) -> list[str]:
    table = latency_table(section_data(results))
    return _prose_and_table(info, "latency", (
        "Median time of one all-reduce (float32 sum) against N. A latency-bound ring takes 2(N-1) steps, recursive "
        "doubling (`auto` below 64 KiB) log2 N, the reducers 2 hops whatever N. `model` is the growth from the "
        "smallest to the largest N such an algorithm would show. All ranks share this machine's cores, so CPU "
        "contention grows with N too."), table, "latency against N")


def _perflow_body(info: RunInfo, results: Sequence[StepResult]) -> list[str]:
    return _allreduce_body(info, results, note=(
        "Ring all-reduce on `perflow` links: each link split into path classes of rate x (1, .75, .5, .25) "
        "picked by source-port bits. A connection of one socket (gloo's, or redsock with "
        "REDSOCK_NSOCKS=1) lands on one random class; Fast Socket's streams land on several. Landings "
        "are random per run, so ratios vary between runs. " + PERFLOW_CAVEAT))


def _multirank_body(info: RunInfo, results: Sequence[StepResult]) -> list[str]:
    rows = section_data(results)
    out = [("Real nodes run several ranks (one per GPU). Here every worker host runs L consecutive ranks, "
            "as torchrun numbers them, N = H x L in all, and every figure is bounded by the bytes one host's "
            "link carries each way per byte of buffer S: gloo's flat ring 2S(N-1)/N (of the ring's edges only "
            "the one leaving a host crosses its link), redsock's hierarchical ring 2S(H-1)/H (the ranks of a "
            "host reduce among themselves first, each then rings its shard over the hosts), the reducers "
            "L x S when every rank talks to them on its own (flat) and S when the host reduces first "
            "(hierarchical). `ideal / gloo` is the ratio of those bytes; a series is marked hierarchical "
            "when its ranks reported that they reduced inside the host first.")]
    for (profile, n), pts in allreduce_points(rows).items():
        hosts = placement(pts[0].row)[0]
        cpu = [r.cpu_pct for r in results if r.cpu_pct is not None]
        out += ["", f"### {hosts} hosts x {n // hosts} ranks = {n} ranks, {hosts} reducer hosts "
                    f"({profile} links at {format_rate(pts[0].rate_bps)})", "",
                f"{n + hosts} processes on {os.cpu_count()} cores"
                + (f"; the ranks and reducers used {max(cpu)}% of all cores over the run (start-up included)"
                   if cpu else "") + ".", "", allreduce_table(pts)]
    return out + _figure(info, "multirank", "all-reduce algbw with several ranks per host against the bounds")


def _ddp_body(info: RunInfo, results: Sequence[StepResult]) -> list[str]:
    return _prose_and_table(info, "ddp", (
             "`examples/train_lm.py` under DDP, the same script for every backend. Cost per step = hosts x "
             "seconds per step, reducer hosts counted as full hosts (on a real cluster they are cheaper CPU "
             "machines). `comm-bound steps/s`: the steps/s if a step were only its gradient all-reduce at link "
             "goodput (ring: 2(N-1)/N x gradient bytes per worker, reducers: 1x)."),
        ddp_table(ddp_points(section_data(results))), "DDP steps/s and cost per step")
