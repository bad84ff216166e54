"""``redsock bench allreduce --testbed``: the all-reduce sweep on an emulated cluster.

Builds a :class:`~redsock.testbed.Testbed` star — workers ``w0..`` and reducers
``s0..``, every host link shaped to ``--rate`` in both directions — then

* starts one ``redsock serve`` per reducer host, listening on that host's address;
* starts ``--ranks-per-host`` L ranks on every one of the ``--workers`` H worker
  hosts (N = H x L ranks, consecutive ranks on one host as torchrun numbers them;
  ``--workers`` counts hosts, so with the default L = 1 it is also the number of
  ranks), each running this same ``bench allreduce`` command (minus the testbed
  options) with the torchrun variables (``MASTER_ADDR`` = w0's address, rank 0
  hosts the store there), ``REDSOCK_SERVERS`` naming the reducers and
  ``GLOO_SOCKET_IFNAME`` the host's interface, so every algorithm of ``--algo``
  (e.g. ``server,ring,gloo``) is measured on the same ranks in one run;
* relays rank 0's tables, adds a summary against the link — the link rate, its
  payload goodput (``rate x GOODPUT_FACTOR``: tc counts frame headers, the testbed
  measured 95.6 % goodput), per row the bytes one host link carries per byte of
  buffer (:func:`~redsock.bench.bounds.host_nic_factor`: flat ring 2(N-1)/N,
  hierarchical ring 2(H-1)/H, flat reducers L, hierarchical reducers 1), the algbw
  bound that gives, the share of it reached and the ratio to gloo's algbw next to
  the ideal one — plus the reducers' peak RSS and the CPU the run took;
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

from ... import results as report
from ...errors import ConfigError, RedsockError
from ...testbed import launch
from ...testbed import netns as nx
from ...testbed.cluster import Testbed
from ...testbed.netns import format_rate, parse_rate
from ..bounds import GOODPUT_FACTOR, host_nic_factor, ideal_over_gloo, link_goodput_GBps
from ..procs import BUSY_LIMIT, BoxCpu, box_cpu, cpu_line, cpu_shares, proc_status
from .options import child_argv

# -- the summary -------------------------------------------------------------------

def row_route(r: report.Row) -> tuple[str, str]:
    """(algorithm between hosts, scheme) of a row, as its rank recorded it (see
    :func:`.rank.route`); gloo runs a flat ring, a row that records nothing its own algo, flat."""
    if r.algo == "gloo":
        return "gloo", "flat"
    return r.extra.get("inter", r.algo), r.extra.get("scheme", "flat")


def summary_table(rows: Sequence[report.Row], rate_bps: int, workers: int, servers: int,
                  profile: str, ranks_per_host: int = 1) -> str:
    """Per size, each algorithm's algbw against its link bound and against gloo's."""
    goodput = link_goodput_GBps(rate_bps)  # GB/s of payload one link direction carries
    ranks = f" x {ranks_per_host} ranks (N={workers * ranks_per_host})" if ranks_per_host > 1 else ""
    out = [f"# testbed: {workers} workers{ranks}, {servers} reducers, {profile} links at {format_rate(rate_bps)} "
           f"each way; link goodput = {format_rate(rate_bps)} x {GOODPUT_FACTOR} = {goodput:.4f} GB/s",
           "# route = flat (every rank on the network) or hier (reduced inside each host first) : the algorithm "
           "between hosts, as the ranks chose it (/bf16, /fp16: on that 16-bit wire); algbw in GB/s; "
           "NIC/S = bytes each way through one host link per byte of buffer (ring: flat 2(N-1)/N, "
           "hierarchical 2(H-1)/H; reducers: flat L, hierarchical 1; on a 16-bit wire x1/2 for the reducers, "
           "x3/4 for the ring, whose reduce-scatter stays float32); bound = goodput / NIC/S; "
           "%bound = algbw / bound; /gloo = algbw / gloo's algbw (same size, this run); "
           "ideal = gloo's NIC/S / this NIC/S; busy = the whole machine's cores in use while the row was "
           f"timed (ranks, reducers, the kernel's network work: at {BUSY_LIMIT:.0%} or more the row measures "
           "the CPU rather than the links); steal = of that, the share the hypervisor gave other guests "
           "(it slows every process at once); maxerr = the largest relative error --check saw on a 16-bit wire"]
    gloo = {(r.world, r.bytes, r.dtype, r.op): r for r in rows if r.algo == "gloo"}
    errs = any("max_rel_err" in r.extra for r in rows)
    rw = 16 if any(r.extra.get("wire_dtype") for r in rows) else 12  # route's width ("hier:server/bf16")
    out.append(f"#{'size':>9} {'algo':>7} {'route':>{rw}} {'time(us)':>10} {'algbw':>9} {'NIC/S':>6} {'bound':>8} "
               f"{'%bound':>7} {'gloo':>9} {'/gloo':>7} {'ideal':>6} {'busy':>5} {'steal':>5} {'#wrong':>7}"
               + (f" {'maxerr':>9}" if errs else ""))
    for r in sorted(rows, key=lambda r: (r.bytes, r.algo == "gloo")):
        g = None if r.algo == "gloo" else gloo.get((r.world, r.bytes, r.dtype, r.op))
        inter, scheme = row_route(r)
        wire = r.extra.get("wire_dtype")
        factor = host_nic_factor(inter, r.world, workers, scheme, wire=bool(wire))
        bound = goodput / factor if factor else None
        ideal = None if r.algo == "gloo" else ideal_over_gloo(inter, r.world, workers, scheme, wire=bool(wire))
        how = f"{scheme[:4]}:{'ring' if inter == 'gloo' else inter}" + (f"/{wire}" if wire else "")
        err = r.extra.get("max_rel_err")
        out.append(
            f"{report.human_size(r.bytes, sep=''):>10} {r.algo:>7} {how:>{rw}} {_us(r.median_s):>10} "
            f"{r.algbw_GBps:9.4f} {(f'{factor:6.2f}' if factor else '-'):>6} "
            f"{(f'{bound:8.4f}' if bound else '-'):>8} "
            f"{(f'{100 * r.algbw_GBps / bound:6.1f}%' if bound else '-'):>7} "
            f"{(f'{g.algbw_GBps:9.4f}' if g else '-'):>9} "
            f"{(f'{r.algbw_GBps / g.algbw_GBps:7.2f}' if g and g.algbw_GBps > 0 else '-'):>7} "
            f"{(f'{ideal:6.2f}' if ideal else '-'):>6} "
            f"{report.percent(r.extra.get('machine_busy')):>5} {report.percent(r.extra.get('machine_steal')):>5} "
            f"{('N/A' if r.wrong < 0 else str(r.wrong)):>7}"
            + (f" {('N/A' if err is None else f'{err:.2e}'):>9}" if errs else ""))
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


def reducer_cpu_line(servers: list[launch.Proc], before: dict[str, dict[str, int]],
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
    if args.nprocs:
        raise ConfigError("--testbed starts --ranks-per-host ranks on each of --workers hosts: drop --nprocs")
    if args.ranks_per_host < 1:
        raise ConfigError("--ranks-per-host must be >= 1")
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
    with tempfile.TemporaryDirectory(prefix="redsock-bench-tb-") as tmp, launch.terminate_as_interrupt():
        logdir = Path(tmp)
        json_path = logdir / "rows.jsonl"
        argv = child_argv(args, str(json_path))
        ranks: list[launch.Proc] = []
        server_procs: list[launch.Proc] = []
        relays: list[threading.Thread] = []
        try:
            print(f"# testbed {prefix}: building {args.workers} workers + {servers} reducers, "
                  f"{args.profile} links at {format_rate(rate)}; {args.ranks_per_host} rank(s) per worker, "
                  f"{args.workers * args.ranks_per_host} in all", flush=True)
            tb.up()
            cc = launch.set_congestion_control(tb, args.tcp_cc)
            print(f"# TCP congestion control in the hosts: {cc}", flush=True)
            server_procs = launch.start_servers(tb, logdir, deadline)
            children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            links0, tcp0 = link_counters(tb), launch.tcp_counters(tb)
            cpu0 = {s.name: proc_status(s.proc.pid).get("cpu_s", 0.0) for s in server_procs}
            box0, t0 = box_cpu(), time.monotonic()
            ranks, relays = launch.start_ranks(tb, [sys.executable, "-m", "redsock", *argv], logdir,
                                        ranks_per_host=args.ranks_per_host)
            why = launch.wait_ranks(ranks, server_procs, deadline, args.timeout)
            wall = time.monotonic() - t0
            box1 = box_cpu()
            links1 = link_counters(tb)
            links = _link_line(links0, links1, wall)
            links += "\n# TCP over the run, all hosts: " + launch.tcp_line(launch.tcp_delta(tcp0, launch.tcp_counters(tb)))
            for s in server_procs:  # read before they exit: the peak RSS dies with the process
                s.info = proc_status(s.proc.pid)
                s.info["cpu_s"] = s.info.get("cpu_s", 0.0) - cpu0.get(s.name, 0.0)  # during the run
            launch.stop(ranks)
            for t in relays:
                t.join(timeout=5)
            rc = _report(args, tb, ranks, server_procs, why, json_path, rate, servers, wall,
                         children0, box0, box1)
            print(links)
            print(reducer_cpu_line(server_procs, links0, links1))
        finally:
            with launch.no_interrupts():
                launch.stop(ranks + server_procs)
                tb.down()
    return rc


def _report(args: argparse.Namespace, tb: Testbed, ranks: list[launch.Proc], servers: list[launch.Proc],
            why: str | None, json_path: Path, rate: int, nservers: int, wall: float,
            children0: Any, box0: BoxCpu, box1: BoxCpu) -> int:
    rc = 0
    if why is not None:
        print(f"redsock: testbed run failed: {why}", file=sys.stderr)
        rc = 1
    for p in ranks:
        code = p.proc.returncode
        if code != 0:
            rc = rc or (code if code and code > 0 else 1)
            if why is not None or code != 1:  # exit 1 alone from rank 0 means wrong elements
                print(f"--- {p.name} (exit {code}) ---\n{launch.tail(p.log) or '(no output)'}", file=sys.stderr)
    for s in servers:
        if s.proc.poll() is not None:
            rc = rc or 1
            print(f"--- reducer {s.name} exited with {s.proc.returncode} ---\n{launch.tail(s.log)}", file=sys.stderr)
    rows = report.read_json(json_path) if json_path.exists() else []
    if rows:
        meta = {"workers": tb.workers, "servers": nservers, "rate_bps": rate, "profile": tb.profile,
                "goodput_factor": GOODPUT_FACTOR, "ranks_per_host": args.ranks_per_host}
        rows = [replace(r, extra={**r.extra, "testbed": meta}) for r in rows]
        print(summary_table(rows, rate, tb.workers, nservers, tb.profile, args.ranks_per_host))
        if args.json:
            report.write_json(rows, args.json)
        if args.plot:
            per_host = f" x {args.ranks_per_host} ranks" if args.ranks_per_host > 1 else ""
            report.plot(rows, args.plot, title=f"{tb.workers} workers{per_host}, {nservers} reducers, "
                                                f"{format_rate(rate)} links")
    elif rc == 0:
        print("redsock: rank 0 wrote no results", file=sys.stderr)
        rc = 1
    for s in servers:
        info = s.info
        if info:
            print(f"# reducer {s.name} ({tb.host_addr(s.name)}:{launch.SERVER_PORT}): peak RSS "
                  f"{info.get('VmHWM', float('nan')):.1f} MiB, "
                  f"CPU during the run {info.get('cpu_s', float('nan')):.1f} s")
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    rank_cpu = (children1.ru_utime + children1.ru_stime) - (children0.ru_utime + children0.ru_stime)
    server_cpu = sum(s.info.get("cpu_s", 0.0) for s in servers)
    print(cpu_line(wall, rank_cpu, server_cpu, *cpu_shares(box0, box1)))
    return rc
