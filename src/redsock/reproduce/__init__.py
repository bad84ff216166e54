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
tables) take parsed rows and return text, so they are tested without a testb

The package: the steps and the stored results' loader are :mod:`redsock.bench.suite` (the
model's ``plan --lab`` reads them too); :mod:`.tables` (bounds per series, points, tables:
pure), :mod:`.render` (results.md), :mod:`.figures` (the PNGs) and :mod:`.runner` (the
processes) are the report.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import replace
from pathlib import Path

from ..bench.procs import CPU_SHARE_RE
from ..bench.suite import (
    PLANS,
    SECTIONS,
    SERIES_LABELS,
    Settings,
    Step,
    StepResult,
    load_data,
    make_plan,
    tag_rows,
)
from ..errors import ConfigError
from .figures import write_figures
from .render import RunInfo, invocation, render_markdown
from .runner import execute, run_step
from .tables import (
    algbw_bound_GBps,
    allreduce_points,
    allreduce_table,
    ddp_points,
    ddp_table,
    ideal_over_gloo,
    latency_growth_model,
    latency_table,
    link_goodput_GBps,
    traffic_factor,
    transport_points,
    transport_table,
)

__all__ = [
    "CPU_SHARE_RE", "PLANS", "SECTIONS", "SERIES_LABELS", "RunInfo", "Settings", "Step", "StepResult",
    "add_arguments", "algbw_bound_GBps", "allreduce_points", "allreduce_table", "ddp_points", "ddp_table",
    "execute", "ideal_over_gloo", "invocation", "latency_growth_model", "latency_table", "link_goodput_GBps",
    "load_data", "make_plan", "render_markdown", "run", "run_step", "settings_from_args", "tag_rows",
    "traffic_factor", "transport_points", "transport_table", "write_figures",
]

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")


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
