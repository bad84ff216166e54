"""``redsock bench soak``: thousands of random all-reduces, every result checked, reducer memory watched.

4 workers and 2 reducers on this machine by default.  Every rank draws the same
sequence of (size, dtype, op, algorithm) from a shared seed; each result is
compared with a float64 reference and, through a digest all-reduce, bitwise
across ranks.  Rank 0 samples the reducers' resident memory after the first
thousand calls and at the end: it must stay flat.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
import zlib

import numpy as np

from .. import ops
from ..errors import ConfigError
from .allreduce.inputs import count_wrong, make_input, reference
from .allreduce.local import launch_local
from .allreduce.rank import SweepProgress
from .procs import proc_status

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]
OPS = ["sum", "avg", "min", "max", "prod"]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        m = re.search(r"VmRSS:\s+(\d+) kB", f.read())
    return int(m.group(1)) * 1024 if m else 0


def run_rank(args: argparse.Namespace) -> int:
    from .. import api
    from ..bootstrap import store_from_env

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = store_from_env(rank, world, 120)
    comm = api.init(rank, world, store)
    algos = ["ring", "small", "server"] if comm.servers is not None else ["ring", "small"]
    reducers = [int(p) for p in os.environ.get("REDSOCK_SOAK_REDUCER_PIDS", "").split(",") if p]
    rng = np.random.default_rng(args.seed)  # the same draws on every rank
    wrong = mismatched = 0
    rss_first: list[int] = []
    reduced = 0  # bytes the reducers received (every rank's contribution to every server call)
    cpu_first = [proc_status(p)["cpu_s"] for p in reducers] if rank == 0 else []
    progress = SweepProgress(rank == 0 and not args.no_progress, args.count)
    t0 = time.monotonic()
    try:
        for i in range(args.count):
            nbytes = int(2 ** rng.uniform(0, np.log2(args.max_bytes)))
            dt = ops.dtype_from_name(DTYPES[rng.integers(len(DTYPES))])
            op = ops.ReduceOp.parse(OPS[rng.integers(len(OPS))])
            algo = algos[rng.integers(len(algos))]
            count = max(1, nbytes // dt.itemsize)
            x = make_input(count, dt, op, rank, i)
            comm.all_reduce(x, op, algorithm=algo)
            reduced += x.nbytes * world if algo == "server" else 0
            wrong += count_wrong(x, reference(count, dt, op, world, i))
            digest = np.array([zlib.crc32(x.tobytes()), -zlib.crc32(x.tobytes())], np.int64)
            comm.all_reduce(digest, "max", algorithm="small")
            mismatched += int(digest[0] != -digest[1])
            if rank == 0 and i + 1 == min(1000, args.count) and reducers:
                rss_first = [rss_bytes(p) for p in reducers]
            progress.advance(f"{i + 1}/{args.count} {algo} {dt.name} {op.name.lower()} {count}")
    finally:
        progress.close()
    totals = np.array([wrong, mismatched], np.int64)
    comm.all_reduce(totals, "sum")
    comm.close()
    if rank != 0:
        return 0
    elapsed = time.monotonic() - t0
    print(f"soak: {args.count} all-reduces on {world} ranks ({', '.join(algos)}) in {elapsed:.0f} s: "
          f"{totals[0]} wrong elements, {totals[1]} calls not bitwise identical across ranks, 0 hangs")
    growth_ok = True
    if reducers and reduced:
        cpu = sum(proc_status(p)["cpu_s"] for p in reducers) - sum(cpu_first)
        print(f"reducers: {cpu:.2f} CPU-s for {reduced / 2**30:.3f} GiB reduced = "
              f"{cpu / (reduced / 2**30):.2f} CPU-s/GiB")
    if reducers and rss_first:
        rss_last = [rss_bytes(p) for p in reducers]
        for pid, a, b in zip(reducers, rss_first, rss_last):
            growth = (b - a) / a if a else 0.0
            growth_ok &= growth < 0.10
            print(f"reducer pid {pid}: RSS {a / 2**20:.1f} MiB after {min(1000, args.count)} calls, "
                  f"{b / 2**20:.1f} MiB at the end "
                  f"({growth * 100:+.1f}%)")
    return 0 if totals.sum() == 0 and growth_ok else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", type=int, default=5000, help="all-reduces to run")
    p.add_argument("--nprocs", type=int, default=4, help="worker ranks to start locally")
    p.add_argument("--reducers", type=int, default=2, help="local reduction servers to start (0: none)")
    p.add_argument("--max-bytes", type=int, default=4 << 20, help="largest all-reduce")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    if "RANK" in os.environ:
        return run_rank(args)
    if args.count < 1 or args.nprocs < 1:
        raise ConfigError("--count and --nprocs must be >= 1")
    servers = []
    try:
        for _ in range(args.reducers):
            proc = subprocess.Popen([sys.executable, "-m", "redsock", "serve", "--host", "127.0.0.1", "--port", "0"],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            m = re.search(r"on (\S+:\d+)", proc.stdout.readline() if proc.stdout else "")
            if not m:
                raise ConfigError("a reduction server did not start")
            servers.append((proc, m.group(1)))
        if servers:
            os.environ["REDSOCK_SERVERS"] = ",".join(a for _, a in servers)
            os.environ["REDSOCK_SOAK_REDUCER_PIDS"] = ",".join(str(p.pid) for p, _ in servers)
        argv = ["bench", "soak", "--count", str(args.count), "--max-bytes", str(args.max_bytes),
                "--seed", str(args.seed)] + (["--no-progress"] if args.no_progress else [])
        return launch_local(args.nprocs, argv, args.timeout)
    finally:
        for proc, _ in servers:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
