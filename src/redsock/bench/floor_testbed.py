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

The worker and reducer processes are this module run as a script
(``python -m redsock.bench.floor_testbed reducer|worker ...``) inside the hosts'
namespaces.
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
from pathlib import Path

from ..errors import ConfigError, PeerFailure
from ..testbed import netns as nx
from ..testbed.cluster import Testbed
from ..testbed.netns import format_rate, parse_rate
from . import report
from .floor import run_threads
from .procs import box_cpu
from .testbed_launch import (GOODPUT_FACTOR, Proc, child_env, set_congestion_control, start_ranks, stop,
                             tail, wait_ranks)

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
    conns = []
    try:
        for _ in range(workers):
            c, _ = srv.accept()
            c.settimeout(_IO_S)
            conns.append(c)
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
        cpu1 = box_cpu()  # the whole machine (every namespace) over the timed iterations
        busy = (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1])
        Path(out).write_text(json.dumps({"times": times[warmup:], "busy": busy}))
    finally:
        for c in conns:
            c.close()


# -- the command (run by ``redsock bench floor --testbed``) ---------------------------

def run(args: argparse.Namespace, sizes: list[int]) -> int:
    from .transport_testbed import _no_interrupts, _terminate_as_interrupt

    workers, servers = args.nprocs, args.servers if args.servers is not None else args.nprocs
    if servers < 1:
        raise ConfigError("--testbed needs --servers >= 1")
    rate = parse_rate(args.rate)
    nx.require_root("redsock bench floor --testbed")
    prefix = args.prefix or f"rsfl{os.getpid()}"
    tb = Testbed(workers=workers, servers=servers, rate=rate, prefix=prefix)
    results = []
    with tempfile.TemporaryDirectory(prefix="redsock-floor-tb-") as tmp, _terminate_as_interrupt():
        logdir = Path(tmp)
        procs: list[Proc] = []
        try:
            print(f"# testbed {prefix}: {workers} workers + {servers} reducers, links at {format_rate(rate)}; "
                  f"TCP {set_congestion_control(tb.up(), args.tcp_cc)}", flush=True)
            for size in sizes:
                floor_s, busy = _floor(tb, size, args, logdir, procs)
                gloo_s = _gloo(tb, size, args, logdir, procs)
                results.append({**_row(size, workers, servers, rate, floor_s, gloo_s), "floor_cpu_busy": busy})
        finally:
            with _no_interrupts():
                stop(procs)
                tb.down()
    print("# floor: plain sockets, each worker S/M bytes to and from each reducer; no sums, no waiting for other "
          "workers, no flow control; gloo: its all-reduce of S bytes on the same testbed")
    print("#     size  floor(us)  floor algbw  %good   cpu   gloo(us)  gloo algbw  floor/gloo  ideal   (algbw in "
          "GB/s; cpu: the whole machine busy during the floor's timed iterations)")
    for r in results:
        print(f"{report.human_size(r['size']):>10} {r['floor_s'] * 1e6:10.0f} {r['floor_algbw']:12.4f} "
              f"{100 * r['floor_good']:5.1f}% {100 * r['floor_cpu_busy']:4.0f}% {r['gloo_s'] * 1e6:10.0f} "
              f"{r['gloo_algbw']:11.4f} {r['max_x_gloo']:10.2f}x {r['ideal']:6.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def _row(size: int, workers: int, servers: int, rate: int, floor_s: float, gloo_s: float) -> dict:
    goodput = rate / 8 * GOODPUT_FACTOR / 1e9  # GB/s per link direction
    return {"mode": "testbed-server", "size": size, "workers": workers, "servers": servers, "rate_bps": rate,
            "floor_s": floor_s, "gloo_s": gloo_s, "floor_algbw": size / floor_s / 1e9,
            "gloo_algbw": size / gloo_s / 1e9, "floor_good": size / floor_s / 1e9 / goodput,
            "max_x_gloo": gloo_s / floor_s, "ideal": 2 * (workers - 1) / workers}


def _floor(tb: Testbed, size: int, args: argparse.Namespace, logdir: Path,
           procs: list[Proc]) -> tuple[float, float]:
    """Median time of the floor's iterations (slowest worker each), and how busy the machine was."""
    nbytes = size // tb.servers
    me = [sys.executable, "-m", "redsock.bench.floor_testbed"]
    reducers = []
    for name in tb.server_names:
        log = logdir / f"floor-{name}.log"
        with log.open("w") as err:
            p = tb.popen(name, [*me, "reducer", tb.host_addr(name), str(FLOOR_PORT), str(tb.workers), str(nbytes),
                                str(args.warmup + args.iters)],
                         stdout=subprocess.PIPE, stderr=err, text=True, env=child_env({}), start_new_session=True)
        reducers.append(Proc(name, p, log))
    procs.extend(reducers)
    for r in reducers:
        if r.proc.stdout is None or r.proc.stdout.readline().strip() != "ready":
            raise PeerFailure(f"floor reducer {r.name} did not start: {tail(r.log)}")
    addrs = ",".join(f"{tb.host_addr(s)}:{FLOOR_PORT}" for s in tb.server_names)
    outs, workers = [], []
    for name in tb.worker_names:
        out, log = logdir / f"floor-{name}.json", logdir / f"floor-{name}.log"
        with log.open("w") as err:
            p = tb.popen(name, [*me, "worker", addrs, str(nbytes), str(args.iters), str(args.warmup), str(out)],
                         stderr=err, env=child_env({}), start_new_session=True)
        workers.append(Proc(name, p, log))
        outs.append(out)
    procs.extend(workers)
    # Reducers exit when their iterations are done; a reducer that dies early closes its
    # sockets, and the workers fail on that at once.
    why = wait_ranks(workers, [], time.monotonic() + args.timeout, args.timeout)
    # A worker is done once its last bytes are back, a moment before their reducer has closed
    # its sockets and exited: wait for that (stopping it first made it fail on a loaded machine).
    end = time.monotonic() + _EXIT_S
    while not why and time.monotonic() < end and any(r.proc.poll() is None for r in reducers):
        time.sleep(0.05)
    stop(reducers)
    bad = [p for p in workers + reducers if p.proc.returncode != 0]
    if why or bad:
        who = f"{bad[0].name} exited with {bad[0].proc.returncode}: {tail(bad[0].log)}" if bad else ""
        raise PeerFailure(f"floor run failed: {why or ''} {who}".strip())
    per_worker = [json.loads(o.read_text()) for o in outs]
    floor_s = statistics.median(max(w["times"][i] for w in per_worker) for i in range(args.iters))
    return floor_s, per_worker[0]["busy"]


def _gloo(tb: Testbed, size: int, args: argparse.Namespace, logdir: Path, procs: list[Proc]) -> float:
    out = logdir / f"gloo-{size}.jsonl"
    cmd = [sys.executable, "-m", "redsock", "bench", "allreduce", "-b", str(size), "-e", str(size), "--algo", "gloo",
           "-n", str(args.iters), "-w", str(args.warmup), "--json", str(out), "--no-progress"]
    ranks, relays = start_ranks(tb, cmd, logdir, tag=f"-gloo{size}")
    procs.extend(ranks)
    why = wait_ranks(ranks, [], time.monotonic() + args.timeout, args.timeout)
    for t in relays:
        t.join(timeout=5)
    rows = report.read_json(out) if out.exists() else []
    if why or not rows:
        raise PeerFailure(f"gloo run failed: {why or 'no result'} {tail(ranks[0].log)}".strip())
    return rows[0].median_s


def main(argv: list[str]) -> int:
    role, rest = argv[0], argv[1:]
    if role == "reducer":
        host, port, workers, nbytes, iters = rest
        reducer_main(host, int(port), int(workers), int(nbytes), int(iters))
    elif role == "worker":
        servers, nbytes, iters, warmup, out = rest
        worker_main(servers.split(","), int(nbytes), int(iters), int(warmup), out)
    else:
        raise SystemExit(f"unknown role {role!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
