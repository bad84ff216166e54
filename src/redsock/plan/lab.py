"""The model next to the lab: every all-reduce ``redsock reproduce`` measured, predicted.

Reads reproduce's raw outputs (``docs/results/*.jsonl``), predicts each row's layout (hosts,
ranks per host, reducers, link rate and goodput as the testbed recorded them) with a profile,
and classifies each row:

* ``CPU-bound``: more processes work for the series than 4 per core (reproduce's own rule,
  counted per series: ranks, plus reducers for the reducer series), or the whole machine was
  at least :data:`BUSY_LIMIT` busy while the row was timed (``machine_busy``, recorded per row;
  for older rows the run's average, the benchmark's CPU line in its log), or the row's ranks
  alone were (``ranks_busy``).  The
  model still predicts the link-bound time there; the shortfall measures this 2-core machine,
  not the network.
* ``link-bound``: the busiest NIC accounts for at least :data:`LINK_SHARE` of the predicted
  time.  These rows are held to :data:`TOLERANCE`.
* ``latency-bound``: the rest (small messages): per-message costs on 2 shared cores.

For the reducer series the table also gives the time the reducers' CPU work alone (the
profile's per-byte cost x every contribution) needs on the lab's shared cores: where it
approaches the link-bound time, the lab cannot show the link-bound figure.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import results as report
from ..bench import suite
from ..bench.bounds import GOODPUT_FACTOR
from ..bench.procs import BUSY_LIMIT, MACHINE_BUSY_RE
from ..errors import ConfigError
from ..results import Row, human_size
from ..testbed import netns
from . import model
from .model import Cluster
from .profile import Profile

__all__ = ["BUSY_LIMIT", "LINK_SHARE", "TOLERANCE", "Check", "DdpCheck", "check_rows", "ddp_checks", "ddp_markdown",
           "load_lab", "markdown", "summary"]

TOLERANCE = 0.15
LINK_SHARE = 0.9
PROCS_PER_CORE = 4  #: reproduce flags a step CPU-bound above 4 processes per core
#: reproduce's series -> the model's algorithm
SERIES_ALGO = {"gloo": "gloo", "ring": "ring", "ring1": "ring", "server": "reducers", "auto": "rd",
               "gloo2": "gloo", "auto-servers": "reducers", "auto-ring": "ring"}
#: a row's recorded inter-host algorithm -> the model's
ROUTE_ALGO = {"ring": "ring", "server": "reducers", "small": "rd"}
#: With several ranks per host, redsock's algorithms run hierarchically (DESIGN.md section 7).
HIERARCHICAL = {"ring": "hring", "reducers": "hreducers"}


@dataclass(frozen=True)
class Check:
    row: Row
    series: str
    cluster: Cluster
    prediction: model.Prediction
    kind: str  #: "link-bound", "CPU-bound" or "latency-bound"
    #: reducer series: seconds the reducers' CPU work (profile's per-byte cost) takes on the
    #: lab's shared cores alone, for comparison with the link-bound prediction (0 otherwise)
    shared_cpu_s: float = 0.0

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return self.prediction.seconds / self.row.median_s - 1

    @property
    def ok(self) -> bool | None:
        """Within :data:`TOLERANCE` where link-bound; None (not judged) elsewhere."""
        return abs(self.error) <= TOLERANCE if self.kind == "link-bound" else None


def load_lab(results_dir: str | Path) -> list[Row]:
    """Every all-reduce row of a reproduce run, tagged with its series (reproduce's own parser)."""
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise ConfigError(f"{results_dir} is not a directory of reproduce results")
    rows: list[Row] = []
    for path in sorted(results_dir.glob("*.jsonl")):
        busy = _machine_busy(path)
        # A row's own reading (taken while it was timed) is closer than its run's average.
        rows += [r if busy is None else dataclasses.replace(r, extra={"machine_busy": busy, **r.extra})
                 for r in _load_rows(path, suite.stored_step(path))]  # reproduce's steps say the series
    if not rows:
        raise ConfigError(f"no all-reduce results (allreduce-n*.jsonl, ...) in {results_dir}")
    return rows


def _machine_busy(jsonl: Path) -> float | None:
    """How busy the machine was over the run that wrote ``jsonl`` (its log beside it), 0..1."""
    log = jsonl.with_suffix(".log")
    found = MACHINE_BUSY_RE.findall(log.read_text(errors="replace")) if log.is_file() else []
    return max(map(int, found)) / 100 if found else None


def _load_rows(path: Path, step: suite.Step | None) -> list[Row]:
    """The all-reduce rows of one file: a reproduce step's, or another benchmark's."""
    if step is not None:
        return suite.load_data(step, path) if step.section in ("allreduce", "latency", "multirank") else []
    # Another benchmark's rows (e.g. several ranks per host): all-reduce rows with a testbed
    # layout count, their algo naming the series.
    try:
        found = report.read_json(path)
    except (ConfigError, KeyError, TypeError, ValueError):
        return []  # not all-reduce rows (transport, DDP)
    return [dataclasses.replace(r, extra={**r.extra, "series": r.extra.get("series", r.algo)})
            for r in found if r.coll == "allreduce" and "testbed" in r.extra and "perflow" not in path.stem]


def _layout(r: Row) -> tuple[Cluster, float]:
    tb = r.extra.get("testbed")
    if not tb or "rate_bps" not in tb:
        raise ConfigError(f"row {r.label} {r.bytes} B has no testbed layout (extra.testbed)")
    per_host = int(tb.get("ranks_per_host", 1))
    if r.world % per_host:
        raise ConfigError(f"row {r.label}: world {r.world} is not a multiple of {per_host} ranks per host")
    cluster = _testbed_cluster(r.world // per_host, per_host, float(tb["rate_bps"]), int(tb.get("servers", 0)))
    return cluster, float(tb.get("goodput_factor", GOODPUT_FACTOR))


def _testbed_cluster(hosts: int, per_host: int, rate_bps: float, reducers: int) -> Cluster:
    """A layout as the testbed emulates it: its links' token buckets burst as it shapes them."""
    return Cluster(hosts, per_host, rate_bps, reducers, burst_bytes=netns.burst_bytes(int(rate_bps)))


def check_rows(rows: list[Row], profile: Profile, cores: int | None = None) -> list[Check]:
    cores = cores or os.cpu_count() or 1
    out = []
    for r in rows:
        series = r.extra.get("series", r.algo)
        algo = SERIES_ALGO.get(series)
        if algo is None or r.coll != "allreduce" or r.median_s <= 0:
            continue
        if algo == "rd" and r.bytes >= 64 * 1024:
            algo = "ring"  # auto picks the ring from 64 KiB up
        # Rows that record the route they took (bench allreduce: "scheme", "inter") are
        # predicted for that route, not for the series' default.
        if algo != "gloo":  # (gloo's rows say "ring" too: its own ring, with its own constants)
            algo = ROUTE_ALGO.get(r.extra.get("inter", ""), algo)
        cluster, goodput = _layout(r)
        hierarchical = r.extra.get("scheme", "hierarchical" if r.extra.get("hierarchy", "auto") != "off" else "flat")
        if cluster.ranks_per_host > 1 and algo in HIERARCHICAL and hierarchical == "hierarchical":
            algo = HIERARCHICAL[algo]  # REDSOCK_HIERARCHY=auto (the default): shared memory in a host
        p = profile if goodput == profile.goodput_factor else _with(profile, goodput_factor=goodput)
        pred = model.predict(algo, cluster, r.bytes, p)
        procs = r.world + (cluster.reducers if algo in model.REDUCER_ALGORITHMS else 0)
        busy = max(r.extra.get("machine_busy", 0.0), r.extra.get("ranks_busy", 0.0))
        if procs > PROCS_PER_CORE * cores or busy >= BUSY_LIMIT:
            kind = "CPU-bound"
        elif pred.link_share >= LINK_SHARE:
            kind = "link-bound"
        else:
            kind = "latency-bound"
        senders = cluster.hosts if algo == "hreducers" else r.world
        shared = senders * r.bytes * p.reducer_cpu_s_per_byte / cores if algo in model.REDUCER_ALGORITHMS else 0.0
        out.append(Check(r, series, cluster, pred, kind, shared))
    return out


def _with(p: Profile, **changes: Any) -> Profile:
    return dataclasses.replace(p, **changes)


def _t(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s >= 1e-2 else f"{s * 1e6:.0f} us"


def summary(checks: list[Check]) -> str:
    """Per layout (N, ranks per host, series), its largest measured size: the headline table."""
    labels = suite.SERIES_LABELS
    biggest: dict[tuple[int, int, str], Check] = {}
    for c in checks:
        key = (c.row.world, c.cluster.ranks_per_host, c.series)
        if key not in biggest or c.row.bytes > biggest[key].row.bytes:
            biggest[key] = c
    lines = ["| hosts x ranks/host | reducers | series | size | measured | predicted | error | class | within 15% |",
             "|:---|---:|:---|---:|---:|---:|---:|:---|:---:|"]
    order = list(labels)
    for key in sorted(biggest, key=lambda k: (k[0], k[1], order.index(k[2]) if k[2] in order else 99)):
        c = biggest[key]
        red = c.cluster.reducers if c.prediction.algo in model.REDUCER_ALGORITHMS else 0
        verdict = {True: "yes", False: "**no**", None: "-"}[c.ok]
        lines.append(f"| {c.cluster.hosts} x {c.cluster.ranks_per_host} | {red} | {labels.get(c.series, c.series)} | "
                     f"{human_size(c.row.bytes)} | {_t(c.row.median_s)} | {_t(c.prediction.seconds)} | "
                     f"{c.error:+.1%} | {c.kind} | {verdict} |")
    return "\n".join(lines)


def markdown(checks: list[Check], min_bytes: int = 0) -> str:
    """The comparison table (one row per measured point of at least ``min_bytes``) and a
    one-line verdict over all of them."""
    labels = suite.SERIES_LABELS
    lines = ["| hosts x ranks | reducers | size | series | measured | predicted | error | bottleneck (model) | class "
             "| busy: machine / ranks | reducers' CPU on the lab's cores | within 15% |",
             "|---:|---:|---:|:---|---:|---:|---:|:---|:---|:---:|---:|:---:|"]
    shown = [c for c in checks if c.row.bytes >= min_bytes]
    for c in sorted(shown, key=lambda c: (c.row.world, c.cluster.ranks_per_host, c.row.bytes,
                                          list(labels).index(c.series) if c.series in labels else 99)):
        verdict = {True: "yes", False: "**no**", None: "-"}[c.ok]
        red = c.cluster.reducers if c.prediction.algo in model.REDUCER_ALGORITHMS else 0
        lines.append(f"| {c.cluster.hosts} x {c.cluster.ranks_per_host} | {red} | {human_size(c.row.bytes)} | {labels.get(c.series, c.series)} | "
                     f"{_t(c.row.median_s)} | {_t(c.prediction.seconds)} | {c.error:+.1%} | "
                     f"{c.prediction.bottleneck} | {c.kind} | {_busy(c.row)} | "
                     f"{_t(c.shared_cpu_s) if c.shared_cpu_s else '-'} "
                     f"| {verdict} |")
    judged = [c for c in checks if c.ok is not None]
    good = sum(1 for c in judged if c.ok)
    lines += ["", f"Link-bound points within {TOLERANCE:.0%}: {good} of {len(judged)}; "
              f"CPU-bound points: {sum(c.kind == 'CPU-bound' for c in checks)}; "
              f"latency-bound points: {sum(c.kind == 'latency-bound' for c in checks)}."]
    return "\n".join(lines)


def _busy(r: Row) -> str:
    """How busy the whole machine and the row's ranks were while it was timed (what decides CPU-bound)."""
    return " / ".join(report.percent(r.extra.get(k)) for k in ("machine_busy", "ranks_busy"))


# ----------------------------------------------------------------------------- DDP training

#: examples/train_lm.py's default DDP bucket (``--bucket-cap-mb 25``, MiB as DDP counts it)
DDP_BUCKET = 25 << 20
DDP_ALGO = {"gloo": "gloo", "ring": "ring", "server": "reducers"}


@dataclass(frozen=True)
class DdpCheck:
    workers: int
    algo: str  #: the benchmark's algo (gloo, ring, server)
    measured_steps_s: float
    predicted_steps_s: float
    compute_s: float  #: one step's compute, taken from gloo's measured step (the one number fitted)
    kind: str  #: "CPU-bound" or "link-bound" (by the processes-per-core rule)

    @property
    def error(self) -> float:
        return self.predicted_steps_s / self.measured_steps_s - 1


def ddp_checks(results_dir: str | Path, profile: Profile, cores: int | None = None) -> list[DdpCheck]:
    """``bench ddp --testbed`` runs: gloo's measured step fixes the compute time (step minus the
    model's gradient sync, no overlap); the ring's and the reducers' steps/s are then predicted."""
    cores = cores or os.cpu_count() or 1
    out = []
    for path in sorted(Path(results_dir).glob("ddp-n*.jsonl")):
        rows = suite.load_data(suite.Step(path.stem, "ddp", "", (), 0), path)
        gloo = next((r for r in rows if r["algo"] == "gloo"), None)
        if gloo is None:
            continue
        for r in rows:
            algo = DDP_ALGO.get(r["algo"])
            if algo is None:
                continue
            c = _testbed_cluster(int(r["workers"]), 1, float(r["rate_bps"]), int(r.get("servers") or 0))
            sync = {a: model.gradient_sync_s(a, c, int(r["grad_bytes"]), DDP_BUCKET, profile) for a in ("gloo", algo)}
            compute = max(0.0, 1 / float(gloo["steps_per_s"]) - sync["gloo"])
            predicted = 1 / model.ddp_step_s(sync[algo], compute, 0.0)
            procs = c.world + (c.reducers if algo == "reducers" else 0)
            kind = "CPU-bound" if procs > PROCS_PER_CORE * cores else "link-bound"
            out.append(DdpCheck(c.world, r["algo"], float(r["steps_per_s"]), predicted, compute, kind))
    return out


def ddp_markdown(checks: list[DdpCheck]) -> str:
    lines = ["| workers | algo | compute / step (from gloo) | measured steps/s | predicted steps/s | error | class |",
             "|---:|:---|---:|---:|---:|---:|:---|"]
    for c in checks:
        lines.append(f"| {c.workers} | {c.algo} | {_t(c.compute_s)} | {c.measured_steps_s:.3f} | "
                     f"{c.predicted_steps_s:.3f} | {c.error:+.1%} | {c.kind} |")
    return "\n".join(lines)


def results_section(results_dir: str | Path, profile: Profile, cores: int | None = None) -> list[str]:
    """The "model against these measurements" section of results.md (``redsock reproduce``
    writes it; ``redsock plan --lab DIR`` prints the same tables)."""
    try:
        checks = check_rows(load_lab(results_dir), profile, cores)
    except ConfigError as e:
        return [f"Nothing to compare: {e}."]
    lines = [
        (f"`redsock plan --lab {_RESULTS_NAME}` predicts every all-reduce above with the model of "
         "`src/redsock/plan/model.py` (time = steps x per-step latency + the slowest resource's bytes / its rate "
         "+ the reducers' fill and drain, less what the testbed's token buckets let an idle link make up (its tc "
         "burst); bytes per host NIC as in DESIGN.md section 7; payload = line rate x goodput "
         f"factor) and the profile \"{profile.source}\". Nothing is fitted to these rows. Each point is classed "
         f"before comparing: **CPU-bound** where more than {PROCS_PER_CORE} processes per core work for the series "
         f"(ranks, plus reducers for the reducer series) or the whole machine was at least {BUSY_LIMIT:.0%} busy "
         "while the point was timed (where a point has no reading of its own: its run's, from the log's CPU line) "
         "or the point's ranks alone were, **link-bound** where the NICs "
         "account for at least "
         f"{LINK_SHARE:.0%} of the predicted time, **latency-bound** otherwise. Link-bound points are held to "
         f"{TOLERANCE:.0%}; elsewhere the model gives the link-bound time and is not judged. `error` = predicted / "
         "measured - 1 (negative: the lab was slower than the model)."),
        "", "Per layout, its largest size:", "", summary(checks), "",
        f"Every point from {human_size(SECTION_MIN_BYTES)} up (`redsock plan --lab` prints the smaller ones too):",
        "", markdown(checks, SECTION_MIN_BYTES),
    ]
    misses = [c for c in checks if c.ok is False]
    if misses:
        lines += ["", "Link-bound points outside the bound (not fitted away):", ""]
        lines += [f"- {c.cluster.hosts} x {c.cluster.ranks_per_host}, {suite.SERIES_LABELS.get(c.series, c.series)}, "
                  f"{human_size(c.row.bytes)}: {c.error:+.1%}" for c in misses]
    ddp = ddp_checks(results_dir, profile, cores)
    if ddp:
        lines += ["", "DDP training: the compute time of a step is taken from gloo's measured step minus the model's "
                  "gradient sync for gloo (DDP's 25 MiB buckets, no overlap); the ring's and the reducers' steps/s "
                  "are then predicted.", "", ddp_markdown(ddp)]
    return lines


#: the section's full table starts here (below: per-message costs on shared cores)
SECTION_MIN_BYTES = 256 * 1024
_RESULTS_NAME = "docs/results"
