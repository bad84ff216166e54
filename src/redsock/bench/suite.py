"""The suite ``redsock reproduce`` runs, and the results it stores: steps, presets and the loader.

Which benchmark commands a run consists of (:func:`make_plan`), which file each writes and
which series each algorithm of it stands for, and how a stored file reads back
(:func:`load_data`, :func:`stored_step`).  The report (:mod:`redsock.reproduce`) and the
model's comparison with the lab (``redsock plan --lab``) both read stored results through it.
"""

from __future__ import annotations

import functools
import json
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import results as report
from ..config import parse_size
from ..errors import ConfigError
from ..testbed.netns import parse_rate
from .bounds import GOODPUT_FACTOR

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

PERFLOW_CAVEAT = (
    "Caveat: the testbed picks a path class by *source* port only (u32 on sport). Data sent by the "
    "accepting side of a connection leaves from the listening port on every stream, so all its streams "
    "share one class and a ring is as slow as the class that port hashes to; real ECMP hashes both ports. "
    "These figures therefore show where the listening ports landed, not Fast Socket's gain (section 1 "
    "measures that). Opt in with `--only perflow`.")
#: Kinds of file this command writes under ``<out>/results/`` (cleared at the start of a run).


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
        argv: tuple[str, ...] = (
            "bench", "transport", "--testbed", "perflow", "--rates", s.transport_rates, "--sizes", s.transport_sizes,
            "--impl", "redsock,plain", "--nsocks", str(s.nsocks), "--iters", str(s.transport_iters),
            "--reps", str(s.transport_reps), "--prefix", prefix)
        if s.transport_extra_nsocks:
            argv += ("--extra-nsocks", s.transport_extra_nsocks)
        big: float = max(parse_size(x) for x in s.transport_sizes.split(","))
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


def tag_rows(rows: Iterable[report.Row], step: Step) -> list[report.Row]:
    """Rows with ``extra.series`` set from the step (the same algo means different runs)."""
    out = []
    for r in rows:
        series = step.series.get(r.algo, r.algo)
        out.append(replace(r, extra={**r.extra, "series": series, "step": step.key}))
    return out


DDP_KEYS = ("algo", "backend", "workers", "servers", "rate_bps", "steps", "time_s", "steps_per_s",
            "final_loss", "grad_bytes", "hosts", "host_s_per_step")


def check_ddp(objs: Sequence[dict[str, Any]]) -> None:
    """Raise :class:`ConfigError` unless every object has the agreed keys."""
    for i, o in enumerate(objs):
        missing = [k for k in DDP_KEYS if k not in o]
        if missing:
            raise ConfigError(f"DDP result {i + 1} lacks {', '.join(missing)}")


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


#: Settings whose plan names every file a run of any mode may write (every N up to 100).
_EVERY_STEP = Settings(mode="lab", sections=("allreduce", "latency", "multirank"), workers=tuple(range(2, 101)))


def stored_step(path: Path) -> Step | None:
    """The all-reduce step of a run that wrote ``path`` (by its name), None for another file."""
    return _every_step().get(path.stem)


@functools.cache
def _every_step() -> dict[str, Step]:
    return {s.key: s for s in make_plan(_EVERY_STEP, Path("results"), "lab")}
