"""One rank of ``redsock bench allreduce``: the runner both modes share.

Started by the local launcher (``--nprocs``, :mod:`.local`), by torchrun, or in a testbed
host (``--testbed``, :mod:`.testbed`); it times every algorithm of ``--algo`` on the same
ranks, one size at a time, and rank 0 prints the tables and writes :class:`~redsock.results.Row`
objects, the one result type of every mode.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ... import ops
from ...config import parse_size
from ...errors import ConfigError
from ..procs import BoxCpu, box_cpu, cpu_shares
from .inputs import count_wrong, make_input, reference, timing_input, wire_errors, wire_input, wire_reference

REDSOCK_ALGOS = ("auto", "ring", "small", "server", "hier")
#: The peers timed beside redsock on the same ranks ("mpi" only in ranks mpirun started: --peer mpi).
PEER_ALGOS = ("gloo", "mpi")
_PEER_ROUTES = {"gloo": {"scheme": "flat", "inter": "ring"}, "mpi": {"scheme": "flat", "inter": "vader"}}
CHECK_BLOCK = 1 << 22  # elements checked at a time


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


#: ``--back-to-back``'s rounds unless ``--rounds`` says (the anchor's, ../shared/anchors/mpi_allreduce.py).
B2B_ROUNDS = 3


class _Run(NamedTuple):
    """One implementation timed at one size: ``fn(x)`` is the timed call, ``check(x)`` the
    call the check makes (the same, but for MPI's out-of-place call, checked in place)."""
    algo: str
    fn: Callable[[np.ndarray], object]
    check: Callable[[np.ndarray], object]
    x: np.ndarray


class _Spent:
    """This process's CPU and the wall time spent inside its ``with`` blocks, summed over
    them (one implementation's rounds)."""

    def __init__(self) -> None:
        self.cpu_s = self.wall_s = 0.0

    def __enter__(self) -> None:
        self._start = (time.process_time(), time.perf_counter())

    def __exit__(self, *exc: object) -> None:
        self.cpu_s += time.process_time() - self._start[0]
        self.wall_s += time.perf_counter() - self._start[1]


def _redsock_call(comm, op: ops.ReduceOp, algorithm: str | None, wire_dtype: str | None) -> Callable[[np.ndarray], object]:
    """``comm.all_reduce`` as a training script calls it: arguments by position, and only
    those it sets (a partial with keywords builds a dict per call, a microsecond on a small
    call, which ``comm.all_reduce(x, op)`` does not pay)."""
    if algorithm is None and wire_dtype is None:
        return lambda x: comm.all_reduce(x, op)
    return functools.partial(comm.all_reduce, op=op, algorithm=algorithm, wire_dtype=wire_dtype)


class _Sized(NamedTuple):
    """Every implementation's run at one size, and its warm-up and timed calls per round."""
    nbytes: int
    runs: list[_Run]
    warmup: int
    iters: int


def _warm_up(runs: list[_Run], calls: int) -> None:
    for run in runs:
        for _ in range(calls):
            run.fn(run.x)


def time_size(runs: list[_Run], warmup: int, iters: int, comm) -> list[tuple[list[float], _Spent]]:
    """Each run's times at one size (seconds per call, each call's time, the slowest rank's,
    one run after the other) and this process's CPU in its timing: nccl-tests' way, where
    :func:`time_in_turn` is MPI benchmarks'."""
    _warm_up(runs, warmup)
    out = []
    for run in runs:
        used = _Spent()
        comm.barrier()
        times = np.empty(iters)
        with used:
            for i in range(iters):
                t0 = time.perf_counter()
                run.fn(run.x)
                times[i] = time.perf_counter() - t0
        comm.all_reduce(times, "max", algorithm="small" if times.nbytes <= 65536 else "ring")
        out.append((times.tolist(), used))
    return out


def time_in_turn(sized: list[_Sized], comm, progress: SweepProgress | None = None, rounds: int = B2B_ROUNDS
                 ) -> list[tuple[list[tuple[list[float], _Spent]], BoxCpu]]:
    """``--back-to-back``: per size, each run's times (seconds per call) and this process's
    CPU in them, and the machine's CPU ticks while the size was timed (:func:`box_cpu`'s
    differences, summed over its rounds).

    A round times a run's ``iters`` back-to-back calls after a barrier, and its time is the
    slowest rank's total / ``iters``, as MPI benchmarks time latency (a rank that waits in
    one call for a rank the scheduler paused is not counted twice over, as per-call maxima
    would).  Every run and size is warmed up first; then ``rounds`` rounds, each of
    every size in turn and, at each size, every run in turn, the order of the runs reversed
    every other round: an implementation, or a size, timed a minute after another meets
    another machine here (its speed changes up to 3x from one minute to the next), so each
    meets the machine's changing speed alike.  With one size per call, the sizes are timed
    one after the other (as nccl-tests sweeps); with all of them, a slow minute spreads over
    every size instead of landing on one (``--sizes-in-turn``)."""
    for s in sized:
        _warm_up(s.runs, s.warmup)
    per_call = np.empty((len(sized), max(len(s.runs) for s in sized), rounds))
    spent = [[_Spent() for _ in s.runs] for s in sized]
    ticks = np.zeros((len(sized), 3), np.int64)
    for k in range(rounds):
        for j, s in enumerate(sized):
            before = box_cpu()
            for i in (range(len(s.runs)) if k % 2 == 0 else reversed(range(len(s.runs)))):
                fn, x, iters = s.runs[i].fn, s.runs[i].x, s.iters
                comm.barrier()
                with spent[j][i]:
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        fn(x)
                    per_call[j, i, k] = (time.perf_counter() - t0) / iters
            ticks[j] += np.subtract(box_cpu(), before)
            if progress is not None:
                progress.advance(f"{s.nbytes} B" + (f", round {k + 1}/{rounds}" if len(sized) > 1 else ""))
    comm.all_reduce(per_call.reshape(-1), "max", algorithm="small")
    return [([(per_call[j, i].tolist(), spent[j][i]) for i in range(len(s.runs))], BoxCpu(*map(int, ticks[j])))
            for j, s in enumerate(sized)]


def _ranks_busy(comm, cpu_s: float, wall_s: float) -> float:
    """The share of this machine's cores the ranks used while one row was timed (all ranks'
    CPU over the slowest one's wall time): a row whose ranks alone keep the cores busy
    measures the CPU, not the network (``plan --lab`` classes it so)."""
    both = np.array([cpu_s, wall_s])
    comm.all_reduce(both[:1], "sum", algorithm="small")
    comm.all_reduce(both[1:], "max", algorithm="small")
    return round(float(both[0] / max(both[1], 1e-9) / (os.cpu_count() or 1)), 3)


def _machine_shares(comm, ticks: BoxCpu) -> tuple[float, float]:
    """The shares of the whole machine's cores busy, and stolen by the hypervisor, while one
    size was timed (``ticks``: rank 0's differences of /proc/stat, on every rank; it counts
    in 10 ms ticks): unlike ``ranks_busy`` it counts the reducers, the kernel's network work
    and anything else running."""
    shares = np.array(cpu_shares(BoxCpu(0, 0, 0), ticks))
    comm.broadcast(shares, 0)
    return round(float(shares[0]), 3), round(float(shares[1]), 3)


def run_rank(args: argparse.Namespace) -> int:
    from ... import api
    from ... import results as report
    from ...bootstrap import store_from_env

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = float(os.environ.get("REDSOCK_TIMEOUT_S", "120"))
    store = store_from_env(rank, world, timeout)
    comm = api.init(rank, world, store)
    dtype, op, algos, sizes = sweep(args)
    explicit = getattr(args, "wire_dtype", None)
    # The wire this run's redsock calls use: --wire-dtype, else REDSOCK_WIRE_DTYPE (float32 sum/avg only).
    wire = ops.wire_for(dtype, op, ops.wire_dtype(explicit or comm.config.wire_dtype), explicit is not None)
    gloo = _Gloo(store, rank, world, timeout) if "gloo" in algos else None
    mpi = None
    if "mpi" in algos:
        from .mpi_peer import MpiPeer

        mpi = MpiPeer(rank, world)
    in_turn = args.back_to_back and args.sizes_in_turn

    def runs_at(nbytes: int) -> _Sized:
        count = nbytes // dtype.itemsize
        runs = []
        for algo in algos:
            fn: Callable[[np.ndarray], object]
            check: Callable[[np.ndarray], object]
            if algo == "gloo":
                if gloo is None or op is ops.ReduceOp.AVG:  # (gloo is there whenever asked for)
                    continue
                fn = check = functools.partial(gloo.all_reduce, op=op)
            elif algo == "mpi":
                assert mpi is not None
                fn, check = mpi.timed, functools.partial(mpi.all_reduce, op=op)
            else:
                fn = check = _redsock_call(comm, op, None if algo == "auto" else algo, explicit)
            runs.append(_Run(algo, fn, check, timing_input(count, dtype, op, rank)))
        return _Sized(nbytes, runs, *iters_for(nbytes, args))

    rows = []
    progress = SweepProgress(rank == 0 and not args.no_progress,
                             len(sizes) * (args.rounds if args.back_to_back else 1))
    try:
        # (--sizes-in-turn: every size's inputs at once, the whole sweep's memory)
        for batch in ([sizes] if in_turn else [[n] for n in sizes]):
            sized = [runs_at(n) for n in batch]
            if args.back_to_back:
                timed = time_in_turn(sized, comm, progress, args.rounds)
            else:
                (s,) = sized
                box0 = box_cpu()
                timed = [(time_size(s.runs, s.warmup, s.iters, comm), BoxCpu(*np.subtract(box_cpu(), box0)))]
                progress.advance(f"{s.nbytes} B")
            for s, (per_run, ticks) in zip(sized, timed):
                nbytes, count = s.nbytes, s.nbytes // dtype.itemsize
                machine, steal = _machine_shares(comm, ticks)
                for run, (times, spent) in zip(s.runs, per_run):
                    algo = run.algo
                    busy = _ranks_busy(comm, spent.cpu_s, spent.wall_s)
                    on_wire = wire if algo in REDSOCK_ALGOS else None
                    wrong, max_err = (_check(run.check, count, dtype, op, rank, world, comm, on_wire) if args.check
                                      else (-1, None))
                    how = route(comm, run.x, op, algo) if algo in REDSOCK_ALGOS else _PEER_ROUTES[algo]
                    extra: dict[str, Any] = {**how}
                    if on_wire is not None and extra["inter"] in ("server", "ring"):  # ("small" carries float32)
                        extra["wire_dtype"] = ops.WIRE_NAMES[on_wire]
                    if max_err is not None:
                        extra["max_rel_err"] = max_err
                    extra.update(ranks_busy=busy, machine_busy=machine, machine_steal=steal)
                    if args.back_to_back:
                        extra["rounds_s"] = [round(t, 9) for t in times]
                    impl = algo if algo in PEER_ALGOS else "redsock"
                    rows.append(report.Row.from_times(impl, algo, world, nbytes, count, dtype.name, op.name.lower(),
                                                      times, wrong, extra=extra))
    finally:
        progress.close()
        if gloo is not None:
            gloo.close()
        comm.close()
    if rank == 0:
        print(report.format_table(rows))
        if len({r.algo for r in rows}) > 1 and any(r.algo == "gloo" for r in rows):
            print(report.compare_table(rows, baseline_algo="gloo"))
        if any(r.impl == "mpi" for r in rows):
            from .mpi_peer import side_by_side

            print(side_by_side(rows))
        if args.json:
            report.write_json(rows, args.json)
        if args.plot:
            report.plot(rows, args.plot)
        wrong = sum(max(r.wrong, 0) for r in rows)
        if args.check:
            print(f"# check: {wrong} wrong elements over {len(rows)} rows")
        return 1 if wrong else 0
    return 0


def route(comm, x: np.ndarray, op: ops.ReduceOp, algo: str) -> dict[str, str]:
    """How ``comm`` ran the all-reduces of ``x`` with ``op`` asked as ``algo``: ``scheme``
    "flat" (every rank on the network on its own) or "hierarchical" (reduced inside each host
    first), ``inter``, the algorithm between hosts (for a hierarchical one, its inter-host
    group's choice for one shard; "none" when no host link is crossed), and ``path``, how
    they moved data inside the host.  The benchmarks' bounds follow from it."""
    chosen = comm.choose_algorithm(x.nbytes, None if algo == "auto" else algo)
    if chosen != "hier":
        return {"scheme": "flat", "inter": chosen}
    return {"scheme": "hierarchical", "inter": comm.hier.inter_algorithm(x.nbytes),
            "path": comm.hier.path_taken(x.dtype, x.size, op)}


def _check(fn, count: int, dtype: np.dtype, op: ops.ReduceOp, rank: int, world: int, comm,
           wire: np.dtype | None = None) -> tuple[int, float | None]:
    """Wrong elements on any rank (vs the float64 reference), plus every element if ranks
    differ; and on a 16-bit ``wire`` the largest relative error of any rank (else None).

    On a wire the inputs are of mixed magnitude, so the wire must round them, and an element
    is wrong beyond the wire's bound (:func:`redsock.ops.wire_error_bound`) rather than one ulp."""
    seed = 1
    x = wire_input(count, rank, seed) if wire is not None else make_input(count, dtype, op, rank, seed)
    fn(x)
    wrong, max_err = 0, 0.0
    # In blocks: float64 references of a whole 256 MiB buffer take several GB per rank.
    for lo in range(0, count, CHECK_BLOCK):
        n = min(CHECK_BLOCK, count - lo)
        if wire is None:
            wrong += count_wrong(x[lo:lo + n], reference(n, dtype, op, world, seed, lo))
        else:
            w, e = wire_errors(x[lo:lo + n], *wire_reference(n, world, seed, lo), world, wire, op)
            wrong, max_err = wrong + w, max(max_err, e)
    digest = zlib.crc32(x.tobytes())
    stats = np.array([wrong, digest, -digest], dtype=np.int64)
    comm.all_reduce(stats[:1], "sum")
    comm.all_reduce(stats[1:], "max")
    worst = np.array([max_err])
    comm.all_reduce(worst, "max")
    identical = stats[1] == -stats[2]  # max == min of the digests
    return int(stats[0]) + (0 if identical else count), (float(worst[0]) if wire is not None else None)


def sweep(args: argparse.Namespace) -> tuple[np.dtype, ops.ReduceOp, list[str], list[int]]:
    """The dtype, op, algorithms and sizes the command asks for, or a ConfigError saying what
    is wrong (checked by the launcher too, so that a bad option is one message, not one per rank)."""
    dtype = ops.dtype_from_name(args.dtype)
    op = ops.ReduceOp.parse(args.op)
    algos = [a.strip() for a in args.algo.split(",") if a.strip()]
    for i, a in enumerate(algos):
        if a not in REDSOCK_ALGOS + PEER_ALGOS:
            raise ConfigError(f"unknown --algo {a!r}; choose from {', '.join(REDSOCK_ALGOS + PEER_ALGOS)}")
        if a in algos[:i]:
            raise ConfigError(f"--algo names {a!r} twice")
    if "mpi" in algos and (not args.back_to_back or dtype != np.float32 or op is not ops.ReduceOp.SUM
                           or len([a for a in algos if a not in PEER_ALGOS]) != 1):
        raise ConfigError("--peer mpi times float32 sum with --back-to-back against one redsock --algo")
    if args.sizes_in_turn and not args.back_to_back:
        raise ConfigError("--sizes-in-turn takes turns between --back-to-back rounds: add --back-to-back")
    if args.iters < 1 or args.warmup < 0:
        raise ConfigError(f"need -n >= 1 and -w >= 0, got -n {args.iters} -w {args.warmup}")
    if args.rounds < 1:
        raise ConfigError(f"need --rounds >= 1, got {args.rounds}")
    if getattr(args, "wire_dtype", None) is not None:  # asked for: refused where it cannot apply
        ops.wire_for(dtype, op, ops.wire_dtype(args.wire_dtype), explicit=True)
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


def iters_for(nbytes: int, args: argparse.Namespace) -> tuple[int, int]:
    """Fewer timed iterations for huge sizes so a sweep stays bounded (nccl-tests' -n as an
    upper bound), but all of ``-w``'s warm-up calls: what an implementation settles in its first
    calls (pages, caches, redsock's first trial of its ways on one host, at a shape's 8th call)
    belongs to the warm-up, and 2 calls of it put 8 calls of a trial into a 64 MiB row of 24
    (its time 1.2-1.4x twice the 32 MiB row's, 2026-12-07)."""
    if nbytes >= 64 << 20:
        return args.warmup, max(3, min(args.iters, 8))
    return args.warmup, args.iters


class SweepProgress:
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
