"""``redsock bench floor --testbed``: the reduction servers' traffic, moved by plain sockets in the emulated cluster.

Per iteration every worker host streams S/M bytes to each of the M reducer hosts
while it receives S/M bytes back from each; a reducer returns a worker's bytes
as they arrive.  Nothing else happens: no sums, no waiting for the other
workers, no credits.  So this is the pattern's cost in this machine's kernel and
CPU, not a strict lower bound: its flows are not balanced against each other, and
a reduction server whose flow control evens them out can do better (redsock's
does at 4+4 hosts on 1 Gbit/s).  gloo's all-reduce of S bytes then runs on the
same testbed, and the machine's CPU load during the floor says whether the
pattern itself is CPU-bound here.

With ``--mode fanin`` (``both`` runs both) it is the reducers' small-message
pattern instead, for each worker count N of ``--workers`` on a testbed of N
worker hosts and ``--servers`` (default N) reducer hosts, the shape of the
reducers' own runs: every worker sends 8 bytes to one plain-socket reducer
process on s0, which sends the (checked) sum back to each; then redsock's
``server`` all-reduce of 8 bytes and gloo's on the same hosts.  The three run
in alternating turns (floor, reducers, gloo; again), each one's fastest turn
counting.  Every figure is per call of back-to-back calls, slowest rank, as
``bench allreduce --back-to-back`` times them.  So the reducers are compared
with plain sockets on the same veths, bridge and shapers, in one run: the
loopback fan-in (``bench floor --mode fanin``) has none of those hops.

The worker and reducer processes are this module run as a script
(``python -m redsock.bench.floor.testbed reducer|worker|fanin-reducer|fanin-worker ...``)
inside the hosts' namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ... import results as report
from ...errors import ConfigError, PeerFailure
from ...testbed import launch
from ...testbed import netns as nx
from ...testbed.cluster import Testbed
from ...testbed.netns import format_rate, parse_rate
from ..allreduce.rank import B2B_ROUNDS
from ..bounds import GOODPUT_FACTOR
from ..procs import box_cpu, cpu_shares
from .loopback import accept_n, fanin_call, fanin_join, fanin_reduce, run_threads

FLOOR_PORT = 7800
_ACCEPT_S = 120.0
_IO_S = 120.0
_EXIT_S = 30.0  #: how long a reducer may take to exit after its workers are done
_BUF = 1 << 20


def _recv_exact(sock: socket.socket, view: memoryview, nbytes: int, first=None) -> None:
    """Receive ``nbytes`` through ``view`` (reused); call ``first()`` once the first bytes are in."""
    left = nbytes
    while left:
        n = sock.recv_into(view[:min(left, view.nbytes)])
        if n == 0:
            raise PeerFailure(f"floor: {sock.getpeername()} closed the connection")
        left -= n
        if first is not None:
            first()
            first = None


def _send_n(sock: socket.socket, data: memoryview, nbytes: int) -> None:
    left = nbytes
    while left:
        n = min(left, data.nbytes)
        sock.sendall(data[:n])
        left -= n


def reducer_main(host: str, port: int, workers: int, nbytes: int, iters: int) -> None:
    """Echo ``nbytes`` per iteration to each of ``workers`` connections, starting as they arrive."""
    srv = socket.create_server((host, port))
    srv.settimeout(_ACCEPT_S)
    print("ready", flush=True)
    conns: list[socket.socket] = []
    try:
        conns = accept_n(srv, workers, _IO_S, nodelay=False)
        jobs = []
        for c in conns:
            started = threading.Semaphore(0)

            def rx(c=c, started=started) -> None:
                view = memoryview(bytearray(_BUF))
                for _ in range(iters):
                    _recv_exact(c, view, nbytes, started.release)

            def tx(c=c, started=started) -> None:
                data = memoryview(bytes(_BUF))
                for _ in range(iters):
                    if not started.acquire(timeout=_IO_S):
                        raise PeerFailure("floor: a worker sent nothing")
                    _send_n(c, data, nbytes)

            jobs += [rx, tx]
        run_threads(jobs)
    finally:
        srv.close()
        for c in conns:
            c.close()


def worker_main(servers: list[str], nbytes: int, iters: int, warmup: int, out: str) -> None:
    conns = []
    try:
        for addr in servers:
            host, port = addr.rsplit(":", 1)
            c = socket.create_connection((host, int(port)), timeout=_ACCEPT_S)
            c.settimeout(_IO_S)
            conns.append(c)
        data = memoryview(bytes(_BUF))
        times = []
        for it in range(warmup + iters):
            if it == warmup:
                cpu0 = box_cpu()
            t0 = time.perf_counter()
            jobs = []
            for c in conns:
                jobs.append(lambda c=c: _send_n(c, data, nbytes))
                jobs.append(lambda c=c: _recv_exact(c, memoryview(bytearray(_BUF)), nbytes))
            run_threads(jobs)
            times.append(time.perf_counter() - t0)
        busy, steal = cpu_shares(cpu0, box_cpu())  # the whole machine (every namespace) over the timed iterations
        Path(out).write_text(json.dumps({"times": times[warmup:], "busy": busy, "steal": steal}))
    finally:
        for c in conns:
            c.close()


def fanin_reducer_main(host: str, port: int, workers: int, rounds: int) -> None:
    srv = socket.create_server((host, port))
    srv.settimeout(_ACCEPT_S)
    print("ready", flush=True)
    fanin_reduce(srv, workers, rounds)


def fanin_worker_main(addr: str, rank: int, workers: int, warmup: int, calls: int, out: str) -> None:
    """``warmup`` calls, then B2B_ROUNDS blocks of ``calls`` back-to-back calls: the time
    per call of each block (the fan-in keeps the workers in step, round by round)."""
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=_ACCEPT_S)
    try:
        sock.settimeout(_IO_S)
        fanin_join(sock, rank)
        buf = bytearray(8)
        for it in range(warmup):
            fanin_call(sock, rank, workers, it, buf)
        it, per_call, cpu0 = warmup, [], box_cpu()
        for _ in range(B2B_ROUNDS):
            t0 = time.perf_counter()
            for _ in range(calls):
                fanin_call(sock, rank, workers, it, buf)
                it += 1
            per_call.append((time.perf_counter() - t0) / calls)
        busy, steal = cpu_shares(cpu0, box_cpu())
        Path(out).write_text(json.dumps({"per_call": per_call, "busy": busy, "steal": steal}))
    finally:
        sock.close()


# -- the command (run by ``redsock bench floor --testbed``) ---------------------------

def run(args: argparse.Namespace, sizes: list[int], counts: list[int]) -> int:
    """``--mode ring`` (the reducers' bulk traffic), ``fanin`` (their small messages), or both."""
    if args.servers is not None and args.servers < 1:
        raise ConfigError("--testbed needs --servers >= 1")
    rate = parse_rate(args.rate)
    nx.require_root("redsock bench floor --testbed")
    results = []
    if args.mode in ("ring", "both"):
        results += _run_bulk(args, sizes, rate)
    if args.mode in ("fanin", "both"):
        results += _run_fanin(args, counts, rate)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


@contextmanager
def _testbed(workers: int, servers: int, rate: int, prefix: str, tcp_cc: str
             ) -> Iterator[tuple[Testbed, Path, list[launch.Proc]]]:
    """A testbed up, a log folder and a list for the processes started in it: all of them
    stopped and the testbed torn down however the body ends (errors, Ctrl-C, SIGTERM)."""
    tb = Testbed(workers=workers, servers=servers, rate=rate, prefix=prefix)
    procs: list[launch.Proc] = []
    with tempfile.TemporaryDirectory(prefix="redsock-floor-tb-") as tmp, launch.terminate_as_interrupt():
        try:
            tb.up()
            print(f"# testbed {prefix}: {workers} workers + {servers} reducers, links at {format_rate(rate)}; "
                  f"TCP {launch.set_congestion_control(tb, tcp_cc)}", flush=True)
            yield tb, Path(tmp), procs
        finally:
            with launch.no_interrupts():
                launch.stop(procs)
                tb.down()


def _run_bulk(args: argparse.Namespace, sizes: list[int], rate: int) -> list[dict]:
    workers, servers = args.nprocs, args.servers if args.servers is not None else args.nprocs
    results = []
    with _testbed(workers, servers, rate, args.prefix or f"rsfl{os.getpid()}", args.tcp_cc) as (tb, logdir, procs):
        for size in sizes:
            floor_s, busy, steal = _floor(tb, size, args, logdir, procs)
            gloo_s = _gloo(tb, size, args, logdir, procs)
            results.append({**_row(size, workers, servers, rate, floor_s, gloo_s), "floor_cpu_busy": busy,
                            "floor_cpu_steal": steal})
    print("# floor: plain sockets, each worker S/M bytes to and from each reducer; no sums, no waiting for other "
          "workers, no flow control; gloo: its all-reduce of S bytes on the same testbed")
    print("#     size  floor(us)  floor algbw  %good   cpu steal   gloo(us)  gloo algbw  floor/gloo  ideal   (algbw "
          "in GB/s; cpu: the whole machine busy during the floor's timed iterations; steal: of that, the share "
          "the hypervisor gave other guests)")
    for r in results:
        print(f"{report.human_size(r['size']):>10} {r['floor_s'] * 1e6:10.0f} {r['floor_algbw']:12.4f} "
              f"{100 * r['floor_good']:5.1f}% {report.percent(r['floor_cpu_busy']):>5} "
              f"{report.percent(r['floor_cpu_steal']):>5} {r['gloo_s'] * 1e6:10.0f} "
              f"{r['gloo_algbw']:11.4f} {r['max_x_gloo']:10.2f}x {r['ideal']:6.2f}x")
    return results


#: Turns of the fan-in comparison on one testbed: the floor, then redsock's reducers and gloo,
#: again and again; each one's fastest turn counts (a plain-socket round waits on this VM's
#: vCPU wake-ups, and its time swings 2-4x from one run to the next).
FANIN_TURNS = 2


def _run_fanin(args: argparse.Namespace, counts: list[int], rate: int) -> list[dict]:
    base = args.prefix or f"rsfi{os.getpid() % 100000}"
    warmup, calls = args.warmup * 50, args.iters * 100  # as the loopback fan-in counts them
    results = []
    for n in counts:
        servers = args.servers if args.servers is not None else n
        floors, runs = [], []
        with _testbed(n, servers, rate, f"{base}n{n}", args.tcp_cc) as (tb, logdir, procs):
            reducers = launch.start_servers(tb, logdir, time.monotonic() + args.timeout)
            procs.extend(reducers)
            for turn in range(FANIN_TURNS):
                floors.append(_fanin_floor(tb, warmup, calls, args, logdir, procs, turn))
                runs.append(_fanin_reducers(tb, warmup, calls, args, logdir, procs, reducers, turn))
        floor = min(floors, key=lambda f: f["s"])
        server = min((r["server"] for r in runs), key=lambda r: r.median_s)
        gloo = min((r["gloo"] for r in runs), key=lambda r: r.median_s)
        results.append({"mode": "testbed-fanin", "workers": n, "servers": servers, "rate_bps": rate,
                        "floor_us": floor["s"] * 1e6, "server_us": server.median_s * 1e6, "gloo_us": gloo.median_s * 1e6,
                        "floor_turns_us": [f["s"] * 1e6 for f in floors],
                        "server_turns_us": [r["server"].median_s * 1e6 for r in runs],
                        "gloo_turns_us": [r["gloo"].median_s * 1e6 for r in runs],
                        "server_x_floor": server.median_s / floor["s"], "server_x_gloo": server.median_s / gloo.median_s,
                        "floor_busy": floor["busy"], "server_busy": server.extra.get("machine_busy"),
                        "gloo_busy": gloo.extra.get("machine_busy"), "floor_steal": floor["steal"],
                        "server_steal": server.extra.get("machine_steal"),
                        "gloo_steal": gloo.extra.get("machine_steal")})
    print(f"# fan-in on the testbed, links at {format_rate(rate)}: N worker hosts + M reducer hosts; floor: plain "
          f"sockets, 8 bytes from every worker to one reducer process on s0, the checked sum back; reducers: "
          f"redsock's 8-byte 'server' all-reduce; gloo: its all-reduce on the same hosts.  Per call of back-to-back "
          f"calls, slowest rank; {FANIN_TURNS} alternating turns, each one's fastest counts (all turns in "
          f"parentheses); busy: the whole machine during the counted turn; steal: of that, the share the "
          f"hypervisor gave other guests")
    print("#  workers reducers  floor(us)  reducers(us)  gloo(us)  reducers/floor  reducers/gloo  "
          "busy floor/reducers/gloo  steal  (turns: floor; reducers; gloo)")
    for r in results:
        turns = "; ".join("/".join(f"{v:.0f}" for v in r[k]) for k in ("floor_turns_us", "server_turns_us",
                                                                        "gloo_turns_us"))
        print(f"{r['workers']:10d} {r['servers']:8d} {r['floor_us']:10.1f} {r['server_us']:13.1f} {r['gloo_us']:9.1f} "
              f"{r['server_x_floor']:14.2f}x {r['server_x_gloo']:13.2f}x  "
              f"{'/'.join(report.percent(r[k + '_busy']) for k in ('floor', 'server', 'gloo'))}  "
              f"{'/'.join(report.percent(r[k + '_steal']) for k in ('floor', 'server', 'gloo'))}  ({turns})")
    if len(results) > 1:
        a, z = results[0], results[-1]
        print(f"# from {a['workers']} to {z['workers']} workers: floor x{z['floor_us'] / a['floor_us']:.2f}, "
              f"reducers x{z['server_us'] / a['server_us']:.2f}, gloo x{z['gloo_us'] / a['gloo_us']:.2f}")
    return results


def _row(size: int, workers: int, servers: int, rate: int, floor_s: float, gloo_s: float) -> dict:
    goodput = rate / 8 * GOODPUT_FACTOR / 1e9  # GB/s per link direction
    return {"mode": "testbed-server", "size": size, "workers": workers, "servers": servers, "rate_bps": rate,
            "floor_s": floor_s, "gloo_s": gloo_s, "floor_algbw": size / floor_s / 1e9,
            "gloo_algbw": size / gloo_s / 1e9, "floor_good": size / floor_s / 1e9 / goodput,
            "max_x_gloo": gloo_s / floor_s, "ideal": 2 * (workers - 1) / workers}


def _plain_run(tb: Testbed, args: argparse.Namespace, logdir: Path, procs: list[launch.Proc], what: str,
               reducers: list[tuple[str, list[str]]], workers: list[tuple[str, list[str]]]) -> list[dict]:
    """Run plain-socket reducers (this module's roles; each says "ready"), then workers (each
    writes its JSON to a path added to its arguments) on their hosts; the workers' JSON."""
    me = [sys.executable, "-m", "redsock.bench.floor.testbed"]
    started = []
    for name, argv in reducers:
        log = logdir / f"{what}-{name}.log"
        with log.open("w") as err:
            p = tb.popen(name, [*me, *argv], stdout=subprocess.PIPE, stderr=err, text=True, env=launch.child_env({}),
                         start_new_session=True)
        started.append(launch.Proc(name, p, log))
    procs.extend(started)
    for r in started:
        if r.proc.stdout is None or r.proc.stdout.readline().strip() != "ready":
            raise PeerFailure(f"{what} reducer {r.name} did not start: {launch.tail(r.log)}")
    outs, running = [], []
    for name, argv in workers:
        out, log = logdir / f"{what}-{name}.json", logdir / f"{what}-{name}.log"
        with log.open("w") as err:
            p = tb.popen(name, [*me, *argv, str(out)], stderr=err, env=launch.child_env({}), start_new_session=True)
        running.append(launch.Proc(name, p, log))
        outs.append(out)
    procs.extend(running)
    # Reducers exit when their rounds are done; a reducer that dies early closes its
    # sockets, and the workers fail on that at once.
    why = launch.wait_ranks(running, [], time.monotonic() + args.timeout, args.timeout)
    # A worker is done once its last bytes are back, a moment before their reducer has closed
    # its sockets and exited: wait for that (stopping it first made it fail on a loaded machine).
    end = time.monotonic() + _EXIT_S
    while not why and time.monotonic() < end and any(r.proc.poll() is None for r in started):
        time.sleep(0.05)
    launch.stop(started)
    bad = [p for p in running + started if p.proc.returncode != 0]
    if why or bad:
        who = f"{bad[0].name} exited with {bad[0].proc.returncode}: {launch.tail(bad[0].log)}" if bad else ""
        raise PeerFailure(f"{what} run failed: {why or ''} {who}".strip())
    return [json.loads(o.read_text()) for o in outs]


def _floor(tb: Testbed, size: int, args: argparse.Namespace, logdir: Path,
           procs: list[launch.Proc]) -> tuple[float, float, float]:
    """Median time of the floor's iterations (slowest worker each), and how busy the machine
    was (and of that, stolen)."""
    nbytes = size // tb.servers
    addrs = ",".join(f"{tb.host_addr(s)}:{FLOOR_PORT}" for s in tb.server_names)
    per_worker = _plain_run(
        tb, args, logdir, procs, f"floor{size}",
        [(name, ["reducer", tb.host_addr(name), str(FLOOR_PORT), str(tb.workers), str(nbytes),
                 str(args.warmup + args.iters)]) for name in tb.server_names],
        [(name, ["worker", addrs, str(nbytes), str(args.iters), str(args.warmup)]) for name in tb.worker_names])
    floor_s = statistics.median(max(w["times"][i] for w in per_worker) for i in range(args.iters))
    return floor_s, per_worker[0]["busy"], per_worker[0]["steal"]


def _fanin_floor(tb: Testbed, warmup: int, calls: int, args: argparse.Namespace, logdir: Path,
                 procs: list[launch.Proc], turn: int) -> dict:
    """The plain-socket fan-in through s0: time per call (slowest worker per block, median
    of the blocks) and how busy the machine was (and of that, stolen)."""
    host = tb.server_names[0]
    addr = f"{tb.host_addr(host)}:{FLOOR_PORT}"
    per_worker = _plain_run(
        tb, args, logdir, procs, f"fanin{turn}",
        [(host, ["fanin-reducer", tb.host_addr(host), str(FLOOR_PORT), str(tb.workers),
                 str(warmup + B2B_ROUNDS * calls)])],
        [(name, ["fanin-worker", addr, str(rank), str(tb.workers), str(warmup), str(calls)])
         for rank, name in enumerate(tb.worker_names)])
    per_call = statistics.median(max(w["per_call"][k] for w in per_worker) for k in range(B2B_ROUNDS))
    return {"s": per_call, "busy": per_worker[0]["busy"], "steal": per_worker[0]["steal"]}


def _fanin_reducers(tb: Testbed, warmup: int, calls: int, args: argparse.Namespace, logdir: Path,
                    procs: list[launch.Proc], reducers: list[launch.Proc], turn: int) -> dict[str, report.Row]:
    """redsock's 8-byte all-reduce through the reduction servers, and gloo's, timed as the
    fan-in floor is: rank 0's rows by algorithm."""
    out = logdir / f"fanin-redsock-{turn}.jsonl"
    cmd = [sys.executable, "-m", "redsock", "bench", "allreduce", "-b", "8", "-e", "8", "--algo", "server,gloo",
           "--back-to-back", "-n", str(calls), "-w", str(warmup), "--json", str(out), "--no-progress"]
    ranks, relays = launch.start_ranks(tb, cmd, logdir, tag=f"-fanin{turn}")
    procs.extend(ranks)
    why = launch.wait_ranks(ranks, reducers, time.monotonic() + args.timeout, args.timeout)
    for t in relays:
        t.join(timeout=5)
    rows = {r.algo: r for r in report.read_json(out)} if out.exists() else {}
    if why or set(rows) != {"server", "gloo"}:
        raise PeerFailure(f"reducers' fan-in run failed: {why or 'no result'} {launch.tail(ranks[0].log)}".strip())
    return rows


def _gloo(tb: Testbed, size: int, args: argparse.Namespace, logdir: Path, procs: list[launch.Proc]) -> float:
    out = logdir / f"gloo-{size}.jsonl"
    cmd = [sys.executable, "-m", "redsock", "bench", "allreduce", "-b", str(size), "-e", str(size), "--algo", "gloo",
           "-n", str(args.iters), "-w", str(args.warmup), "--json", str(out), "--no-progress"]
    ranks, relays = launch.start_ranks(tb, cmd, logdir, tag=f"-gloo{size}")
    procs.extend(ranks)
    why = launch.wait_ranks(ranks, [], time.monotonic() + args.timeout, args.timeout)
    for t in relays:
        t.join(timeout=5)
    rows = report.read_json(out) if out.exists() else []
    if why or not rows:
        raise PeerFailure(f"gloo run failed: {why or 'no result'} {launch.tail(ranks[0].log)}".strip())
    return rows[0].median_s


def main(argv: list[str]) -> int:
    role, rest = argv[0], argv[1:]
    if role == "reducer":
        host, port, workers, nbytes, iters = rest
        reducer_main(host, int(port), int(workers), int(nbytes), int(iters))
    elif role == "worker":
        servers, nbytes, iters, warmup, out = rest
        worker_main(servers.split(","), int(nbytes), int(iters), int(warmup), out)
    elif role == "fanin-reducer":
        host, port, workers, rounds = rest
        fanin_reducer_main(host, int(port), int(workers), int(rounds))
    elif role == "fanin-worker":
        addr, rank, workers, warmup, calls, out = rest
        fanin_worker_main(addr, int(rank), int(workers), int(warmup), int(calls), out)
    else:
        raise SystemExit(f"unknown role {role!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
