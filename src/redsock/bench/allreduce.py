"""``redsock bench allreduce``: an nccl-tests-style sweep, redsock against gloo in the same run.

Run once per rank with the torchrun environment, under ``torchrun``, or with
``--nprocs N`` to start N local ranks.  Every algorithm named in ``--algo`` is
measured on the same ranks, one size at a time, so ratios compare like with
like on a noisy machine.  Rank 0 prints the tables; ``--check`` validates every
result against a float64 numpy reference and across ranks (bitwise).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import zlib
from typing import Any

import numpy as np

from .. import ops
from ..config import parse_size
from ..errors import ConfigError, RedsockError
from .procs import BoxCpu, box_cpu, cpu_shares, stop_processes

REDSOCK_ALGOS = ("auto", "ring", "small", "server", "hier")
CHECK_BLOCK = 1 << 22  # elements checked at a time


# -- inputs and references --------------------------------------------------------

#: Every input repeats with this period (``i * 7 % 11`` and ``i % 2`` below), so an input, and
#: its reference, is one period tiled: building them costs a copy, not integer arithmetic per element.
INPUT_PERIOD = 22


def make_input(count: int, dtype: np.dtype, op: ops.ReduceOp, rank: int, seed: int, start: int = 0) -> np.ndarray:
    """Elements ``start .. start+count`` of a rank's input: values whose exact reduction is
    representable in every dtype (small integers; for prod, ones and twos), so a float64
    reference is exact too."""
    return _tiled(_input_period(dtype, op, rank, seed, start), count)


def _tiled(period: np.ndarray, count: int) -> np.ndarray:
    """``count`` elements of ``period`` repeated (np.resize concatenates one array per period: slow)."""
    return np.tile(period, -(-count // period.size))[:count]


def _input_period(dtype: np.dtype, op: ops.ReduceOp, rank: int, seed: int, start: int) -> np.ndarray:
    """Elements ``start .. start+INPUT_PERIOD`` of a rank's input."""
    i = np.arange(start % INPUT_PERIOD, start % INPUT_PERIOD + INPUT_PERIOD, dtype=np.int64)
    if op is ops.ReduceOp.PROD:
        vals = 1 + ((i + rank + seed) % 2)
    else:
        vals = (i * 7 + rank * 3 + seed) % 11 - 5
        if dtype == np.uint8:
            vals = np.abs(vals)
    return vals.astype(dtype)


def timing_input(count: int, dtype: np.dtype, op: ops.ReduceOp, rank: int) -> np.ndarray:
    """A rank's input for the timed calls, which reduce the same buffer in place again and
    again: values the op leaves as they are (0 for sum and avg, 1 for prod; min and max settle
    after one call), so no call computes with overflowed values (the check's inputs grow
    N-fold per sum: float32 reaches inf after ~60 calls on 4 ranks, and numpy warns)."""
    if op in (ops.ReduceOp.SUM, ops.ReduceOp.AVG):
        return np.zeros(count, dtype)
    if op is ops.ReduceOp.PROD:
        return np.ones(count, dtype)
    return make_input(count, dtype, op, rank, 0)


def reference(count: int, dtype: np.dtype, op: ops.ReduceOp, world: int, seed: int, start: int = 0) -> np.ndarray:
    """The float64 result for elements ``start .. start+count``."""
    period = reference_of([_input_period(dtype, op, r, seed, start).astype(np.float64) for r in range(world)],
                          op, dtype)
    return _tiled(period, count)


def reference_of(xs: list[np.ndarray], op: ops.ReduceOp, dtype: np.dtype) -> np.ndarray:
    """The float64 reduction of the ranks' inputs ``xs`` (float64 arrays) for a ``dtype`` all-reduce."""
    if op in (ops.ReduceOp.SUM, ops.ReduceOp.AVG):
        ref = np.sum(xs, axis=0)
        if op is ops.ReduceOp.AVG:
            ref = np.trunc(ref / len(xs)) if dtype.kind in "iu" else ref / len(xs)
    elif op is ops.ReduceOp.PROD:
        ref = np.prod(xs, axis=0)
    elif op is ops.ReduceOp.MIN:
        ref = np.min(xs, axis=0)
    else:
        ref = np.max(xs, axis=0)
    return ref


def count_wrong(result: np.ndarray, ref64: np.ndarray) -> int:
    """Elements further than one rounding (1 ulp of the dtype) from the float64 reference."""
    if result.dtype.kind in "iu":
        return int(np.count_nonzero(result.astype(np.float64) != ref64))
    want = ref64.astype(result.dtype)
    # An element with the bits of the rounded reference is within half an ulp: only the others
    # need the float64 arithmetic (most results are exact, so this is one compare per element).
    bits = np.dtype(f"u{result.itemsize}")
    suspects = np.flatnonzero(result.view(bits) != want.view(bits))
    got = result[suspects].astype(np.float64)
    ulp = np.spacing(np.abs(want[suspects])).astype(np.float64)
    return int(np.count_nonzero(np.abs(got - ref64[suspects]) > ulp))


# -- one rank -------------------------------------------------------------------

class _Gloo:
    """gloo through torch.distributed on the same ranks (the peer measured side by side)."""

    def __init__(self, store: Any, rank: int, world: int, timeout_s: float):
        import datetime

        import torch.distributed as dist

        self.dist = dist
        dist.init_process_group("gloo", store=dist.PrefixStore("bench-gloo", store), rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))

    def all_reduce(self, x: np.ndarray, op: ops.ReduceOp) -> None:
        import torch

        if op is ops.ReduceOp.AVG:
            raise ConfigError("gloo has no avg")
        t = _as_tensor(x)
        rop = {ops.ReduceOp.SUM: self.dist.ReduceOp.SUM, ops.ReduceOp.MIN: self.dist.ReduceOp.MIN,
               ops.ReduceOp.MAX: self.dist.ReduceOp.MAX, ops.ReduceOp.PROD: self.dist.ReduceOp.PRODUCT}[op]
        self.dist.all_reduce(t, op=rop)
        del torch

    def close(self) -> None:
        self.dist.destroy_process_group()


def _as_tensor(x: np.ndarray):
    import torch

    if x.dtype == ops.bfloat16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def _time_algo(fn, x: np.ndarray, warmup: int, iters: int, comm, back_to_back: bool = False) -> list[float]:
    for _ in range(warmup):
        fn(x)
    comm.barrier()
    if back_to_back:
        return _time_back_to_back(fn, x, iters, comm)
    times = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter()
        fn(x)
        times[i] = time.perf_counter() - t0
    comm.all_reduce(times, "max", algorithm="small" if times.nbytes <= 65536 else "ring")  # the slowest rank counts
    return times.tolist()


B2B_ROUNDS = 3


def _time_back_to_back(fn, x: np.ndarray, iters: int, comm) -> list[float]:
    """Time per call of ``iters`` back-to-back calls (the slowest rank's total), once per
    round after a barrier, as MPI benchmarks time latency: a rank that waits in one call
    for a rank the scheduler paused is not counted twice over, as per-call maxima would."""
    per_call = np.empty(B2B_ROUNDS)
    for k in range(B2B_ROUNDS):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn(x)
        per_call[k] = (time.perf_counter() - t0) / iters
    comm.all_reduce(per_call, "max", algorithm="small")
    return per_call.tolist()


def _ranks_busy(comm, cpu_s: float, wall_s: float) -> float:
    """The share of this machine's cores the ranks used while one row was timed (all ranks'
    CPU over the slowest one's wall time): a row whose ranks alone keep the cores busy
    measures the CPU, not the network (``plan --lab`` classes it so)."""
    both = np.array([cpu_s, wall_s])
    comm.all_reduce(both[:1], "sum", algorithm="small")
    comm.all_reduce(both[1:], "max", algorithm="small")
    return round(float(both[0] / max(both[1], 1e-9) / (os.cpu_count() or 1)), 3)


def _machine_shares(comm, before: BoxCpu, after: BoxCpu) -> tuple[float, float]:
    """The shares of the whole machine's cores busy, and stolen by the hypervisor, while one
    row was timed (rank 0's reading of /proc/stat, on every rank): unlike ``ranks_busy`` it
    counts the reducers, the kernel's network work and anything else running."""
    shares = np.array(cpu_shares(before, after))
    comm.broadcast(shares, 0)
    return round(float(shares[0]), 3), round(float(shares[1]), 3)


def run_rank(args: argparse.Namespace) -> int:
    from .. import api
    from ..bootstrap import store_from_env
    from . import report

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = float(os.environ.get("REDSOCK_TIMEOUT_S", "120"))
    store = store_from_env(rank, world, timeout)
    comm = api.init(rank, world, store)
    dtype, op, algos, sizes = _sweep(args)
    gloo = _Gloo(store, rank, world, timeout) if "gloo" in algos else None
    rows = []
    progress = _progress(rank == 0 and not args.no_progress, len(sizes) * len(algos))
    try:
        for nbytes in sizes:
            count = nbytes // dtype.itemsize
            for algo in algos:
                if algo == "gloo":
                    if op is ops.ReduceOp.AVG:
                        continue
                    fn = lambda x: gloo.all_reduce(x, op)  # noqa: E731
                else:
                    fn = lambda x, algo=algo: comm.all_reduce(x, op, algorithm=None if algo == "auto" else algo)  # noqa: E731
                x = timing_input(count, dtype, op, rank)
                warm, iters = _iters_for(nbytes, args)
                cpu0, wall0, box0 = time.process_time(), time.perf_counter(), box_cpu()
                times = _time_algo(fn, x, warm, iters, comm, args.back_to_back)
                busy = _ranks_busy(comm, time.process_time() - cpu0, time.perf_counter() - wall0)
                machine, steal = _machine_shares(comm, box0, box_cpu())
                wrong = _check(fn, count, dtype, op, rank, world, comm) if args.check else -1
                extra = route(comm, nbytes, algo) if algo != "gloo" else {"scheme": "flat", "inter": "ring"}
                extra["ranks_busy"] = busy
                extra["machine_busy"] = machine
                extra["machine_steal"] = steal
                rows.append(report.Row.from_times("gloo" if algo == "gloo" else "redsock", algo, world, nbytes,
                                                  count, dtype.name, op.name.lower(), times, wrong, extra=extra))
                progress.advance(f"{algo} {nbytes} B")
    finally:
        progress.close()
        if gloo is not None:
            gloo.close()
        comm.close()
    if rank == 0:
        print(report.format_table(rows))
        if len({r.algo for r in rows}) > 1 and any(r.algo == "gloo" for r in rows):
            print(report.compare_table(rows, baseline_algo="gloo"))
        if args.json:
            report.write_json(rows, args.json)
        if args.plot:
            report.plot(rows, args.plot)
        wrong = sum(max(r.wrong, 0) for r in rows)
        if args.check:
            print(f"# check: {wrong} wrong elements over {len(rows)} rows")
        return 1 if wrong else 0
    return 0


def route(comm, nbytes: int, algo: str) -> dict[str, str]:
    """How ``comm`` runs an all-reduce of ``nbytes`` asked as ``algo``: ``scheme`` "flat" (every
    rank on the network on its own) or "hierarchical" (reduced inside each host first), and
    ``inter``, the algorithm between hosts (for a hierarchical one, its inter-host group's
    choice for one shard; "none" when no host link is crossed).  The benchmarks' bounds
    follow from it."""
    chosen = comm.choose_algorithm(nbytes, None if algo == "auto" else algo)
    if chosen != "hier":
        return {"scheme": "flat", "inter": chosen}
    return {"scheme": "hierarchical", "inter": comm.hier.inter_algorithm(nbytes)}


def _check(fn, count: int, dtype: np.dtype, op: ops.ReduceOp, rank: int, world: int, comm) -> int:
    """Wrong elements on any rank (vs the float64 reference), plus every element if ranks differ."""
    seed = 1
    x = make_input(count, dtype, op, rank, seed)
    fn(x)
    # In blocks: float64 references of a whole 256 MiB buffer take several GB per rank.
    wrong = sum(count_wrong(x[lo:lo + CHECK_BLOCK], reference(min(CHECK_BLOCK, count - lo), dtype, op, world, seed, lo))
                for lo in range(0, count, CHECK_BLOCK))
    digest = zlib.crc32(x.tobytes())
    stats = np.array([wrong, digest, -digest], dtype=np.int64)
    comm.all_reduce(stats[:1], "sum")
    comm.all_reduce(stats[1:], "max")
    identical = stats[1] == -stats[2]  # max == min of the digests
    return int(stats[0]) + (0 if identical else count)


def _sweep(args: argparse.Namespace) -> tuple[np.dtype, ops.ReduceOp, list[str], list[int]]:
    """The dtype, op, algorithms and sizes the command asks for, or a ConfigError saying what
    is wrong (checked by the launcher too, so that a bad option is one message, not one per rank)."""
    dtype = ops.dtype_from_name(args.dtype)
    op = ops.ReduceOp.parse(args.op)
    algos = [a.strip() for a in args.algo.split(",") if a.strip()]
    for a in algos:
        if a not in REDSOCK_ALGOS + ("gloo",):
            raise ConfigError(f"unknown --algo {a!r}; choose from {', '.join(REDSOCK_ALGOS + ('gloo',))}")
    if args.iters < 1 or args.warmup < 0:
        raise ConfigError(f"need -n >= 1 and -w >= 0, got -n {args.iters} -w {args.warmup}")
    return dtype, op, algos, _sizes(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor,
                                    dtype.itemsize)


def _sizes(lo: int, hi: int, factor: int, itemsize: int) -> list[int]:
    if lo > hi or factor < 2:
        raise ConfigError("need -b <= -e and -f >= 2")
    out, n = [], max(lo, itemsize)
    while n <= hi:
        out.append(n - n % itemsize)
        n *= factor
    return out


def _iters_for(nbytes: int, args: argparse.Namespace) -> tuple[int, int]:
    """Fewer iterations for huge sizes so a sweep stays bounded (nccl-tests' -n/-w as upper bounds)."""
    if nbytes >= 64 << 20:
        return max(1, min(args.warmup, 2)), max(3, min(args.iters, 8))
    return args.warmup, args.iters


class _progress:
    def __init__(self, enabled: bool, total: int):
        self.bar = None
        if enabled and total > 1:
            try:
                from rich.progress import Progress

                self.bar = Progress(transient=True)
                self.bar.start()
                self.task = self.bar.add_task("all-reduce sweep", total=total)
            except ImportError:
                self.bar = None

    def advance(self, what: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=what)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# -- local launcher ---------------------------------------------------------------

def launch_local(nprocs: int, argv: list[str], timeout_s: float) -> int:
    """Start ``nprocs`` ranks on this machine, like torchrun --nproc-per-node, and wait."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    # The ranks' store lives here, on a port the kernel picked, as torchrun's agent hosts it: a
    # port found free and closed again for rank 0 to bind could be taken in between.
    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    procs = []
    for r in range(nprocs):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(r),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "true"}
        procs.append(subprocess.Popen([sys.executable, "-m", "redsock", *argv], env=env))
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = [None] * nprocs
    try:
        while None in codes:
            for i, p in enumerate(procs):
                if codes[i] is None:
                    codes[i] = p.poll()
            if any(c not in (None, 0) for c in codes):
                break  # one rank failed: the others will not finish
            if time.monotonic() > deadline:
                print(f"redsock: ranks still running after {timeout_s:.0f}s; stopping them", file=sys.stderr)
                break
            time.sleep(0.05)
    finally:
        stop_processes(procs)
        del store  # closes its server
    failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]  # before we stopped anyone
    for i, code in failed:
        print(f"redsock: rank {i} {_exit_reason(code)}", file=sys.stderr)
    bad = failed or [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    return 0 if not bad else bad[0][1] if bad[0][1] > 0 else 128 - bad[0][1]


def _exit_reason(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    hint = " (out of memory? see dmesg)" if code == -signal.SIGKILL else ""
    return f"was killed by {name}{hint}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-b", "--minbytes", default="8", help="smallest size (default 8)")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest size (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier between rows")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("-w", "--warmup", type=int, default=5, help="warm-up iterations per size")
    p.add_argument("-d", "--dtype", default="float32", help="float32, float16, bfloat16, float64, int8, uint8, int32, int64")
    p.add_argument("-o", "--op", default="sum", help="sum, avg, min, max, prod")
    p.add_argument("--back-to-back", action="store_true",
                   help="time per call = the slowest rank's total over -n back-to-back calls (median of "
                        f"{B2B_ROUNDS} rounds), not the median of per-call maxima")
    p.add_argument("--algo", default="auto,gloo", help="comma-separated: auto, ring, small, server, hier, gloo")
    p.add_argument("-c", "--check", action="store_true", help="validate results (the #wrong column)")
    p.add_argument("--json", metavar="FILE", help="write one JSON object per row")
    p.add_argument("--plot", metavar="FILE.png", help="plot bus bandwidth and latency against size")
    p.add_argument("--nprocs", type=int, help="start this many local ranks (else: RANK/WORLD_SIZE from the environment)")
    p.add_argument("--timeout", type=float, default=1800, help="with --nprocs: stop everything after this many seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    from . import allreduce_testbed

    allreduce_testbed.add_arguments(p)  # --testbed --workers --servers --rate --profile --prefix


def run(args: argparse.Namespace) -> int:
    if getattr(args, "testbed", False):
        from . import allreduce_testbed

        return allreduce_testbed.run(args)  # one rank per namespace of an emulated cluster
    if args.nprocs is not None:
        if args.nprocs < 1:
            raise ConfigError("--nprocs must be >= 1")
        _sweep(args)
        argv = [a for a in sys.argv[1:]]
        # Re-run this same command in each rank, minus the launcher's own options.
        child = _strip(argv, {"--nprocs": 1, "--timeout": 1})
        return launch_local(args.nprocs, child, args.timeout)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError("set RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun does), or pass --nprocs N")
    try:
        return run_rank(args)
    except RedsockError as e:
        who = f"rank {os.environ.get('RANK')}: "
        text = str(e)  # a failed collective's message names its rank already
        print(f"redsock: {text if text.startswith(who) else who + text}", file=sys.stderr)
        return 2


def _strip(argv: list[str], options: dict[str, int]) -> list[str]:
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in options:
            skip = 0 if "=" in a else options[name]
            continue
        out.append(a)
    return out
