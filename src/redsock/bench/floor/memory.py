"""``redsock bench floor --mode memory``: what one host's memory and scheduler allow N local ranks.

Each of N processes copies its buffer of S bytes once (``np.copyto``: every rank's input read once
and its output written once, the least traffic an all-reduce of S bytes can cause) and then meets
the others at a barrier of plain step counters in shared memory (spinning with ``sched_yield``, the
way redsock's arena waits): no data crosses between the ranks and nothing is summed, so no
all-reduce of S bytes among these processes can take less.  redsock's all-reduce (float32 sum,
checked) is timed in the same processes, alternating with the floor, each timed as ``bench
allreduce --back-to-back`` times: a barrier, K back-to-back calls, the slowest rank's total / K,
the median of 3 rounds.  At a few bytes the floor is the cost of one synchronisation of Python
processes; from a few MiB, of the memory's bandwidth.  In between it is loose: each rank's copy
stays in its own core's caches, whereas an all-reduce must move every rank's data to the others.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from ... import ops
from ...errors import PeerFailure
from ...results import human_size, per_half, times_x
from ..allreduce.rank import B2B_ROUNDS
from ..procs import box_cpu, cpu_shares

#: One 64-byte line of the counters per rank (as the arena's), so ranks never write one line.
_LINE_WORDS = 8


def calls_per_round(nbytes: int) -> int:
    """K back-to-back calls per round: about 64 MiB of copies per rank and round, 5 to 2000 calls."""
    return max(5, min(2000, (256 << 20) // (4 * max(nbytes, 1))))


#: Yields between two looks at the clock while a rank waits at the barrier (a few ms of them).
_CHECK_EVERY = (1 << 14) - 1
#: How long a rank waits at the barrier before it gives up (the parent stops every rank when one fails).
BARRIER_TIMEOUT_S = 60.0


def _barrier(steps: memoryview, mine: int, everyone: memoryview, step: int) -> None:
    steps[mine] = step
    spins, since = 0, 0.0
    while min(everyone) < step:
        os.sched_yield()
        spins += 1
        if spins & _CHECK_EVERY == 0:  # a long wait: is a peer, or the parent, gone?
            now = time.monotonic()
            since = since or now
            parent = mp.parent_process()
            if (parent is not None and not parent.is_alive()) or now - since > BARRIER_TIMEOUT_S:
                raise PeerFailure(f"memory floor: a rank did not reach the barrier within {BARRIER_TIMEOUT_S:g}s "
                                  "(or the benchmark's parent process is gone)")


def _rank(rank: int, nprocs: int, sizes: list[int], warmup: int, store_dir: str, counters: Any, out: Any) -> None:
    from ... import api
    from ...bootstrap import FileStore

    steps = memoryview(counters).cast("B").cast("Q")
    everyone = steps[0:nprocs * _LINE_WORDS:_LINE_WORDS]
    mine, step = rank * _LINE_WORDS, 0
    comm = api.init(rank, nprocs, FileStore(store_dir))
    rows = []
    try:
        for nbytes in sizes:
            count = max(1, nbytes // 4)
            src, dst = np.zeros(count, np.float32), np.zeros(count, np.float32)
            x = np.zeros(count, np.float32)
            calls = calls_per_round(nbytes)
            for _ in range(warmup):
                np.copyto(dst, src)
                step += 1
                _barrier(steps, mine, everyone, step)
                comm.all_reduce(x)
            floor, redsock = [], []
            box0 = box_cpu()
            for _ in range(B2B_ROUNDS):  # alternating: the floor's round, then redsock's
                step += 1
                _barrier(steps, mine, everyone, step)
                t0 = time.perf_counter()
                for _ in range(calls):
                    np.copyto(dst, src)
                    step += 1
                    _barrier(steps, mine, everyone, step)
                floor.append((time.perf_counter() - t0) / calls)
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    comm.all_reduce(x)
                redsock.append((time.perf_counter() - t0) / calls)
            busy, steal = cpu_shares(box0, box_cpu())  # (rank 0's reading is the row's)
            x[:] = rank + 1
            comm.all_reduce(x)
            wrong = int(np.count_nonzero(x != nprocs * (nprocs + 1) // 2))
            path = comm.hier.path_taken(x.dtype, count, ops.ReduceOp.SUM) if comm.hier is not None else "-"
            rows.append({"size": nbytes, "calls": calls, "floor_s": floor, "redsock_s": redsock, "wrong": wrong,
                         "path": path, "machine_busy": round(busy, 3), "machine_steal": round(steal, 3)})
        out.put((rank, rows))
    finally:
        comm.close()


def run_memory(nprocs: int, sizes: list[int], warmup: int) -> list[dict]:
    """One row per size: the floor's and redsock's time per call (the slowest rank's, median of
    the rounds), their ratio, redsock's path and wrong elements (rank 0's check, summed over ranks)."""
    from .loopback import _run_all

    ctx = mp.get_context("spawn")
    counters = ctx.RawArray("Q", nprocs * _LINE_WORDS)
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="redsock-floor-") as store_dir:
        procs = [ctx.Process(target=_rank, args=(r, nprocs, sizes, warmup, store_dir, counters, out))
                 for r in range(nprocs)]
        got = _run_all(procs, out, nprocs)
    rows = []
    for i, nbytes in enumerate(sizes):
        per_rank = [got[r][i] for r in range(nprocs)]

        def slowest(key: str) -> float:
            return statistics.median(max(p[key][k] for p in per_rank) for k in range(B2B_ROUNDS))

        floor_s, redsock_s = slowest("floor_s"), slowest("redsock_s")
        rows.append({"mode": "memory", "nprocs": nprocs, "size": nbytes, "calls": per_rank[0]["calls"],
                     "floor_s": floor_s, "redsock_s": redsock_s, "x_floor": redsock_s / floor_s,
                     "path": per_rank[0]["path"], "wrong": sum(p["wrong"] for p in per_rank),
                     "machine_busy": per_rank[0]["machine_busy"], "machine_steal": per_rank[0]["machine_steal"]})
    for key in ("floor", "redsock"):  # (a cliff in the floor is the machine's: its caches)
        halves = per_half({row["size"]: row[f"{key}_s"] for row in rows})
        for row in rows:
            row[f"{key}_x_half"] = halves[row["size"]]
    return rows


def print_memory(rows: list[dict], nprocs: int) -> None:
    print(f"# memory floor: {nprocs} ranks on one host each copy their buffer once (np.copyto) and meet at a "
          "barrier of step counters in shared memory; redsock's all-reduce (float32 sum, checked) in the same "
          "processes, alternating", flush=True)
    print("# back-to-back calls after a barrier, the slowest rank's total / calls, median of "
          f"{B2B_ROUNDS} rounds", flush=True)
    print("# x half size: the time over the time at half the size, where the sizes have it", flush=True)
    print("#     size   calls   floor(us)  redsock(us)  redsock/floor   x half size    path   #wrong  busy  steal",
          flush=True)
    print("#                                                          floor redsock", flush=True)
    for row in rows:
        print(f"{human_size(row['size']):>10} {row['calls']:7d} {row['floor_s'] * 1e6:11.1f} "
              f"{row['redsock_s'] * 1e6:12.1f} {row['x_floor']:13.2f}x  {times_x(row['floor_x_half']):>6} "
              f"{times_x(row['redsock_x_half']):>7}  {row['path']:<6} {row['wrong']:6d} {row['machine_busy']:5.0%} "
              f"{row['machine_steal']:6.0%}",
              flush=True)
