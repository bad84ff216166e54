"""``redsock reproduce [--quick]``: the seed's headline claims, measured in one command.

Runs the existing testbed benchmarks one after another, each as its own process
(``python -m redsock bench ... --json FILE``) with a deadline, and writes
``<out>/results.md`` with every figure next to its theoretical bound, PNG plots
and each benchmark's raw JSON and output under ``<out>/results/`` (that folder is
rewritten by every run).  The claims and where they are measured:

1. Fast Socket under per-flow imbalance (``bench transport --testbed perflow``):
   dynamic slicing against a static even split and one socket, across sizes;
   bound: the path classes' summed rate x goodput factor.
2. All-reduce algbw/busbw against message size (``bench allreduce --testbed``) for
   gloo, redsock ring over one socket (``REDSOCK_NSOCKS=1``), ring over Fast Socket
   and the reducers, at several N; bounds: link goodput / (2(N-1)/N) for a ring,
   link goodput for reducers; reducers/gloo next to the ideal 2(N-1)/N.
3. Small-message latency against N: ring O(N) steps, reducers 2 hops whatever N.
4. DDP training steps/s and host-seconds per step (``bench ddp --testbed``),
   counting reducer hosts.
5. Several ranks per host (``bench allreduce --testbed --ranks-per-host 2``): gloo's
   flat ring, redsock's ring and the reducers, each against the bytes its scheme puts
   through a host's link (``testbed_launch.host_nic_factor``).

An all-reduce on per-flow links (``--only perflow``) is opt-in: the testbed classifies
by source port only, see :data:`PERFLOW_CAVEAT`.

Sub-benchmarks that fail (or do not exist) still get their section, saying what
went wrong; the command then exits non-zero.  The pure parts (bounds, ratios,
tables) take parsed rows and return text, so they are tested without a testbed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..config import parse_size
from ..errors import ConfigError, RedsockError
from ..testbed.netns import format_rate, parse_rate
from . import report
from .testbed_launch import CPU_SHARE_RE, GOODPUT_FACTOR, host_nic_factor, tail
from .procs import no_interrupts, stop_processes, terminate_as_interrupt

__all__ = [
    "GOODPUT_FACTOR", "PLANS", "SECTIONS", "Settings", "Step", "StepResult", "add_arguments",
    "allreduce_points", "allreduce_table", "ddp_points", "ddp_table", "latency_table", "make_plan",
    "render_markdown", "run", "transport_points", "transport_table",
]

SECTIONS = ("transport", "allreduce", "latency", "perflow", "ddp", "multirank")
#: Series of the all-reduce figures, in display order, with their labels.
SERIES_LABELS = {
    "gloo": "gloo",
    "ring1": "redsock ring, 1 socket",
    "ring": "redsock ring, Fast Socket",
    "server": "redsock reducers",
    "auto": "redsock auto (small-message algorithm)",
    "gloo2": "gloo (run without reducers)",
    "auto-servers": "redsock auto, reducers set",
    "auto-ring": "redsock auto, no reducers",
}
#: The algorithm between hosts of a hierarchical series, in words.
_INTER = {"server": "reducers", "ring": "ring", "small": "recursive doubling", "none": "nothing"}
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_RESULTS = "results"
#: Why the per-flow all-reduce is opt-in.
PERFLOW_CAVEAT = (
    "Caveat: the testbed picks a path class by *source* port only (u32 on sport). Data sent by the "
    "accepting side of a connection leaves from the listening port on every stream, so all its streams "
    "share one class and a ring is as slow as the class that port hashes to; real ECMP hashes both ports. "
    "These figures therefore show where the listening ports landed, not Fast Socket's gain (section 1 "
    "measures that). Opt in with `--only perflow`.")
#: Kinds of file this command writes under ``<out>/results/`` (cleared at the start of a run).
_OWN_SUFFIXES = (".jsonl", ".png", ".log", ".err")


# ----------------------------------------------------------------------------- settings and plan

@dataclass(frozen=True)
class Settings:
    """What one run measures; :data:`PLANS` holds the full, quick and smoke (test) presets."""

    mode: str
    #: "perflow" is opt-in (``--only``): see :data:`PERFLOW_CAVEAT`
    sections: tuple[str, ...] = ("transport", "allreduce", "latency", "ddp", "multirank")
    workers: tuple[int, ...] = (2, 4, 8)  #: N for the all-reduce and latency sweeps (reducers = N)
    rate: str = "1gbit"  #: link rate of the all-reduce, latency and DDP clusters
    nsocks: int = 4  #: Fast Socket data streams (REDSOCK_NSOCKS) of the "Fast Socket" series
    tcp_cc: str = "reno"
    transport_sizes: str = "64K,1M,16M,256M"
    transport_rates: str = "800mbit,600mbit,400mbit,200mbit"
    transport_iters: int = 4
    transport_reps: int = 3
    transport_extra_nsocks: str = "8"
    ar_sizes: tuple[str, str, int] = ("64K", "64M", 4)  #: -b, -e, -f
    ar_iters: tuple[int, int] = (20, 5)  #: -n, -w (the benchmark caps both for sizes >= 64 MiB)
    lat_sizes: tuple[str, str, int] = ("8", "4K", 8)
    lat_iters: tuple[int, int] = (100, 20)
    perflow_workers: int = 4
    perflow_sizes: tuple[str, str, int] = ("4M", "64M", 4)
    perflow_iters: tuple[int, int] = (5, 2)
    ddp_workers: tuple[int, ...] = (4, 8)  #: reducers = workers
    ddp_steps: tuple[int, int] = (30, 5)  #: --steps, --warmup
    ddp_repeats: int = 2  #: rounds over the algorithms (median), where the benchmark offers --repeats
    #: several ranks per host: hosts (reducers = hosts), ranks per host, link rate (low enough that
    #: the 3H processes on this machine's cores stay link-bound: on 2026-12-01, while the
    #: hierarchical reducers' rows were timed, 300 Mbit/s kept the machine 77-92% busy, 200 Mbit/s
    #: 77-81%, 150 Mbit/s 56-66%), sizes, -n / -w
    multirank_hosts: int = 4
    ranks_per_host: int = 2
    multirank_rate: str = "150mbit"
    multirank_sizes: tuple[str, str, int] = ("32M", "64M", 2)
    multirank_iters: tuple[int, int] = (5, 2)
    timeout_scale: float = 1.0  #: every step's deadline is multiplied by this

    def validate(self) -> Settings:
        """Raise :class:`ConfigError` for values the benchmarks would refuse later."""
        bad = [s for s in self.sections if s not in SECTIONS]
        if bad or not self.sections:
            raise ConfigError(f"unknown section(s) {', '.join(bad) or '(none)'}; choose from {', '.join(SECTIONS)}")
        for n in (*self.workers, *self.ddp_workers, self.perflow_workers, self.multirank_hosts):
            if not 2 <= n <= 100:
                raise ConfigError(f"worker counts must be 2..100, got {n}")
        if self.ranks_per_host < 1:
            raise ConfigError(f"ranks per host must be >= 1, got {self.ranks_per_host}")
        parse_rate(self.multirank_rate)
        if not self.workers:
            raise ConfigError("need at least one worker count")
        parse_rate(self.rate)
        for r in self.transport_rates.split(","):
            parse_rate(r)
        if not 1 <= self.nsocks <= 16:
            raise ConfigError(f"nsocks must be 1..16, got {self.nsocks}")
        if self.timeout_scale <= 0:
            raise ConfigError("timeout scale must be > 0")
        return self


PLANS: dict[str, Settings] = {
    # About 12 minutes on 2 cores (measured: 12.4; N=8 with 8 reducers is CPU-bound there).
    "full": Settings(mode="full"),
    # Under 5 minutes on 2 cores: fewer sizes and N, short DDP.
    "quick": Settings(
        mode="quick", workers=(2, 4),
        transport_sizes="1M,16M,64M", transport_iters=2, transport_reps=2, transport_extra_nsocks="",
        ar_sizes=("1M", "64M", 4), ar_iters=(5, 2), lat_sizes=("8", "1K", 128), lat_iters=(30, 10),
        ddp_workers=(4,), ddp_steps=(10, 3), ddp_repeats=1,
        multirank_sizes=("32M", "32M", 2), multirank_iters=(3, 1)),
    # The end-to-end test: one N, one or two sizes, seconds per step.
    "smoke": Settings(
        mode="smoke", sections=("transport", "allreduce", "latency"), workers=(2,),
        transport_sizes="1M", transport_iters=2, transport_reps=1, transport_extra_nsocks="",
        ar_sizes=("1M", "2M", 2), ar_iters=(3, 1), lat_sizes=("8", "8", 2), lat_iters=(10, 3),
        ddp_workers=(2,), ddp_steps=(4, 1), ddp_repeats=1),
}


@dataclass(frozen=True)
class Step:
    """One sub-benchmark: ``python -m redsock <argv>`` with ``env`` on top of ours."""

    key: str  #: file stem under results/ ("allreduce-n4")
    section: str  #: one of SECTIONS
    title: str
    argv: tuple[str, ...]
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict, hash=False)
    world: int = 0
    profile: str = "uniform"
    #: algo in the rows -> series key (SERIES_LABELS); the same algo means different things per run
    series: dict[str, str] = field(default_factory=dict, hash=False)

    @property
    def json_name(self) -> str:
        return f"{self.key}.jsonl"

    def command(self, python: str = "python") -> str:
        """The command line as a user would type it (environment first)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join([python, "-m", "redsock", *self.argv])


def make_plan(s: Settings, results_dir: Path, prefix: str) -> list[Step]:
    """The steps of a run, in order; every step writes ``results_dir/<key>.jsonl``."""
    scale = s.timeout_scale
    steps: list[Step] = []

    def js(key: str) -> str:
        return str(results_dir / f"{key}.jsonl")

    def allreduce(key: str, section: str, title: str, n: int, servers: int, algos: str,
                  sizes: tuple[str, str, int], iters: tuple[int, int], nsocks: int, timeout: float,
                  series: dict[str, str], profile: str = "uniform", ranks_per_host: int = 1,
                  rate: str | None = None) -> Step:
        tool_timeout = max(30.0, timeout * scale - 30)  # the tool tears down before we kill it
        per_host = ("--ranks-per-host", str(ranks_per_host)) if ranks_per_host > 1 else ()
        argv = ("bench", "allreduce", "--testbed", "--workers", str(n), *per_host, "--servers", str(servers),
                "--rate", rate or s.rate, "--profile", profile, "--tcp-cc", s.tcp_cc, "--prefix", prefix,
                "--algo", algos, "-b", sizes[0], "-e", sizes[1], "-f", str(sizes[2]),
                "-n", str(iters[0]), "-w", str(iters[1]), "--timeout", f"{tool_timeout:.0f}",
                "--json", js(key))
        return Step(key, section, title, argv, timeout * scale, {"REDSOCK_NSOCKS": str(nsocks)},
                    n * ranks_per_host, profile, series)

    if "transport" in s.sections:
        argv = ["bench", "transport", "--testbed", "perflow", "--rates", s.transport_rates,
                "--sizes", s.transport_sizes, "--impl", "redsock,plain", "--nsocks", str(s.nsocks),
                "--iters", str(s.transport_iters), "--reps", str(s.transport_reps), "--prefix", prefix]
        if s.transport_extra_nsocks:
            argv += ["--extra-nsocks", s.transport_extra_nsocks]
        big = max(parse_size(x) for x in s.transport_sizes.split(","))
        # ~0.04 s per MiB sent per configuration (the static split is the slowest, ~0.8 Gbit/s).
        timeout = 120 + 0.15 * s.transport_iters * s.transport_reps * big / (1 << 20)
        steps.append(Step("transport", "transport", "Fast Socket under per-flow imbalance",
                          (*argv, "--json", js("transport")), timeout * scale))
    for n in s.workers:
        big = parse_size(s.ar_sizes[1]) / (1 << 20)
        if "allreduce" in s.sections:
            steps.append(allreduce(
                f"allreduce-n{n}", "allreduce", f"all-reduce, {n} workers + {n} reducers", n, n,
                "gloo,ring,server", s.ar_sizes, s.ar_iters, s.nsocks, 90 + 1.2 * n * big,
                {"gloo": "gloo", "ring": "ring", "server": "server"}))
            steps.append(allreduce(
                f"ring1-n{n}", "allreduce", f"all-reduce, {n} workers, ring over 1 socket", n, 0,
                "ring", s.ar_sizes, s.ar_iters, 1, 60 + 0.5 * n * big, {"ring": "ring1"}))
        if "latency" in s.sections:
            steps.append(allreduce(
                f"latency-n{n}", "latency", f"small-message latency, {n} workers + {n} reducers", n, n,
                "ring,auto,server,gloo", s.lat_sizes, s.lat_iters, s.nsocks, 60 + 15 * n,
                {"ring": "ring", "auto": "auto", "server": "server", "gloo": "gloo"}))
    if "perflow" in s.sections:
        n = s.perflow_workers
        big = parse_size(s.perflow_sizes[1]) / (1 << 20)
        steps.append(allreduce(
            f"perflow-n{n}", "perflow", f"all-reduce under per-flow imbalance, {n} workers", n, 0,
            "gloo,ring", s.perflow_sizes, s.perflow_iters, s.nsocks, 90 + 1.5 * n * big,
            {"gloo": "gloo", "ring": "ring"}, profile="perflow"))
        steps.append(allreduce(
            f"perflow-ring1-n{n}", "perflow", f"all-reduce under per-flow imbalance, {n} workers, "
            "ring over 1 socket", n, 0, "ring", s.perflow_sizes, s.perflow_iters, 1, 90 + 3 * n * big,
            {"ring": "ring1"}, profile="perflow"))
    if "multirank" in s.sections:
        h, per = s.multirank_hosts, s.ranks_per_host
        # Seconds per MiB of the largest size at this rate, x the bytes per host link of the three
        # series (at most 2 x S each), x iterations plus warm-up, x 2 for two slow cores, plus start-up.
        mib_s = 8 * (1 << 20) / (parse_rate(s.multirank_rate) * GOODPUT_FACTOR)
        big = parse_size(s.multirank_sizes[1]) / (1 << 20)
        timeout = 120 + 3 * 2 * mib_s * big * (sum(s.multirank_iters) + 1) * 2
        # What a user gets: redsock's default choice (auto) with reducers set and without, each run
        # next to gloo and to the same algorithm with every rank on the network on its own.
        steps.append(allreduce(
            f"multirank-h{h}x{per}", "multirank", f"all-reduce, {h} hosts x {per} ranks + {h} reducers", h, h,
            "gloo,auto,server", s.multirank_sizes, s.multirank_iters, s.nsocks, timeout,
            {"gloo": "gloo", "auto": "auto-servers", "server": "server"}, ranks_per_host=per, rate=s.multirank_rate))
        steps.append(allreduce(
            f"multirank-ring-h{h}x{per}", "multirank", f"all-reduce, {h} hosts x {per} ranks, no reducers", h, 0,
            "gloo,auto,ring", s.multirank_sizes, s.multirank_iters, s.nsocks, timeout,
            {"gloo": "gloo2", "auto": "auto-ring", "ring": "ring"}, ranks_per_host=per, rate=s.multirank_rate))
    if "ddp" in s.sections:
        for n in s.ddp_workers:
            steps_, warm = s.ddp_steps
            timeout = 120 + 4 * n * steps_ * s.ddp_repeats
            argv = ("bench", "ddp", "--testbed", "--workers", str(n), "--servers", str(n), "--rate", s.rate,
                    "--algos", "gloo,ring,server", "--steps", str(steps_), "--warmup", str(warm),
                    "--repeats", str(s.ddp_repeats), "--tcp-cc", s.tcp_cc, "--prefix", prefix,
                    "--timeout", f"{max(30.0, timeout * scale - 30):.0f}", "--json", js(f"ddp-n{n}"))
            steps.append(Step(f"ddp-n{n}", "ddp", f"DDP training, {n} workers + {n} reducers", argv,
                              timeout * scale, {"REDSOCK_NSOCKS": str(s.nsocks)}, n))
    return steps


# ----------------------------------------------------------------------------- bounds (pure)

def link_goodput_GBps(rate_bps: float, factor: float = GOODPUT_FACTOR) -> float:
    """Payload GB/s one shaped link direction carries."""
    return rate_bps * factor / 8 / 1e9


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


def _r(x: float | None, fmt: str = "{:.2f}x") -> str:
    return "-" if x is None else fmt.format(x)


def transport_table(points: Sequence[TransportPoint]) -> str:
    """Markdown: throughput against the classes' goodput, and the Fast Socket ratios."""
    lines = [("| size | configuration | classes hit | Gbit/s | bound Gbit/s | / bound | dynamic / static | "
              "dynamic / one socket |"),
             "|---:|:---|:---:|---:|---:|---:|---:|---:|"]
    for p in points:
        lines.append(f"| {report.human_size(p.bytes)} | {p.label} | {','.join(map(str, p.classes_hit)) or '-'} "
                     f"| {p.gbps:.3f} | {p.bound_gbps:.3f} | {100 * p.of_bound:.1f}% "
                     f"| {_r(p.over_static)} | {_r(p.over_one_socket)} |")
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


def tag_rows(rows: Iterable[report.Row], step: Step) -> list[report.Row]:
    """Rows with ``extra.series`` set from the step (the same algo means different runs)."""
    out = []
    for r in rows:
        series = step.series.get(r.algo, r.algo)
        out.append(replace(r, extra={**r.extra, "series": series, "step": step.key}))
    return out


def _testbed_meta(r: report.Row) -> tuple[float, float, str]:
    tb = r.extra.get("testbed", {})
    if "rate_bps" not in tb:
        raise ConfigError(f"all-reduce row without extra.testbed.rate_bps ({r.label}, {r.bytes} B)")
    return float(tb["rate_bps"]), float(tb.get("goodput_factor", GOODPUT_FACTOR)), tb.get("profile", "uniform")


def _placement(r: report.Row) -> tuple[int, str, str]:
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
            hosts, scheme, inter = _placement(r)
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


def _us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.0f}" if us >= 1000 else f"{us:.1f}"


def allreduce_table(points: Sequence[ArPoint]) -> str:
    """Markdown for one (profile, N): algbw and busbw, the bound and the ratios."""
    lines = [("| size | series | time (µs) | algbw (GB/s) | busbw (GB/s) | bound algbw (GB/s) | algbw / bound "
              "| / gloo | ideal / gloo | Fast Socket / 1 socket | machine busy |"),
             "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        r = p.row
        lines.append(f"| {report.human_size(r.bytes)} | {p.label} | {_us(r.median_s)} "
                     f"| {r.algbw_GBps:.4f} | {r.busbw_GBps:.4f} | {_r(p.bound_GBps, '{:.4f}')} "
                     f"| {_r(None if p.of_bound is None else 100 * p.of_bound, '{:.1f}%')} "
                     f"| {_r(p.over_gloo)} | {_r(p.ideal_over_gloo)} | {_r(p.over_one_socket)} "
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
        cells = [_us(by[n].median_s) if n in by else "-" for n in ns]
        line = f"| {report.human_size(size)} | {SERIES_LABELS.get(series, series)} | " + " | ".join(cells) + " |"
        if grow:
            growth = by[hi].median_s / by[lo].median_s if lo in by and hi in by else None
            line += f" {_r(growth)} | {_r(latency_growth_model(series, lo, hi))} |"
        lines.append(line)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- DDP (pure)

DDP_KEYS = ("algo", "backend", "workers", "servers", "rate_bps", "steps", "time_s", "steps_per_s",
            "final_loss", "grad_bytes", "hosts", "host_s_per_step")


def check_ddp(objs: Sequence[dict[str, Any]]) -> None:
    """Raise :class:`ConfigError` unless every object has the agreed keys."""
    for i, o in enumerate(objs):
        missing = [k for k in DDP_KEYS if k not in o]
        if missing:
            raise ConfigError(f"DDP result {i + 1} lacks {', '.join(missing)}")


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
            f"| {_r(p['over_gloo'])} | {_r(p['ideal_over_gloo'])} "
            f"| {_r(p['comm_bound_steps_per_s'], '{:.3f}')} | {_r(p['of_bound'], '{:.0%}')} | {p['hosts']} "
            f"| {p['host_s_per_step']:.3f} | {_r(p['cost_over_gloo'])} | {p['final_loss']:.4f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- results and report

@dataclass
class StepResult:
    """What became of one step. ``status``: ok, failed, timeout, interrupted, not run."""

    step: Step
    status: str
    rc: int | None = None
    wall_s: float = 0.0
    error: str = ""  #: why it failed, with the stderr tail
    data: list[Any] = field(default_factory=list)  #: Rows (all-reduce) or dicts (transport, DDP)
    cpu_pct: int | None = None  #: CPU its processes used, % of all cores (the benchmark's own figure)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


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


def _data(results: Sequence[StepResult], *sections: str) -> list[Any]:
    """The raw rows of ``results`` (only those of ``sections``, when given), in step order."""
    return [x for r in results if not sections or r.step.section in sections for x in r.data]


def headline(results: Sequence[StepResult]) -> list[tuple[str, str, str]]:
    """(claim, measured here, bound or ideal) for the summary table; failed steps listed last."""
    out: list[tuple[str, str, str]] = []
    for sections, part in ((("transport",), _headline_transport), (("allreduce", "perflow"), _headline_allreduce),
                           (("latency",), _headline_latency), (("ddp",), _headline_ddp),
                           (("multirank",), _headline_multirank)):
        rows = _data(results, *sections)
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
                     f"{_r(p.over_one_socket)} one socket, {_r(p.over_static)} static split"),
                    f"{p.bound_gbps:.2f} Gbit/s (classes' goodput)"))
    return out


def _headline_allreduce(rows: list[Any]) -> list[tuple[str, str, str]]:
    out = []
    for (profile, n), pts in allreduce_points(rows).items():
        top = max(p.row.bytes for p in pts)
        big = {p.series: p for p in pts if p.row.bytes == top}
        where = f"N={n}, {report.human_size(top)}" + (", per-flow links" if profile == "perflow" else "")
        ring = big.get("ring")
        if ring and ring.over_one_socket is not None:
            out.append((f"Fast Socket ring vs 1 socket ({where})",
                        f"{_r(ring.over_one_socket)}; ring at {report.percent(ring.of_bound)} of its bound",
                        "1.00x on uniform links (one flow fills a link)" if profile == "uniform"
                        else "sum of the classes hit / the slowest class"))
        srv = big.get("server")
        if srv:
            out.append((f"Reducers vs gloo algbw ({where})",
                        f"{_r(srv.over_gloo)}; reducers at {report.percent(srv.of_bound)} of link goodput",
                        f"ideal {_r(srv.ideal_over_gloo)} = 2(N-1)/N"))
    return out


def _headline_multirank(rows: list[Any]) -> list[tuple[str, str, str]]:
    out = []
    for (_, n), pts in allreduce_points(rows).items():
        top = max(p.row.bytes for p in pts)
        hosts = _placement(pts[0].row)[0]
        where = f"{hosts} hosts x {n // hosts} ranks, {report.human_size(top)}"
        for p in pts:
            if p.row.bytes == top and not p.series.startswith("gloo"):
                mine = host_nic_factor(p.inter, n, hosts, p.scheme)
                out.append((f"{p.label} vs gloo's flat ring ({where})",
                            f"{_r(p.over_gloo)}; at {report.percent(p.of_bound)} of its bound",
                            f"ideal {_r(p.ideal_over_gloo)} (bytes per host link: gloo "
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
            times = ", ".join(f"N={n}: {_us(by[n].median_s)} µs" for n in ns if n in by)
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
                        (f"{_r(p['over_gloo'])} steps/s; cost per step {_r(p['cost_over_gloo'])} gloo's "
                         f"({p['hosts']} hosts)"), f"ideal {_r(p['ideal_over_gloo'])} if communication-bound"))
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
         f"[`{_RESULTS}/`]({_RESULTS}/)."),
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

    lines += ["", "## 1. Fast Socket under per-flow imbalance", ""]
    lines += _section_body(info, results, "transport", _transport_body)
    lines += ["", "## 2. All-reduce bandwidth against message size", ""]
    lines += _section_body(info, results, "allreduce", _allreduce_body)
    lines += ["", "## 2b. All-reduce under per-flow imbalance", ""]
    lines += _section_body(info, results, "perflow", _perflow_body)
    lines += ["", "## 3. Small-message latency against N", ""]
    lines += _section_body(info, results, "latency", _latency_body)
    lines += ["", "## 4. DDP training: steps/s and cost per step", ""]
    lines += _section_body(info, results, "ddp", _ddp_body)
    lines += ["", "## 5. Several ranks per host", ""]
    lines += _section_body(info, results, "multirank", _multirank_body)

    lines += ["", "## Commands run", "",
              "| step | status | exit | wall (s) | CPU of ranks + reducers (% of all cores) |",
              "|:---|:---|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.step.key} | {r.status} | {'-' if r.rc is None else r.rc} | {r.wall_s:.0f} "
                     f"| {'-' if r.cpu_pct is None else f'{r.cpu_pct}%'} |")
    lines += ["", "```bash"] + [r.step.command() for r in results if r.status != "not run"]
    lines += ["```"]
    if results_dir is not None:
        from ..plan import DEFAULT, lab  # the plan reads this module's steps

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
    return ["", f"![{alt}]({_RESULTS}/{name})"] if name else []


def _transport_body(info: RunInfo, results: Sequence[StepResult]) -> list[str]:
    rows = _data(results)
    pts = transport_points(rows)
    rates = ", ".join(format_rate(x) for x in rows[0]["extra"]["rates"])
    return [(f"Two namespaces, one link whose egress has path classes of {rates} picked by source-port bits "
             "(ECMP-like: a flow on a slow path is slow although the link is not full). Fast Socket spreads "
             "slices over its streams by each stream's progress; the static split gives every stream one equal "
             "piece (NCCL's socket transport); one socket is put on the fastest class, its best case. "
             f"Bound: the sum of all class rates x {GOODPUT_FACTOR} (tc counts frame headers)."),
            "", transport_table(pts), *_figure(info, "transport", "transport throughput against the bound")]


def _allreduce_body(info: RunInfo, results: Sequence[StepResult], note: str = "") -> list[str]:
    rows = _data(results)
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


def _latency_body(info: RunInfo, results: Sequence[StepResult]) -> list[str]:
    rows = _data(results)
    return [("Median time of one all-reduce (float32 sum) against N. A latency-bound ring takes 2(N-1) steps, "
             "recursive doubling (`auto` below 64 KiB) log2 N, the reducers 2 hops whatever N. "
             "`model` is the growth from the smallest to the largest N such an algorithm would show. All "
             "ranks share this machine's cores, so CPU contention grows with N too."),
            "", latency_table(rows), *_figure(info, "latency", "latency against N")]


def _perflow_body(info: RunInfo, results: Sequence[StepResult]) -> list[str]:
    return _allreduce_body(info, results, note=(
        "Ring all-reduce on `perflow` links: each link split into path classes of rate x (1, .75, .5, .25) "
        "picked by source-port bits. A connection of one socket (gloo's, or redsock with "
        "REDSOCK_NSOCKS=1) lands on one random class; Fast Socket's streams land on several. Landings "
        "are random per run, so ratios vary between runs. " + PERFLOW_CAVEAT))


def _multirank_body(info: RunInfo, results: Sequence[StepResult]) -> list[str]:
    rows = _data(results)
    out = [("Real nodes run several ranks (one per GPU). Here every worker host runs L consecutive ranks, "
            "as torchrun numbers them, N = H x L in all, and every figure is bounded by the bytes one host's "
            "link carries each way per byte of buffer S: gloo's flat ring 2S(N-1)/N (of the ring's edges only "
            "the one leaving a host crosses its link), redsock's hierarchical ring 2S(H-1)/H (the ranks of a "
            "host reduce among themselves first, each then rings its shard over the hosts), the reducers "
            "L x S when every rank talks to them on its own (flat) and S when the host reduces first "
            "(hierarchical). `ideal / gloo` is the ratio of those bytes; a series is marked hierarchical "
            "when its ranks reported that they reduced inside the host first.")]
    for (profile, n), pts in allreduce_points(rows).items():
        hosts = _placement(pts[0].row)[0]
        cpu = [r.cpu_pct for r in results if r.cpu_pct is not None]
        out += ["", f"### {hosts} hosts x {n // hosts} ranks = {n} ranks, {hosts} reducer hosts "
                    f"({profile} links at {format_rate(pts[0].rate_bps)})", "",
                f"{n + hosts} processes on {os.cpu_count()} cores"
                + (f"; the ranks and reducers used {max(cpu)}% of all cores over the run (start-up included)"
                   if cpu else "") + ".", "", allreduce_table(pts)]
    return out + _figure(info, "multirank", "all-reduce algbw with several ranks per host against the bounds")


def _ddp_body(info: RunInfo, results: Sequence[StepResult]) -> list[str]:
    rows = _data(results)
    return [("`examples/train_lm.py` under DDP, the same script for every backend. Cost per step = hosts x "
             "seconds per step, reducer hosts counted as full hosts (on a real cluster they are cheaper CPU "
             "machines). `comm-bound steps/s`: the steps/s if a step were only its gradient all-reduce at link "
             "goodput (ring: 2(N-1)/N x gradient bytes per worker, reducers: 1x)."),
            "", ddp_table(ddp_points(rows)), *_figure(info, "ddp", "DDP steps/s and cost per step")]


# ----------------------------------------------------------------------------- figures

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
            if model and all(x is not None for x in model):
                ax.plot(ns, [by[ns[0]].median_s * 1e6 * x for x in model], ls=":", color=line.get_color())
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
        _data(results, sec) for sec in ("transport", "allreduce", "latency", "perflow", "ddp", "multirank"))
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


# ----------------------------------------------------------------------------- machine

def machine_info() -> dict[str, str]:
    """What the figures depend on: CPU, cores, memory, kernel, versions, the source revision."""
    from importlib import metadata

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    cpu = platform.processor() or "?"
    mem = "?"
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
        kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal:"))
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    try:
        cc = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        cc = "?"
    from .. import __version__

    return {
        "CPU": cpu, "cores": str(os.cpu_count()), "memory": mem,
        "kernel": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(), "torch": version("torch"), "numpy": version("numpy"),
        "redsock": f"{__version__} ({_git_revision()})",
        "TCP congestion control (default)": cc,
    }


def _git_revision() -> str:
    root = Path(__file__).resolve().parents[3]
    if not (root / ".git").exists():
        return "not a git checkout"
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "git unavailable"
    return f"git {head or '?'}{' + uncommitted changes' if dirty else ''}"


# ----------------------------------------------------------------------------- running

def _child_env(extra: dict[str, str]) -> dict[str, str]:
    # REDSOCK_ALGO / REDSOCK_SERVERS would change what a series means; the testbed sets servers itself.
    env = {k: v for k, v in os.environ.items() if k not in ("REDSOCK_ALGO", "REDSOCK_SERVERS")}
    env.update(extra)
    src = str(Path(__file__).resolve().parents[2])  # .../src: an uninstalled tree works too
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def load_data(step: Step, path: Path) -> list[Any]:
    """Parse a step's JSON Lines: tagged Rows for all-reduce steps, dicts otherwise."""
    if step.section in ("allreduce", "latency", "perflow", "multirank"):
        return tag_rows(report.read_json(path), step)
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as e:
                raise ConfigError(f"{path}:{lineno}: not JSON: {e}") from None
    if step.section == "ddp":
        check_ddp(out)
    return out


def run_step(step: Step, results_dir: Path, python: str = sys.executable) -> StepResult:
    """Run one step to completion or its deadline; never raises for the benchmark's own failures."""
    log, err = results_dir / f"{step.key}.log", results_dir / f"{step.key}.err"
    json_path = results_dir / step.json_name
    json_path.unlink(missing_ok=True)
    env = _child_env(step.env)
    t0 = time.monotonic()
    status, why = "ok", ""
    with log.open("w") as out, err.open("w") as errf:
        proc = subprocess.Popen([python, "-m", "redsock", *step.argv], stdout=out, stderr=errf, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=step.timeout_s)
        except subprocess.TimeoutExpired:
            status, why = "timeout", f"still running after {step.timeout_s:.0f} s: stopped\n"
        except KeyboardInterrupt:
            status, why = "interrupted", "interrupted\n"
        finally:
            stop_processes([proc], grace_s=30.0)  # SIGTERM: the benchmarks tear their testbed down
    wall = time.monotonic() - t0
    rc = proc.returncode
    result = StepResult(step, status, rc, wall)
    m = CPU_SHARE_RE.findall(log.read_text(errors="replace"))
    result.cpu_pct = max(map(int, m)) if m else None
    if json_path.exists() and json_path.stat().st_size:
        try:
            result.data = load_data(step, json_path)
        except (ConfigError, OSError) as e:
            status = "failed" if status == "ok" else status
            why += f"results unreadable: {e}\n"
    if status == "ok" and rc != 0:
        status = "failed"
    if status == "ok" and not result.data:
        status, why = "failed", "exit 0 but no results written\n"
    result.status = status
    if status != "ok":
        result.error = why + (tail(err) or tail(log) or "(no output)")
    if not tail(err):
        err.unlink(missing_ok=True)
    if status == "interrupted":
        raise _Interrupted(result)
    return result


class _Interrupted(Exception):
    def __init__(self, result: StepResult):
        super().__init__("interrupted")
        self.result = result


def _clear_results(results_dir: Path) -> None:
    results_dir.mkdir(parents=True, exist_ok=True)
    for p in results_dir.iterdir():
        if p.is_file() and p.suffix in _OWN_SUFFIXES:
            p.unlink()


class _Progress:
    """A rich progress bar over the steps (plain lines without a terminal or rich)."""

    def __init__(self, enabled: bool, total: int):
        self.bar = None
        self.total = total
        if enabled and sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    SpinnerColumn,
                    TextColumn,
                    TimeElapsedColumn,
                )

                self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                    MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True))
                self.bar.start()
                self.task = self.bar.add_task("reproduce", total=total)
            except ImportError:
                self.bar = None

    def start(self, i: int, step: Step) -> None:
        text = f"[{i + 1}/{self.total}] {step.title}"
        if self.bar is not None:
            self.bar.update(self.task, description=text)
        else:
            print(f"# {text} ...", file=sys.stderr, flush=True)

    def done(self, r: StepResult) -> None:
        line = f"# {r.step.key}: {r.status} ({r.wall_s:.0f} s)"
        if self.bar is not None:
            self.bar.console.print(line)
            self.bar.advance(self.task)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _cleanup(prefix: str) -> list[str]:
    from ..testbed.cluster import cleanup_prefix, list_prefix_netns

    try:
        return cleanup_prefix(prefix) if list_prefix_netns(prefix) else []
    except RedsockError:
        return []


def execute(settings: Settings, out_dir: Path, prefix: str, progress: bool = True) -> tuple[int, Path]:
    """Run every step, write the report; returns (exit status, path of results.md)."""
    results_dir = out_dir / _RESULTS
    _clear_results(results_dir)
    steps = make_plan(settings, results_dir, prefix)
    info = RunInfo(settings, machine_info(), datetime.now(timezone.utc), 0.0, sys.executable, prefix,
                   env={k: v for k, v in os.environ.items() if k.startswith("REDSOCK_")})
    results: list[StepResult] = []
    t0 = time.monotonic()
    bar = _Progress(progress, len(steps))
    interrupted = False
    with terminate_as_interrupt():  # SIGTERM too: stop the running step, keep what was measured
        try:
            for i, step in enumerate(steps):
                bar.start(i, step)
                try:
                    r = run_step(step, results_dir)
                except _Interrupted as e:
                    r, interrupted = e.result, True
                results.append(r)
                info.leftovers += _cleanup(prefix)  # a step that crashed may leave its testbed
                bar.done(r)
                if interrupted:
                    break
        except KeyboardInterrupt:
            interrupted = True
        finally:
            bar.close()
            with no_interrupts():  # a second Ctrl-C must not leave namespaces behind
                info.leftovers += _cleanup(prefix)
    results += [StepResult(s, "not run") for s in steps[len(results):]]
    info.wall_s = time.monotonic() - t0
    write_figures(info, results, results_dir)
    path = out_dir / "results.md"
    path.write_text(render_markdown(info, results, results_dir))
    bad = [r for r in results if not r.ok]
    for r in bad:
        print(f"redsock reproduce: {r.step.key}: {r.status}", file=sys.stderr)
    print(f"wrote {path} ({len(results) - len(bad)}/{len(results)} steps ok, {info.wall_s / 60:.1f} min)")
    return (130 if interrupted else 1 if bad else 0), path


# ----------------------------------------------------------------------------- the command

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes, N=2,4, short DDP: under 5 minutes on 2 cores (full: about 12)")
    p.add_argument("--out", default="docs", metavar="DIR",
                   help="write DIR/results.md and DIR/results/ (rewritten; default %(default)s)")
    p.add_argument("--only", metavar="SECTIONS",
                   help="comma-separated sections: transport, allreduce, latency, ddp, multirank (the default "
                        "set), perflow (opt-in: per-flow all-reduce, see the report's caveat)")
    p.add_argument("--workers", metavar="N,N", help="worker counts of the all-reduce and latency sweeps")
    p.add_argument("--rate", help="link rate of the all-reduce, latency and DDP clusters (default 1gbit)")
    p.add_argument("--prefix", help="testbed namespace prefix (default rsrp<pid>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--plan", choices=sorted(PLANS), help=argparse.SUPPRESS)  # "smoke": the end-to-end test


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The preset (--plan, else --quick or full) with the command line's overrides."""
    name = args.plan or ("quick" if args.quick else "full")
    s = PLANS[name]
    if args.only:
        s = replace(s, sections=tuple(x.strip() for x in args.only.split(",") if x.strip()))
    if args.workers:
        try:
            s = replace(s, workers=tuple(int(x) for x in args.workers.split(",") if x.strip()))
        except ValueError:
            raise ConfigError(f"--workers wants counts like 2,4,8, not {args.workers!r}") from None
    if args.rate:
        s = replace(s, rate=args.rate)
    return s.validate()


def run(args: argparse.Namespace) -> int:
    """``redsock reproduce``: check the options, refuse without root, run, report."""
    from ..testbed import netns as nx

    settings = settings_from_args(args)
    prefix = args.prefix or f"rsrp{os.getpid() % 100000}"
    if not _PREFIX_RE.match(prefix):
        raise ConfigError(f"bad --prefix {prefix!r}: 1-12 lowercase letters/digits starting with a letter")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is not a directory")
    nx.require_root("redsock reproduce")
    rc, _ = execute(settings, out, prefix, progress=not args.no_progress)
    return rc
