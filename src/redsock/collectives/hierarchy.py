"""Hierarchical collectives: shared memory inside a host, Fast Socket (or reducers) between hosts.

All-reduce, piece by piece through the shared arena:

1. every local rank copies its piece into its region;
2. local rank j < ``shards`` reduces shard j of the piece straight from all the regions (in
   local-rank order, fp32 accumulation for 16-bit types), all-reduces that shard with the
   ranks owning shard j on the other hosts (its inter-host group: ring / recursive doubling,
   or the reduction servers as a job of its own, world = number of hosts), and writes the
   final shard into its region;
3. every local rank copies the final shards out.

On one host a rank's own shard skips the arena: it copies in the rest of its piece, and reads
its own shard from its own buffer (:meth:`Hierarchy._reduce_sharded`).  Between hosts the
pieces are pipelined: every piece's shard starts its inter-host all-reduce as soon as it is
reduced, and the copies out wait for them in a second pass (:meth:`Hierarchy._all_reduce_pipelined`).

Each host NIC thus carries one copy of the buffer whatever the number of ranks per host, and
a single-host job never touches TCP.  Every shard is finished once, by one rank, so all ranks
end with the same bits.  ``shards`` is the number of ranks of the smallest host, so hosts of
uneven size work (their extra ranks only take part inside the host).

Broadcast and barrier go through local rank 0 of each host; reduce-scatter and all-gather
through shared memory on a single host (between hosts they use the flat ring).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import ops
from ..bootstrap import PeerTable
from ..config import Config, KiB, MiB
from ..errors import PeerFailure, Timeout
from ..transport.shm import TOLD_SLOTS, LocalGroup
from .context import CallContext, chunks, flat, partition, ramped_chunks, signature_check

#: Bytes of each half of a rank's region: the largest piece a collective moves at once, the
#: size of the pieces whose shards cross hosts (measured: docs/benchmarks/lab-log.md, "Several ranks per host").
REGION_BYTES = 4 * MiB
#: Pieces of a collective that stays inside the host: the 2 x L pieces in flight stay in the
#: caches (4 ranks on one host, float32 sum, 4 / 16 / 64 MiB: 7.7 / 26 / 105 ms with 4 MiB
#: pieces, 5.0 / 19.1 / 68 ms with 1 MiB).  Between hosts the pieces stay at REGION_BYTES:
#: 1 MiB pieces took 4 hosts x 2 ranks through the reducers from 1.5x to 1.2x gloo.  But an
#: all-reduce that fits one region goes through the arena in one piece: each piece costs two
#: syncs, each a turn of the two ranks that share a core.  4 ranks on 2 cores, 2026-12-07, 6
#: rounds in turn in the same processes, one piece / 1 MiB pieces: 1.5 MiB 0.72-0.99x the
#: time, 2 MiB 0.71-0.91x (and 0.70-0.80x in another run), 3 MiB 0.62-0.72x, 4 MiB 0.53-1.54x
#: (0.53-0.56 in one state of the machine, 1.09-1.54 in the other); from 16 MiB the pieces of
#: 1 MiB stay (2 MiB pieces: 0.96-1.17x at 16 MiB, 0.87-1.40x at 64 MiB).
LOCAL_PIECE_BYTES = 1 * MiB
#: Between hosts the first pieces grow from REGION_BYTES / PIPELINE_RAMP and the last ones
#: shrink back to it: the links start after a small piece is reduced and finish soon after
#: the last byte.  4 hosts x 2 ranks through 4 reducers at 200 Mbit/s, 32 MiB (link bound
#: 1.40 s): 1.653 s with every piece at 4 MiB, 1.577 / 1.575 s ramped (at 300 Mbit/s, where
#: the ranks and reducers keep the cores busier, the two were within the noise).  2 MiB pieces
#: throughout took 1.485 s, but cost the reducers 6.7 CPU-s/GiB instead of 5.3, and 1 MiB
#: pieces at 300 Mbit/s fell from 1.5x to 1.2x gloo.
PIPELINE_RAMP = 8
#: Up to this size a multi-host all-reduce sends a single shard between hosts.
WHOLE_MAX_BYTES = 64 * KiB
#: A single-host all-reduce has every rank reduce the whole buffer from the arena (one
#: synchronisation) while the L rows it reads, L x the buffer, take at most WHOLE_ROWS_BYTES
#: (and up to WHOLE_MAX_BYTES whatever L); larger ones are sharded (two synchronisations,
#: :meth:`Hierarchy._reduce_sharded`).  4 ranks on 2 cores shared with other jobs (load 14-18),
#: 100 back-to-back calls, 3 alternating rounds, whole / sharded by cross-memory attach: 64 KiB
#: 131-658 / 866-3695 us, 128 KiB 915-1655 / 916-5417 us (a second sync costs most where the
#: cores are oversubscribed).  Against the arena's shards, whose syncs spin SPIN_PIECE_US, 4
#: ranks on 2 cores, 2026-12-07, 3 runs of 6 rounds of 200 calls in turn in the same processes,
#: whole / arena: 64 KiB 85 / 117, 60 / 100, 154 / 155 us; 128 KiB 120 / 114, 111 / 95, 220 / 162.
WHOLE_ROWS_BYTES = 256 * KiB
#: From this size a single-host all-reduce starts by cross-memory attach where every local rank
#: may (:meth:`Hierarchy._reduce_direct`; then the faster way lately, :data:`PROBE_EVERY`):
#: below it the arena's copies cost less than the kernel's page pinning and system calls.
#: 4 ranks on 2 cores, 100-200 back-to-back calls, alternating rounds, arena / cross-memory
#: attach (docs/benchmarks/lab-log.md, "Several ranks per host"): 256 KiB 184-239 / 234-453 us, 512 KiB 355-745 / 385-700 us, 1 MiB 637-748 /
#: 614-769 us, 2 MiB 1223-1570 / 1032-1109 us, 16 MiB 11.4-11.7 / 6.7-7.7 ms.  Again on
#: 2026-12-05, 3 alternating runs of 4 x 300 calls: 512 KiB 348-411 / 297-332 us, 256 KiB
#: 145-184 / 171-309 us; 2 ranks (a core each), 512 KiB 84-90 / 67-108 us.
CMA_MIN_BYTES = 512 * KiB
#: Pieces of a cross-memory-attach all-reduce: the L - 1 peers' pieces, the result and the
#: accumulator stay in the L2 cache (1 MiB per core on AMD EPYC; 128, 256 and 512 KiB pieces
#: measured alike on a 2 MiB-L2 Xeon).
CMA_PIECE_BYTES = 128 * KiB
#: How long a wait spins (yielding the CPU) before it sleeps: about as long as the wait is
#: expected to be.  Between hosts pieces of MiBs keep peers waiting on the network for
#: milliseconds: spin briefly.  A small call waits only for the peers' Python overhead, and a
#: sleep plus wake-up costs more than that on an oversubscribed machine (4 ranks, 2 cores, 8 B
#: all-reduce at 50 / 500 / 2000 us of spin: 330 / 237 / 231 us per call, against gloo's
#: 850-970 us in the same runs).
SPIN_MAX_US = 50
SPIN_SMALL_US = 2000
#: The syncs of a single-host all-reduce in pieces (the arena's shards, cross-memory attach)
#: wait for a peer's copies and reduction of a piece, a few hundred us where ranks share a
#: core.  4 ranks on 2 cores, 2026-12-07, 6 rounds of 100 calls in turn in the same processes,
#: the arena's syncs at 500 / 50 us of spin (2 runs): 256 KiB 0.82-0.93x the time, 512 KiB
#: 0.95-0.96x, 1 MiB 0.77-1.01x, 2 MiB 0.88x, and 4 and 16 MiB 0.86x and 0.87x (1 run); at 2000 /
#: 50 us 0.80-0.96x at 256 KiB-2 MiB (3 runs); cross-memory attach (512 KiB-16 MiB, 1 run) at
#: 500 / 2000 us 0.98-1.05x, at 50 / 2000 us 0.96-1.09x (0.88-1.13x in another run).  With other jobs on the cores (2026-12-04, load 6-15) the arena
#: at 2000 us took 1.8-2.0x as long as at 50 (a spinner takes turns from them): 500 is between.
SPIN_PIECE_US = 500
#: Up to this size a single-host whole-buffer all-reduce is reduced by the first ranks past its
#: sync, and the others copy their result from the arena (:meth:`LocalGroup.result`), where a
#: call costs about its fixed steps: 4 ranks on 2 cores, about half the calls copy (each core's
#: first rank past the sync reduces).  8 rounds of back-to-back calls in turn, 2026-12-07,
#: sharing the result against every rank reducing: 8 B 13.6-20.8 us against 14.8-22.4 (6 runs),
#: 1 KiB 14.8-24.7 against 15.1-26.7 (4 runs), 4-8 KiB 19.3-31.6 against 22.5-31.0 (4 runs), and
#: slower from 16 KiB (38-59 us against 38-53) to 64 KiB (122-151 against 108-132): there the
#: copy of a result another core has just written costs more than the reduction it saves.
SHARED_RESULT_MAX_BYTES = 4 * KiB
#: Where both ways are open (one host, cross-memory attach allowed, above the whole-buffer
#: size) the faster one is not a matter of size alone: it changes with the machine's state,
#: from one minute to the next, and the arena's copies gain from a fast state where the
#: kernel's page pinning does not.  4 ranks on 2 cores, 2026-12-06, 3 alternating rounds of
#: 100 back-to-back calls, arena / cross-memory attach: 1 MiB 1021 / 636 us, 931 / 522, 275 / 518;
#: 2 MiB 1977 / 1017, 1852 / 1246, 563 / 967 (docs/benchmarks/lab-log.md).
#: So local rank 0 times each shape's calls both ways and the calls take the faster
#: (:meth:`Hierarchy._choose_way`): every PROBE_EVERY calls a trial takes the two ways in
#: turn, TRIAL_RUN_CALLS calls at a time, TRIAL_RUNS runs (the other way first, this one
#: last); the first TRIAL_WARM_CALLS calls of each run pay for what the other way left (the
#: arena's regions, cold after the other way's calls) and only the later ones are timed, and
#: the calls move to the other way if its best is SWITCH_MARGIN of this one's (the next trial
#: comes later while the other way loses clearly: CLEAR_LOSS).  In turn, because the machine's speed changes by more than the ways differ: a
#: way tried after the other (best of 2 against the other's last 2) met another moment, the
#: slower way took 7-37% of the calls at 256 KiB-2 MiB, and the calls through the API took
#: 1.17-1.61x the time of the faster way alone (2026-12-07, 4 ranks, rounds in turn in the
#: same processes; the API's own cost is 10-25 us of that at 256 KiB).  In runs, because the
#: arena warms up over several calls: 4 ranks, 1 MiB, after 20 calls by cross-memory attach
#: the arena's calls 1-8 took 579 498 393 342 333 322 317 295 us (medians of 10), cross-memory
#: attach's after the arena 691 561 520 520 513 532 516 614; with pairs of calls, the second
#: timed, the arena's trials took 1.4-1.9 ms at 2 MiB and kept the calls on cross-memory
#: attach (1.1 ms), where the arena alone took 0.7 ms (2026-12-07, 18:00 UTC).
PROBE_EVERY = 200
SWITCH_MARGIN = 0.9
#: A trial whose challenger's best took CLEAR_LOSS times the incumbent's or more doubles the
#: calls until the next trial, up to PROBE_EVERY_MAX; any other outcome brings them back to
#: PROBE_EVERY.  A trial costs its challenger's calls, which is what a clear loser's calls
#: cost: 4 ranks on 2 cores, 2026-12-07, 6 rounds of 300 calls in turn in the same
#: processes, cross-memory attach / the arena at 128 KiB 1.78-2.37x, and the calls that
#: tried both every 200 calls took 1.07x (median; 0.74-1.56x) the time of the arena's alone.
CLEAR_LOSS = 1.5
PROBE_EVERY_MAX = 16 * PROBE_EVERY
TRIAL_RUN_CALLS = 4
TRIAL_WARM_CALLS = 2
TRIAL_RUNS = 4
#: The first trial of a shape starts with its FIRST_TRIAL_AFTER-th call (a few calls first warm
#: the caches and fault in the pages).
FIRST_TRIAL_AFTER = 8
#: Flips a bit of a call's signature check on the cross-memory-attach way: local ranks that
#: took different ways for one call (a bug) fail at its first sync instead of mixing data.
_WAY_MARK = 0x8000


#: How many call shapes a single-host group keeps prepared (a training loop's few).
_PLANS_KEPT = 64


class _Plan(NamedTuple):
    """A single-host all-reduce of one (dtype, count, op), prepared once: ``run(plan, x,
    signature, timeout_s)`` is the path :meth:`Hierarchy.local_path` names for its size
    (where the arena and cross-memory attach are both open, the one :class:`_Ways` says)."""
    run: Callable[["_Plan", np.ndarray, int, float], None]
    check: int  # the call's signature check
    reduce: Callable[[Sequence[np.ndarray], np.ndarray], np.ndarray]  # ops.row_reducer (cma: own=this rank)
    rows: tuple[tuple[np.ndarray, ...], ...]  # whole: each half's rows, one per local rank
    pieces: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]  # arena: (lo, hi, every rank's shard)
    # of each piece; cross-memory attach: (lo, hi, ()) of this rank's shard's pieces
    ways: _Ways | None = None  # where both ways are open: both, and which one the calls take
    result: np.ndarray | None = None  # whole: the arena's result region (LocalGroup.result)


class _Ways:
    """Both ways of a single-host all-reduce of one shape (``plans``: the arena's, cross-memory
    attach's) and the one its calls take.  Every local rank takes the way local rank 0 last
    told for this shape (:meth:`LocalGroup.tell`, slot ``ident % TOLD_SLOTS``, word ``ident <<
    1 | way``), read as a call starts; rank 0 writes it between the call's first and last sync,
    when every rank has read it for this call and before any can read it for the next.  Only
    rank 0 times.  Two shapes whose numbers share a slot may overwrite each other's word: the
    number in it tells, and the overwritten shape keeps its way (everywhere alike).  No lock:
    only the call that holds the arena's turn (:meth:`Hierarchy.in_turn`) reads or changes it."""
    __slots__ = ("ident", "plans", "way", "taken", "since", "every", "times", "trial", "incumbent", "timed")

    def __init__(self, ident: int, way: int):
        self.ident = ident  # this shape's number, the same on every local rank (shapes are prepared in call order)
        self.plans: tuple[_Plan, ...] = ()
        self.way = way  # 0: the arena, 1: cross-memory attach
        self.taken = [0, 0]  # this shape's calls each way
        self.since = PROBE_EVERY - FIRST_TRIAL_AFTER  # local rank 0: calls since the last trial
        self.every = PROBE_EVERY  # local rank 0: calls from one trial to the next (CLEAR_LOSS)
        self.times: tuple[list[float], list[float]] = ([], [])  # local rank 0: each way's times in the trial
        self.trial = 0  # local rank 0: this call's number in the trial under way (0: none)
        self.incumbent = way  # local rank 0: the way the calls took before it
        self.timed = False  # local rank 0: this call's time counts in the trial

    def describe(self) -> str:
        """The ways the calls took, e.g. "cma" or "cma:97%+arena:3%"."""
        total = sum(self.taken)
        shares = sorted(((n / total, name) for n, name in zip(self.taken, ("arena", "cma")) if n), reverse=True)
        return shares[0][1] if len(shares) < 2 else "+".join(f"{name}:{share:.0%}" for share, name in shares)


class Hierarchy:
    """The host-level view of a communicator: its local group and its inter-host groups.

    ``make_comm(rank, world, group, global_ranks)`` builds the Communicator of an inter-host
    group (supplied by the communicator, which this module does not import).
    """

    def __init__(self, peers: PeerTable, config: Config, make_comm: Callable[..., Any]):
        topo = peers.topology
        self.topology = topo
        self.world = peers.world_size
        self.nhosts = len(topo.hosts)
        self.local = LocalGroup(peers.store, peers.prefix + f"shm/{topo.host}", topo.local_ranks,
                                topo.local_rank, tuple(topo.pids[r] for r in topo.local_ranks),
                                region_bytes=REGION_BYTES, timeout_s=config.timeout_s,
                                spin_us=min(config.spin_us, SPIN_MAX_US), cma=config.shm_cma == "auto")
        self.inter = None  # this rank's inter-host group, if it owns a shard and there are hosts to talk to
        try:
            if self.nhosts > 1 and topo.local_rank < topo.shards:
                ranks = topo.inter_host_group(topo.local_rank)
                self.inter = make_comm(topo.host, self.nhosts, f"{peers.group}/shard{topo.local_rank}", ranks)
        except BaseException:
            self.local.close()
            raise
        #: Up to this size every rank reduces the whole buffer (:data:`WHOLE_ROWS_BYTES`).
        self.whole_max_bytes = WHOLE_MAX_BYTES if self.nhosts > 1 else max(WHOLE_MAX_BYTES,
                                                                            WHOLE_ROWS_BYTES // self.local.size)
        #: The single-host all-reduces prepared so far, by (dtype, count, op) (:meth:`plan`).
        self.plans: dict[tuple[np.dtype, int, ops.ReduceOp], _Plan] = {}
        self._cma_rows: np.ndarray | None = None  # the peers' pieces and the result (calls go one at a time)
        self._shapes = itertools.count(1)  # numbers the shapes that may go either way (_Ways.ident)
        #: Drawn in program order when a call is made: the arena serves calls in that order
        #: (an async call running on the communicator's thread and a synchronous one may overlap).
        self.tickets = itertools.count()
        self._next = 0
        self._turn = threading.Condition()
        self._waiting = 0  # calls waiting for their turn (changed under _turn)
        self._broken = False
        self._timeout_s = config.timeout_s

    # -- call ordering ------------------------------------------------------------------

    def in_turn(self, ticket: int, body: Callable[[CallContext], None], ctx: CallContext) -> None:
        """Run ``body(ctx)`` once the calls drawn before ``ticket`` are done with the arena."""
        self._await_turn(ticket)
        try:
            body(ctx)
        finally:
            self._end_turn(ticket)

    def _await_turn(self, ticket: int) -> None:
        if self._next != ticket or self._broken:  # (no lock needed to see that it is our turn)
            self._wait_turn(ticket)

    def _wait_turn(self, ticket: int) -> None:
        with self._turn:
            self._waiting += 1  # before the check: a call finishing now sees that it must notify
            try:
                if not self._turn.wait_for(lambda: self._next == ticket or self._broken, self._timeout_s):
                    raise Timeout(f"an earlier shared-memory collective did not finish in "
                                  f"{self._timeout_s:g}s", op="shared-memory collective")
            finally:
                self._waiting -= 1
            if self._broken:
                raise PeerFailure("the communicator failed or was closed", ranks=())

    def _end_turn(self, ticket: int) -> None:
        self._next = ticket + 1
        if self._waiting:  # (the lock and notify cost a small call a microsecond or two)
            self._notify_turn()

    def _notify_turn(self) -> None:
        with self._turn:
            self._turn.notify_all()

    def inter_algorithm(self, nbytes: int) -> str:
        """The algorithm this rank's inter-host group picks for one shard of an ``nbytes``
        all-reduce ("none" when it crosses no host link: one host, or no shard owned)."""
        if self.inter is None:
            return "none"
        return self.inter.choose_algorithm(min(nbytes, self.local.region_bytes) // self.topology.shards, None)

    # -- collectives ----------------------------------------------------------------------

    def all_reduce(self, ctx: CallContext, x: np.ndarray, op: ops.ReduceOp, wire_dtype: np.dtype | None = None) -> None:
        """``wire_dtype``: the 16-bit type the inter-host stage carries (float32 ``x``); the
        stage inside the host sums in float32 whatever it is."""
        if self.nhosts == 1:  # (the same prepared paths as all_reduce_here's)
            plan = self.plan(x, op)
            plan.run(plan, x if x.ndim == 1 else x.reshape(-1), call_signature(ctx.seq, plan.check), ctx.timeout_s)
        elif x.nbytes <= self.whole_max_bytes:  # (every local rank decides alike)
            self._all_reduce_whole(ctx, x, op, wire_dtype)
        else:
            self._all_reduce_pipelined(ctx, x, op, wire_dtype)

    def local_path(self, nbytes: int) -> str:
        """How an all-reduce of ``nbytes`` moves data inside this host: "whole" (every rank
        reduces all of it from the arena), "cma" (one copy each way, straight between the
        ranks' buffers) or "arena" (sharded, through the arena)."""
        if nbytes <= self.whole_max_bytes:
            return "whole"
        return "cma" if self._either_way(nbytes) and nbytes >= CMA_MIN_BYTES else "arena"

    def _either_way(self, nbytes: int) -> bool:
        """Whether an all-reduce of ``nbytes`` may go through the arena or by cross-memory
        attach, whichever has been faster lately (:data:`PROBE_EVERY`); it starts with :meth:`local_path`'s."""
        return self.nhosts == 1 and self.local.cma and nbytes > self.whole_max_bytes

    def path_taken(self, dtype: np.dtype, count: int, op: ops.ReduceOp) -> str:
        """How the single-host all-reduces of this shape went so far (:meth:`local_path`'s
        names; the shares of each where they went either way)."""
        dtype = np.dtype(dtype)
        plan = self.plans.get((dtype, count, op))
        if plan is None or plan.ways is None or not any(plan.ways.taken):
            return self.local_path(count * dtype.itemsize)
        return plan.ways.describe()

    def runs_here(self, nbytes: int) -> bool:
        """Whether a synchronous all-reduce of ``nbytes`` can be :meth:`all_reduce_here`
        (every size on a single host: it crosses no host link)."""
        return self.nhosts == 1

    def all_reduce_here(self, ticket: int, plan: _Plan, x: np.ndarray, seq: int, timeout_s: float) -> None:
        """A single-host all-reduce in the caller's thread, without a call context (``seq``:
        the call's number), prepared once per call shape (:class:`_Plan`).  4 ranks on 2
        cores switch process once per rank and sync, and every line after a switch runs
        cold: a line costs several times what it does in a loop (4 ranks, 8 B, 3000 calls,
        3 alternating rounds: 127-154 us median per-call maximum with the rows looked up,
        the signature hashed and the reduction dispatched on every call, 79-96 us prepared).
        The caller passes the plan: :meth:`Communicator.all_reduce` finds it before its own
        checks (a shape that has a plan passed them), a short way worth 1-4 us per call
        (ranks pinned 2 per core, 8 B, 6 alternating runs: 19.8-26.4 us against 23.9-36.3).
        The calls below it are inlined where they cost more than their lines (the ticket, the
        signature, the end of the turn, the copy, :meth:`LocalGroup.sync`'s lookups and the
        reducer's per-row tests): 8 B, 4 ranks, 20000-call rounds in turn, median 13.1-14.4 us
        against 14.6-17.9 us in 3 pairs of runs (2026-12-07)."""
        if self._next != ticket or self._broken:  # (:meth:`_await_turn`, inline: its call costs more than the test)
            self._wait_turn(ticket)
        try:  # (call_signature's, inline)
            plan.run(plan, x if x.ndim == 1 else x.reshape(-1), (seq + 1) << 16 | plan.check, timeout_s)
        finally:
            self._next = ticket + 1  # (:meth:`_end_turn`'s, inline)
            if self._waiting:
                self._notify_turn()

    def plan(self, x: np.ndarray, op: ops.ReduceOp) -> _Plan:
        """The single-host all-reduce of ``x``'s shape with ``op``, prepared on its first call
        (``x`` checked: a supported dtype, contiguous)."""
        key = (x.dtype, x.size, op)
        plan = self.plans.get(key)
        if plan is None:
            if len(self.plans) >= _PLANS_KEPT:
                self.plans.clear()
            path, check = self.local_path(x.nbytes), signature_check("all_reduce", key + ("hier",))
            if self._either_way(x.nbytes):
                ways = _Ways(next(self._shapes), way=int(path == "cma"))
                ways.plans = tuple(self._make_plan(way, x.dtype, x.size, op, check, ways) for way in ("arena", "cma"))
                plan = _Plan(self._reduce_either, check, ways.plans[0].reduce, (), (), ways)
            else:
                plan = self._make_plan(path, x.dtype, x.size, op, check)
            self.plans[key] = plan
        return plan

    def _make_plan(self, path: str, dt: np.dtype, n: int, op: ops.ReduceOp, check: int,
                   ways: _Ways | None = None) -> _Plan:
        g = self.local
        rows: tuple = ()
        pieces: tuple = ()
        run: Callable[[_Plan, np.ndarray, int, float], None]
        result = None
        if path == "whole":
            run, rows = self._reduce_whole_here, tuple(tuple(g.rows(half, dt, n)) for half in (0, 1))
            result = g.result(dt, n) if n * dt.itemsize <= SHARED_RESULT_MAX_BYTES else None
        elif path == "arena":
            run = self._reduce_sharded
            per_piece = n if n * dt.itemsize <= g.region_bytes else LOCAL_PIECE_BYTES // dt.itemsize
            pieces = tuple((lo, hi, tuple(partition(hi - lo, g.size))) for lo, hi in chunks(0, n, per_piece))
        else:
            run = self._reduce_direct
            a, b = partition(n, g.size)[g.me]
            pieces = tuple((lo, hi, ()) for lo, hi in chunks(a, b, max(1, CMA_PIECE_BYTES // dt.itemsize)))
        # (cross-memory attach: the result over this rank's own input, where it goes)
        reduce = ops.row_reducer(dt, op, self.world, own=g.me if path == "cma" else None)
        return _Plan(run, check, reduce, rows, pieces, ways, result)

    def _reduce_either(self, plan: _Plan, x: np.ndarray, signature: int, timeout_s: float) -> None:
        """One host, where the arena and cross-memory attach are both open: the way local
        rank 0 last said for this shape (:class:`_Ways`); rank 0 times the call."""
        w, g = plan.ways, self.local
        assert w is not None
        said = g.told(w.ident % TOLD_SLOTS)
        if said >> 1 == w.ident:
            w.way = said & 1
        way = w.way
        w.taken[way] += 1
        sub = w.plans[way]
        t0 = time.perf_counter()
        sub.run(sub, x, signature ^ (_WAY_MARK * way), timeout_s)
        if w.timed:  # (local rank 0, in a trial)
            w.times[way].append(time.perf_counter() - t0)

    def _choose_way(self, w: _Ways) -> None:
        """Local rank 0, between a call's first and last sync: the way of this shape's next
        call, written only to change it, and whether this call is timed (:data:`PROBE_EVERY`).
        A trial's calls 1 to TRIAL_RUNS x TRIAL_RUN_CALLS take the other way and this one in
        turn, a run of TRIAL_RUN_CALLS at a time, all but each run's first TRIAL_WARM_CALLS
        timed; they end on this one, and the call after them, which sees every time, keeps the
        calls here unless the other way's best was SWITCH_MARGIN of this one's, and sets the
        calls until the next trial (:data:`CLEAR_LOSS`)."""
        i = w.trial  # (this call's number in the trial, from 1)
        if not i:
            w.since += 1
            if w.since >= w.every:
                w.since, w.incumbent, w.trial = 0, w.way, 1
                for times in w.times:
                    times.clear()
                self._tell(w, 1 - w.way)
            return
        last = TRIAL_RUNS * TRIAL_RUN_CALLS
        if i <= last:
            w.trial, w.timed = i + 1, (i - 1) % TRIAL_RUN_CALLS >= TRIAL_WARM_CALLS
            nxt = w.incumbent if i == last or i // TRIAL_RUN_CALLS % 2 else 1 - w.incumbent  # (call i + 1's run)
            if nxt != w.way:
                self._tell(w, nxt)
            return
        w.trial, w.timed = 0, False
        every, w.every = w.every, PROBE_EVERY  # (back to PROBE_EVERY but after a clear loss)
        if not (w.times[0] and w.times[1]):  # (both timed, unless another shape's word took this one's slot)
            return
        challenger = 1 - w.incumbent
        ratio = min(w.times[challenger]) / min(w.times[w.incumbent])
        if ratio < SWITCH_MARGIN:
            self._tell(w, challenger)
        elif ratio >= CLEAR_LOSS:
            w.every = min(2 * every, PROBE_EVERY_MAX)

    def _tell(self, w: _Ways, way: int) -> None:
        self.local.tell(w.ident % TOLD_SLOTS, w.ident << 1 | way)

    def _reduce_whole_here(self, plan: _Plan, x: np.ndarray, signature: int, timeout_s: float) -> None:
        """One host, a small buffer: every rank copies it in and reduces all of them alike, but
        for the smallest (:data:`SHARED_RESULT_MAX_BYTES`, ``plan.result``), where the first
        ranks past the sync reduce and leave the result in the arena, and the others copy it."""
        g = self.local
        rows = plan.rows[g.next_half()]
        inline = x.nbytes < ops.ALIAS_MIN_BYTES  # (:func:`ops.copy`'s test, inline: its call costs more than the copy)
        if inline:
            rows[g.me][...] = x
        else:
            ops.copy(rows[g.me], x)
        g.sync(signature, SPIN_SMALL_US, timeout_s)
        result = plan.result
        if result is None:
            plan.reduce(rows, x)
            return
        done = g.result_step
        if done[0] == g.step:
            x[...] = result
            return
        plan.reduce(rows, x)
        if done[0] != g.step:  # (else another core's rank was quicker: its lines stay unshared)
            result[...] = x
            done[0] = g.step

    def _reduce_sharded(self, plan: _Plan, x: np.ndarray, signature: int, timeout_s: float) -> None:
        """One host, piece by piece through the arena: each rank copies its piece into its
        region but for its own shard (only it reads that, from its own buffer), reduces its
        shard into that gap, and copies every shard's result out.  Two syncs per piece: a
        piece's results are read while they are still in the caches (one sync per piece,
        copying piece k-1's results out after reducing piece k, measured slower at 16 MiB).

        A call in one piece that follows one of the same plan goes through the same half
        (:meth:`LocalGroup.half_for`): a rank that starts it early writes, before the first
        sync, only outside its gap, which no rank reads after the previous call's last sync;
        its gap, which the others still copy out, only after that first sync, which they
        reach when done.  4 ranks on 2 cores, 2026-12-07, 6 rounds in turn in the same
        processes, the same half / the next: 1 MiB 0.81-1.08x the time (0.48-0.93 in
        another run), 2 MiB 0.66-0.82x (0.57-0.83), 3 MiB 0.65-0.93x (0.73-1.47), 4 MiB
        0.67-0.99x (0.91-2.07).  The pieces of a call in several keep taking the halves in
        turn: 1 MiB pieces through one half (the same argument holds between pieces of one
        length) took 1.15-1.33x the time at 8 MiB, 1.08-2.05x at 16 MiB, 0.77-1.25x at 64 MiB."""
        g, me, dt = self.local, self.local.me, x.dtype
        sig: int | None = signature
        one_piece = len(plan.pieces) == 1
        for lo, hi, bounds in plan.pieces:
            rows = g.rows(g.half_for(plan) if one_piece else g.next_half(), dt, hi - lo)
            a, b = bounds[me]
            ops.copy(rows[me][:a], x[lo:lo + a])
            ops.copy(rows[me][b:], x[lo + b:hi])
            g.sync(sig, SPIN_PIECE_US, timeout_s)
            if sig is not None and plan.ways is not None and me == 0:
                self._choose_way(plan.ways)
            sig = None
            inputs = [v[a:b] for v in rows]
            inputs[me] = x[lo + a:lo + b]
            plan.reduce(inputs, rows[me][a:b])
            g.sync(None, SPIN_PIECE_US, timeout_s)
            for j, (a, b) in enumerate(bounds):
                ops.copy(x[lo + a:lo + b], rows[j][a:b])

    def _reduce_direct(self, plan: _Plan, x: np.ndarray, signature: int, timeout_s: float) -> None:
        """One host, one copy each way (cross-memory attach): every rank publishes its
        buffer; local rank j reads the peers' shard j straight from their buffers, piece by
        piece, reduces it and writes the result straight back into every buffer.  Only rank
        j touches shard j anywhere, so nobody waits between: two syncs per call whatever the
        size (the buffers are published and hold the inputs; every shard is written)."""
        g, me, dt = self.local, self.local.me, x.dtype
        step = max(1, CMA_PIECE_BYTES // dt.itemsize)
        if self._cma_rows is None:
            self._cma_rows = np.empty(g.size * CMA_PIECE_BYTES, np.uint8)
        rows = self._cma_rows[:g.size * step * dt.itemsize].view(dt).reshape(g.size, step)
        peers = [lr for lr in range(g.size) if lr != me]
        g.publish(x)
        g.sync(signature, SPIN_PIECE_US, timeout_s)
        if plan.ways is not None and me == 0:
            self._choose_way(plan.ways)
        for lo, hi, _ in plan.pieces:
            inputs = [x[lo:hi] if lr == me else rows[lr, :hi - lo] for lr in range(g.size)]
            for lr in peers:
                g.read_from(lr, lo * dt.itemsize, inputs[lr])
            # (the result lands over this rank's own input, x[lo:hi]; its own row holds the partial sum before it)
            out = plan.reduce(inputs, rows[me, :hi - lo])
            for lr in peers:
                g.write_to(lr, lo * dt.itemsize, out)
        g.sync(None, SPIN_PIECE_US, timeout_s)

    def _all_reduce_whole(self, ctx: CallContext, x: np.ndarray, op: ops.ReduceOp,
                          wire_dtype: np.dtype | None = None) -> None:
        """Across hosts, a small buffer in one piece: local rank 0 reduces it, all-reduces it
        with the other hosts' rank 0 from this thread, and the others copy the result."""
        signature = call_signature(ctx.seq, ctx.check)
        g, xf = self.local, flat(x)
        views = g.rows(g.next_half(), xf.dtype, xf.size)
        ops.copy(views[g.me], xf)
        g.sync(signature, SPIN_SMALL_US, ctx.timeout_s)
        if g.me == 0:
            acc = ops.accumulate(views, op, ctx.scratch(xf.size, ops.accum_dtype(x.dtype)))
            self._inter_all_reduce(acc, op, False, wire_dtype)
            ops.copy(views[0], ops.finalize(acc, op, self.world, xf))
        g.sync(None, SPIN_SMALL_US, ctx.timeout_s)
        if g.me != 0:
            ops.copy(xf, views[0])

    def _all_reduce_pipelined(self, ctx: CallContext, x: np.ndarray, op: ops.ReduceOp,
                              wire_dtype: np.dtype | None) -> None:
        """Between hosts, in two passes over the arena so that the network never waits for
        a whole intra-host stage: pass 1 reduces piece after piece inside the host and starts
        each shard's inter-host all-reduce at once (asynchronously: piece i crosses the
        network while piece i+1 is reduced, and the reducers' client overlaps one call's
        results with the next one's uploads); pass 2 waits for each piece's shard and copies
        the finished shards out.  One sync per piece and pass suffices: a piece's half of the
        arena is written again two pieces later, after a sync every reader has passed."""
        g, xf = self.local, flat(x)
        me, dt, shards = g.me, x.dtype, self.topology.shards
        largest = max(1, g.region_bytes // dt.itemsize)
        pieces = ramped_chunks(0, xf.size, largest, max(1, largest // PIPELINE_RAMP))
        owned = [partition(hi - lo, shards)[me] if me < shards else (0, 0) for lo, hi in pieces]
        accs, works = [], []
        if me < shards:  # one buffer for every piece's shard: each is in flight until pass 2
            whole = ctx.scratch(sum(b - a for a, b in owned), ops.accum_dtype(dt))
            offsets = np.cumsum([0] + [b - a for a, b in owned])
        sig = call_signature(ctx.seq, ctx.check)
        for i, (lo, hi) in enumerate(pieces):
            views = g.rows(g.next_half(), dt, hi - lo)
            ops.copy(views[me], xf[lo:hi])
            g.sync(sig, timeout_s=ctx.timeout_s)
            sig = None
            if me < shards:
                a, b = owned[i]
                acc = ops.accumulate([v[a:b] for v in views], op, whole[offsets[i]:offsets[i + 1]])
                accs.append(acc)
                works.append(self._inter_all_reduce(acc, op, True, wire_dtype))
        for i, (lo, hi) in enumerate(pieces):
            views = g.rows(g.next_half(), dt, hi - lo)
            if me < shards:
                a, b = owned[i]
                works[i].wait()  # (the inter-host call's own deadlines bound this wait)
                ops.finalize(accs[i], op, self.world, views[me][a:b])
            g.sync(None, timeout_s=ctx.timeout_s)
            for j, (a, b) in enumerate(partition(hi - lo, shards)):
                ops.copy(xf[lo + a:lo + b], views[j][a:b])

    def _inter_all_reduce(self, acc: np.ndarray, op: ops.ReduceOp, async_op: bool,
                          wire_dtype: np.dtype | None) -> Any:
        """All-reduce ``acc`` with the inter-host group (its Work when ``async_op``).  The
        partial sums cross hosts unrounded (fp32 for 16-bit types), or on ``wire_dtype`` (each
        host's float32 partial sum rounded once, summed in float32); avg divides once, at the end.
        A float16 overflow is judged once, on the final result, by every rank alike."""
        return self.inter.all_reduce_inner(acc, ops.ReduceOp.SUM if op is ops.ReduceOp.AVG else op,
                                           async_op, wire_dtype)

    def broadcast(self, ctx: CallContext, x: np.ndarray, root: int) -> None:
        g, xf = self.local, flat(x)
        topo = self.topology
        root_host = next(h for h, ranks in enumerate(topo.hosts) if root in ranks)
        home = root_host == topo.host
        src = topo.hosts[root_host].index(root) if home else 0  # who fills the arena on this host
        piece_bytes = g.region_bytes if self.nhosts > 1 else LOCAL_PIECE_BYTES
        sig = call_signature(ctx.seq, ctx.check)
        for lo, hi in chunks(0, xf.size, max(1, piece_bytes // x.dtype.itemsize)):
            half = g.next_half()
            if not home and g.me == 0 and self.inter is not None:
                self.inter.broadcast(xf[lo:hi], root_host)
            rows = g.rows(half, x.dtype, hi - lo)
            if g.me == src:
                ops.copy(rows[src], xf[lo:hi])
            g.sync(sig, timeout_s=ctx.timeout_s)
            sig = None
            if g.me != src:
                ops.copy(xf[lo:hi], rows[src])
            if home and g.me == 0 and self.inter is not None:
                self.inter.broadcast(xf[lo:hi], root_host)

    def barrier(self, ctx: CallContext) -> None:
        self.local.sync(call_signature(ctx.seq, ctx.check), SPIN_SMALL_US, ctx.timeout_s)
        if self.nhosts > 1:
            if self.local.me == 0:
                self.inter.barrier()
            self.local.sync(None, SPIN_SMALL_US, ctx.timeout_s)

    def all_gather(self, ctx: CallContext, x: np.ndarray, out: np.ndarray) -> None:
        """Single host: every rank writes its input, then reads everyone's."""
        g, xf, of = self.local, flat(x), flat(out)
        count, dt = xf.size, x.dtype
        sig = call_signature(ctx.seq, ctx.check)
        for lo, hi in chunks(0, count, max(1, LOCAL_PIECE_BYTES // dt.itemsize)):
            rows = g.rows(g.next_half(), dt, hi - lo)
            ops.copy(rows[g.me], xf[lo:hi])
            g.sync(sig, timeout_s=ctx.timeout_s)
            sig = None
            for lr, r in enumerate(g.ranks):
                ops.copy(of[r * count + lo:r * count + hi], rows[lr])

    def reduce_scatter(self, ctx: CallContext, x: np.ndarray, out: np.ndarray, op: ops.ReduceOp) -> None:
        """Single host: every rank writes its pieces of all segments, then reduces its own."""
        g, xf, of = self.local, flat(x), flat(out)
        count, dt, size = of.size, x.dtype, g.size
        sig = call_signature(ctx.seq, ctx.check)
        for lo, hi in chunks(0, count, max(1, LOCAL_PIECE_BYTES // (dt.itemsize * size))):
            n = hi - lo
            rows = g.rows(g.next_half(), dt, n * size)
            rows[g.me].reshape(size, n)[:] = xf.reshape(size, count)[:, lo:hi]
            g.sync(sig, timeout_s=ctx.timeout_s)
            sig = None
            ops.reduce_rows(rows[:, g.me * n:(g.me + 1) * n], op, size, of[lo:hi])

    # -- failure and shutdown ---------------------------------------------------------------

    def fail(self, reason: str) -> None:
        """This rank gives up: wake the local ranks and the inter-host group with ``reason``."""
        self.local.abort(reason)
        if self.inter is not None:
            self.inter.peers.fail(reason)
            if self.inter.servers is not None:  # its reducers wait for our shard: tell them why not
                self.inter.servers.fail(reason)
        self._stop()

    def close(self) -> None:
        self._stop()
        if self.inter is not None:
            self.inter.close()
        self.local.close()

    def _stop(self) -> None:
        with self._turn:
            self._broken = True
            self._turn.notify_all()


def call_signature(seq: int, check: int) -> int:
    """A call's number and its 16-bit check, as local ranks compare them at a sync: local
    ranks in another call, or the same call with another dtype, size or op, differ here."""
    return ((seq + 1) << 16) | check
