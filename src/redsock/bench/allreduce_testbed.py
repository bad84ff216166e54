"""``redsock bench allreduce --testbed``: the all-reduce sweep on an emulated cluster.

Builds a :class:`~redsock.testbed.Testbed` star — workers ``w0..`` and reducers
``s0..``, every host link shaped to ``--rate`` in both directions — then

* starts one ``redsock serve`` per reducer host, listening on that host's address;
* starts one rank per worker host running this same ``bench allreduce`` command
  (minus the testbed options) with the torchrun variables (``MASTER_ADDR`` = w0's
  address, rank 0 hosts the store there), ``REDSOCK_SERVERS`` naming the reducers
  and ``GLOO_SOCKET_IFNAME`` the host's interface, so every algorithm of
  ``--algo`` (e.g. ``server,ring,gloo``) is measured on the same ranks in one run;
* relays rank 0's tables, adds a summary against the link — the link rate, its
  payload goodput (``rate x GOODPUT_FACTOR``: tc counts frame headers, the testbed
  measured 95.6 % goodput) and per size each redsock algorithm's algbw as a share
  of it and as a ratio to gloo's, next to the ideal ratio (``2(N-1)/N`` for the
  reduction server) — plus the reducers' peak RSS and the CPU the run took;
* writes ``--json`` / ``--plot`` from rank 0's rows (each row's ``extra.testbed``
  records the topology).

The testbed is always torn down: on success, on any error, on Ctrl-C and on
SIGTERM/SIGHUP.  The whole run is bounded by ``--timeout``; the exit status is
non-zero if any rank (or a reducer) fails.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from ..errors import ConfigError, RedsockError
from ..testbed import netns as nx
from ..testbed.cluster import PROFILES, Testbed
from ..testbed.netns import format_rate, parse_rate
from . import report
from .testbed_launch import (GOODPUT_FACTOR, SERVER_PORT, Proc, box_cpu, proc_status, set_congestion_control,
                             start_ranks, start_servers, stop, tail, tcp_counters, tcp_delta, tcp_line, wait_ranks)

__all__ = ["GOODPUT_FACTOR", "add_arguments", "child_argv", "run", "summary_table"]

#: Options that belong to the launcher (this module and ``--nprocs``), not to the ranks.
_LAUNCHER_DESTS = {"nprocs", "timeout", "json", "plot", "no_progress"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("emulated cluster (--testbed; needs root)")
    g.add_argument("--testbed", action="store_true",
                   help="run every rank in its own network namespace with shaped links, "
                        "and one reduction server per reducer host (--timeout bounds the whole run)")
    g.add_argument("--workers", type=int, default=4, help="with --testbed: worker hosts / ranks (default 4)")
    g.add_argument("--servers", type=int, help="with --testbed: reducer hosts (default: as many as workers)")
    g.add_argument("--rate", default="2gbit", help="with --testbed: link rate each way, e.g. 2gbit, 800mbit")
    g.add_argument("--profile", default="uniform", choices=PROFILES,
                   help="with --testbed: uniform | perflow | slow-server (reducer s0 at rate/2)")
    g.add_argument("--prefix", help="with --testbed: namespace prefix (default rsar<pid>)")
    g.add_argument("--tcp-cc", metavar="NAME", default="reno",
                   help="with --testbed: TCP congestion control in every host namespace (default reno: "
                        "loss-based like Linux's usual cubic, which this kernel may not offer; BBR through "
                        "tbf links with no propagation delay drops heavily with many flows)")


def _testbed_dests() -> set[str]:
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    return {a.dest for a in p._actions}


def child_argv(args: argparse.Namespace, json_path: str | None) -> list[str]:
    """The ``redsock bench allreduce ...`` argv each rank runs: every bench option that
    differs from its default, none of the launcher's, ``--json json_path``, no progress bar.

    Built from the parser itself (``allreduce.add_arguments``), so options added there
    later travel too, and abbreviations on the command line cannot slip through.
    """
    from . import allreduce

    parser = argparse.ArgumentParser(add_help=False)
    allreduce.add_arguments(parser)
    skip = _testbed_dests() | _LAUNCHER_DESTS
    out = ["bench", "allreduce"]
    for action in parser._actions:
        if action.dest in skip or not action.option_strings or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        opt = max(action.option_strings, key=len)  # the long form
        if isinstance(action, argparse._StoreTrueAction):
            out.append(opt)
        elif isinstance(action, argparse._StoreFalseAction):
            out.append(opt)
        elif isinstance(action, argparse._StoreAction) and value is not None:
            out += [opt, str(value)]
        elif value is not None:
            raise ConfigError(f"--testbed cannot forward option {opt} ({type(action).__name__})")
    out.append("--no-progress")
    if json_path:
        out += ["--json", json_path]
    return out


# -- the summary -------------------------------------------------------------------

def ideal_over_gloo(algo: str, world: int) -> float | None:
    """algbw ratio against gloo's ring when both are link-bound: a reduction server moves
    S each way per worker against 2S(N-1)/N for a ring; a ring matches a ring."""
    if algo == "server":
        return 2 * (world - 1) / world if world > 1 else None
    if algo == "ring":
        return 1.0
    return None


def summary_table(rows: Sequence[report.Row], rate_bps: int, workers: int, servers: int,
                  profile: str) -> str:
    """Per size, each redsock algorithm's algbw against the link goodput and against gloo."""
    goodput = rate_bps * GOODPUT_FACTOR / 8 / 1e9  # GB/s of payload one link direction carries
    out = [f"# testbed: {workers} workers, {servers} reducers, {profile} links at {format_rate(rate_bps)} "
           f"each way; link goodput = {format_rate(rate_bps)} x {GOODPUT_FACTOR} = {goodput:.4f} GB/s",
           "# algbw in GB/s; %good = algbw / link goodput; /gloo = algbw / gloo's algbw (same size, this run); "
           "ideal /gloo = 2(N-1)/N for server, 1 for ring"]
    gloo = {(r.world, r.bytes, r.dtype, r.op): r for r in rows if r.algo == "gloo"}
    out.append(f"#{'size':>9} {'algo':>7} {'time(us)':>10} {'algbw':>9} {'%good':>7} {'gloo':>9} {'/gloo':>7} "
               f"{'ideal':>6} {'#wrong':>7}")
    for r in sorted(rows, key=lambda r: (r.bytes, r.algo == "gloo")):
        g = None if r.algo == "gloo" else gloo.get((r.world, r.bytes, r.dtype, r.op))
        ideal = ideal_over_gloo(r.algo, r.world)
        out.append(
            f"{report.human_size(r.bytes, sep=''):>10} {r.algo:>7} {_us(r.median_s):>10} {r.algbw_GBps:9.4f} "
            f"{100 * r.algbw_GBps / goodput:6.1f}% "
            f"{(f'{g.algbw_GBps:9.4f}' if g else '-'):>9} "
            f"{(f'{r.algbw_GBps / g.algbw_GBps:7.2f}' if g and g.algbw_GBps > 0 else '-'):>7} "
            f"{(f'{ideal:6.2f}' if ideal and r.algo != 'gloo' else '-'):>6} "
            f"{('N/A' if r.wrong < 0 else str(r.wrong)):>7}")
    return "\n".join(out)


def _us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.0f}" if us >= 1000 else f"{us:.1f}"


def link_counters(tb: Testbed) -> dict[str, dict[str, int]]:
    """Per host, ``{"up_bytes", "up_drops", "down_bytes", "down_drops"}`` summed over the
    qdiscs of its link (``tc -s``): "up" is host->network, "down" network->host."""
    import json

    out = {}
    for name, h in tb.hosts.items():
        c = {}
        for side, ns, dev in (("up", h.ns, h.dev), ("down", h.peer_ns, h.peer_dev)):
            try:
                qd = json.loads(nx.run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev]).stdout or "[]")
            except (RedsockError, ValueError):
                qd = []
            roots = [q for q in qd if q.get("root")] or qd[:1]
            leaves = [q for q in qd if not q.get("root")]
            c[f"{side}_bytes"] = sum(int(q.get("bytes", 0)) for q in roots)
            c[f"{side}_drops"] = sum(int(q.get("drops", 0)) for q in roots + leaves)
        out[name] = c
    return out


def _link_line(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], wall: float) -> str:
    parts = []
    for name in after:
        a, b = after[name], before.get(name, {})
        d = {k: a[k] - b.get(k, 0) for k in a}
        parts.append(f"{name} {8 * d['up_bytes'] / wall / 1e6:.0f}/{8 * d['down_bytes'] / wall / 1e6:.0f}"
                     f" drops {d['up_drops']}/{d['down_drops']}")
    return ("# links (mean Mbit/s up/down over the run incl. start-up, tc drops up/down): "
            + "; ".join(parts))


def reducer_cpu_line(servers: list[Proc], before: dict[str, dict[str, int]],
                     after: dict[str, dict[str, int]]) -> str:
    """The reducers' CPU cost per byte they summed: CPU-seconds of every reducer over the run
    per GiB that arrived on their links (tc's count, so frame headers included)."""
    cpu = sum(s.info.get("cpu_s", 0.0) for s in servers)
    gib = sum(after[s.name]["down_bytes"] - before.get(s.name, {}).get("down_bytes", 0)
              for s in servers if s.name in after) / 2**30
    per = f"{cpu / gib:.2f} CPU-s/GiB" if gib > 0 else "n/a"
    return f"# reducers: {cpu:.2f} CPU-s for {gib:.3f} GiB received = {per} reduced"


# -- the command -------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    """Build the testbed, run the ranks and reducers in it, report; always tear down."""
    from .transport_testbed import _no_interrupts, _terminate_as_interrupt

    if args.nprocs:
        raise ConfigError("--testbed starts one rank per worker host: drop --nprocs (use --workers)")
    servers = args.workers if args.servers is None else args.servers
    rate = parse_rate(args.rate)
    algos = [a.strip() for a in args.algo.split(",") if a.strip()]
    if "server" in algos and servers < 1:
        raise ConfigError("--algo server needs --servers >= 1")
    if args.timeout <= 0:
        raise ConfigError("--timeout must be > 0")
    nx.require_root("redsock bench allreduce --testbed")
    prefix = args.prefix or f"rsar{os.getpid()}"
    tb = Testbed(workers=args.workers, servers=servers, rate=rate, profile=args.profile, prefix=prefix)
    deadline = time.monotonic() + args.timeout
    rc = 1
    with tempfile.TemporaryDirectory(prefix="redsock-bench-tb-") as tmp, _terminate_as_interrupt():
        logdir = Path(tmp)
        json_path = logdir / "rows.jsonl"
        argv = child_argv(args, str(json_path))
        ranks: list[Proc] = []
        server_procs: list[Proc] = []
        relays: list[threading.Thread] = []
        try:
            print(f"# testbed {prefix}: building {args.workers} workers + {servers} reducers, "
                  f"{args.profile} links at {format_rate(rate)}", flush=True)
            tb.up()
            cc = set_congestion_control(tb, args.tcp_cc)
            print(f"# TCP congestion control in the hosts: {cc}", flush=True)
            server_procs = start_servers(tb, logdir, deadline)
            children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            links0, tcp0 = link_counters(tb), tcp_counters(tb)
            cpu0 = {s.name: proc_status(s.proc.pid).get("cpu_s", 0.0) for s in server_procs}
            box0, t0 = box_cpu(), time.monotonic()
            ranks, relays = start_ranks(tb, [sys.executable, "-m", "redsock", *argv], logdir)
            why = wait_ranks(ranks, server_procs, deadline, args.timeout)
            wall = time.monotonic() - t0
            box1 = box_cpu()
            links1 = link_counters(tb)
            links = _link_line(links0, links1, wall)
            links += "\n# TCP over the run, all hosts: " + tcp_line(tcp_delta(tcp0, tcp_counters(tb)))
            for s in server_procs:  # read before they exit: the peak RSS dies with the process
                s.info = proc_status(s.proc.pid)
                s.info["cpu_s"] = s.info.get("cpu_s", 0.0) - cpu0.get(s.name, 0.0)  # during the run
            stop(ranks)
            for t in relays:
                t.join(timeout=5)
            rc = _report(args, tb, ranks, server_procs, why, json_path, rate, servers, wall,
                         children0, box0, box1)
            print(links)
            print(reducer_cpu_line(server_procs, links0, links1))
        finally:
            with _no_interrupts():
                stop(ranks + server_procs)
                tb.down()
    return rc


def _report(args: argparse.Namespace, tb: Testbed, ranks: list[Proc], servers: list[Proc],
            why: str | None, json_path: Path, rate: int, nservers: int, wall: float,
            children0: Any, box0: tuple[int, int], box1: tuple[int, int]) -> int:
    rc = 0
    if why is not None:
        print(f"redsock: testbed run failed: {why}", file=sys.stderr)
        rc = 1
    for p in ranks:
        code = p.proc.returncode
        if code != 0:
            rc = rc or (code if code and code > 0 else 1)
            if why is not None or code != 1:  # exit 1 alone from rank 0 means wrong elements
                print(f"--- {p.name} (exit {code}) ---\n{tail(p.log) or '(no output)'}", file=sys.stderr)
    for s in servers:
        if s.proc.poll() is not None:
            rc = rc or 1
            print(f"--- reducer {s.name} exited with {s.proc.returncode} ---\n{tail(s.log)}", file=sys.stderr)
    rows = report.read_json(json_path) if json_path.exists() else []
    if rows:
        meta = {"workers": tb.workers, "servers": nservers, "rate_bps": rate, "profile": tb.profile,
                "goodput_factor": GOODPUT_FACTOR}
        rows = [replace(r, extra={**r.extra, "testbed": meta}) for r in rows]
        print(summary_table(rows, rate, tb.workers, nservers, tb.profile))
        if args.json:
            report.write_json(rows, args.json)
        if args.plot:
            report.plot(rows, args.plot, title=f"{tb.workers} workers, {nservers} reducers, "
                                                f"{format_rate(rate)} links")
    elif rc == 0:
        print("redsock: rank 0 wrote no results", file=sys.stderr)
        rc = 1
    for s in servers:
        info = s.info
        if info:
            print(f"# reducer {s.name} ({tb.host_addr(s.name)}:{SERVER_PORT}): peak RSS "
                  f"{info.get('VmHWM', float('nan')):.1f} MiB, "
                  f"CPU during the run {info.get('cpu_s', float('nan')):.1f} s")
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    rank_cpu = (children1.ru_utime + children1.ru_stime) - (children0.ru_utime + children0.ru_stime)
    server_cpu = sum(s.info.get("cpu_s", 0.0) for s in servers)
    busy = (box1[0] - box0[0]) / max(1, box1[1] - box0[1])
    ncpu = os.cpu_count() or 1
    print(f"# CPU over {wall:.1f} s: ranks {rank_cpu:.1f} s, reducers {server_cpu:.1f} s "
          f"(= {100 * (rank_cpu + server_cpu) / (wall * ncpu):.0f}% of {ncpu} cores); "
          f"whole machine busy {100 * busy:.0f}% (includes anything else running)")
    return rc
