"""The Communicator: collectives on numpy arrays over Fast Socket connections."""

from __future__ import annotations

import contextvars
import functools
import logging
import random
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import ops, wire
from ..bootstrap import PeerTable
from ..config import Config, KiB
from ..errors import ConfigError, PeerFailure, RedsockError, TransportError, WireOverflow
from ..transport import Connection, irecv_any, shm
from . import ring, server_client, small
from .context import CallContext, Finish, ScratchPool, signature_check, timeout_for_call
from .hierarchy import Hierarchy
from .server_client import ServerGroup

log = logging.getLogger("redsock.collectives")

# Below this many bytes `auto` uses recursive doubling, above it the ring (measured:
# README "Tuning"; 4 ranks on loopback cross over between 64 KiB and 256 KiB).
SMALL_MAX_BYTES = 128 * KiB

_COLLECTIVE_TAG = 1 << 62  # tag spaces: collectives vs user point-to-point
_P2P_TAG = 1 << 61

# (ctx, x, op, wire dtype or None) -> what is left to wait for.  The small algorithm is
# latency-bound, so it carries float32 whatever the wire: halving its bytes saves nothing.
Algorithm = Callable[[CallContext, np.ndarray, ops.ReduceOp, "np.dtype | None"], Finish | None]
ALLREDUCE_ALGORITHMS: dict[str, Algorithm] = {
    "ring": ring.all_reduce, "small": small.all_reduce, "server": server_client.all_reduce}
# With servers configured, `auto` sends all-reduces of at least this size to them.
SERVER_MIN_BYTES = 64 * KiB


class Work:
    """Handle of an ``async_op=True`` collective (a thin wrapper over a Future)."""

    def __init__(self, future: Future):
        self._future = future

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; re-raises the collective's error (e.g. :class:`PeerFailure`)."""
        return self._future.result(timeout)

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> Future:
        """The underlying :class:`concurrent.futures.Future`.  Callbacks added to it with
        ``add_done_callback`` run on the communicator's thread that finished the collective
        (as concurrent.futures does): keep them short, and never wait there for another
        collective of this communicator — it would wait for the very thread it blocks.  To
        chain collectives, wait in your own thread; the torch backend's futures run
        callbacks on threads of their own (:mod:`redsock.torch.work`)."""
        return self._future


class Communicator:
    """Collectives among ``world_size`` ranks.  Create with :func:`redsock.init`.

    All ranks must call the same collectives in the same order with matching
    sizes and dtypes; a mismatch raises :class:`ConfigError`/:class:`PeerFailure`
    rather than producing a wrong result.  After a :class:`PeerFailure` the
    communicator is unusable (like NCCL's): create a new one.

    Ranks that share a host (see :class:`redsock.bootstrap.Topology`) meet in shared memory
    (:mod:`redsock.collectives.hierarchy`) unless ``shm``/``hierarchy`` say ``off``.
    ``global_ranks``: for a communicator inside another one (an inter-host group), the outer
    ranks of its members, which its failures name.
    """

    def __init__(self, rank: int, world_size: int, store: Any, config: Config | None = None, *,
                 group: str = "", namespace: str | None = None, advertise_toward: str | None = None,
                 global_ranks: Sequence[int] | None = None):
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} outside a world of {world_size}")
        self.rank, self.world_size = rank, world_size
        self.config = config or Config.from_env()
        self._wire_default = ops.wire_dtype(self.config.wire_dtype)  # (parsed once: small calls count µs)
        self._global_ranks = tuple(global_ranks) if global_ranks is not None else tuple(range(world_size))
        self.peers = PeerTable(rank, world_size, store, self.config, group=group, namespace=namespace,
                               advertise_toward=advertise_toward)
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._failure: PeerFailure | None = None
        self._executor: ThreadPoolExecutor | None = None  # starts async calls, in order
        self._drainer: ThreadPoolExecutor | None = None  # finishes them, in order
        self._pool = ScratchPool()
        self.servers: ServerGroup | None = None
        self.hier: Hierarchy | None = None
        self._closed = False
        #: The hierarchy when every all-reduce of default algorithm runs on this one host (the fast path).
        self._here: Hierarchy | None = None
        try:
            if self._uses_hierarchy():
                self.hier = Hierarchy(self.peers, self.config, functools.partial(
                    self._inter_host_comm, store, advertise_toward))
                if self.hier.nhosts == 1 and self.config.algo in ("auto", "hier"):
                    self._here = self.hier
            if self.config.servers:
                self.servers = ServerGroup(self.config.servers, self.config, self._job_id(store), rank, world_size,
                                           self._global_ranks)
        except BaseException:
            self.close()
            raise

    def _uses_hierarchy(self) -> bool:
        """Shared memory when a host runs several ranks (``shm``), and then across hosts only
        with ``hierarchy`` on: every rank sees the same topology, so all decide alike."""
        hosts = self.peers.topology.hosts
        return (self.config.shm == "auto" and shm.available() and max(map(len, hosts)) > 1
                and (len(hosts) == 1 or self.config.hierarchy == "auto"))

    def _inter_host_comm(self, store: Any, advertise_toward: str | None, rank: int, world: int, group: str,
                         ranks: Sequence[int]) -> "Communicator":
        # The host's shards all cross its one link, as a rank's connections to several reducers do.
        config = self.config.sharing_link(self.peers.topology.shards)
        return Communicator(rank, world, store, config, group=group, namespace=self.peers.namespace,
                            advertise_toward=advertise_toward,
                            global_ranks=[self._global_ranks[r] for r in ranks])

    # -- public collectives ---------------------------------------------------

    def all_reduce(self, array: np.ndarray, op: Any = "sum", algorithm: str | None = None,
                   async_op: bool = False, wire_dtype: str | None = None) -> Work | None:
        """Reduce ``array`` across ranks, in place.  ``algorithm``: ``ring``, ``small``,
        or None/``auto`` (by size).  Returns a :class:`Work` when ``async_op``.

        ``wire_dtype``: ``"bf16"``/``"fp16"`` send a float32 sum or avg as 16 bits (rounded
        once per rank, summed in float32, the result rounded once: :mod:`redsock.ops`),
        ``"off"`` as float32; None: ``REDSOCK_WIRE_DTYPE``, which other dtypes and ops ignore,
        whereas asking for it here with them raises :class:`ConfigError`.  On the fp16 wire
        a result that is not finite raises :class:`~redsock.errors.WireOverflow` on every rank.
        """
        here = self._here
        if here is not None and type(array) is np.ndarray and not (async_op or algorithm or wire_dtype):
            # A synchronous call of a shape this host ran before, in the fewest Python steps
            # (after each process switch every step runs cache-cold, several times its warm
            # cost): its plan was made after the checks below, so only the array's layout is
            # left to check.  (An unknown name finds no plan: the checks below refuse it.)
            plan = here.plans.get((array.dtype, array.size,
                                   ops.OP_OF_NAME.get(op) if type(op) is str else ops.ReduceOp.parse(op)))
            if plan is not None:
                flags = array.flags
                if flags.c_contiguous and flags.writeable:
                    return self._all_reduce_here(array, plan)
        x = _check_array(array, "all_reduce", writable=True)
        rop = ops.ReduceOp.parse(op)
        explicit = wire_dtype is not None
        wire = ops.wire_dtype(wire_dtype) if explicit else self._wire_default
        if wire is not None:
            wire = ops.wire_for(x.dtype, rop, wire, explicit)
        return self._all_reduce(x, rop, algorithm, async_op, wire, check=True)

    def all_reduce_inner(self, x: np.ndarray, op: ops.ReduceOp, async_op: bool,
                         wire_dtype: np.dtype | None) -> Work | None:
        """:meth:`all_reduce` for a stage of an outer collective (the hierarchy's inter-host
        one): exactly ``wire_dtype`` (None: x's own dtype), and no overflow verdict, which
        the outer call gives once, on its final result, on every rank."""
        return self._all_reduce(x, op, None, async_op, wire_dtype, check=False)

    def _all_reduce(self, x: np.ndarray, rop: ops.ReduceOp, algorithm: str | None, async_op: bool,
                    wire: np.dtype | None, check: bool) -> Work | None:
        algo = self.choose_algorithm(x.nbytes, algorithm)
        # The wire type is part of the call's signature: ranks that disagree fail, not sum garbage.
        signature = (x.dtype, x.size, rop, algo) if wire is None else (x.dtype, x.size, rop, algo, wire)
        if algo == "hier":
            if not async_op and self.hier.runs_here(x.nbytes):  # one host: no wire to shrink
                return self._all_reduce_here(x, self.hier.plan(x, rop))
            body, shared = (lambda ctx: self.hier.all_reduce(ctx, x, rop, wire)), True
        else:
            run = ALLREDUCE_ALGORITHMS[algo]
            body, shared = (lambda ctx: run(ctx, x, rop, wire) if self.world_size > 1 else _solo(x, rop)), False
        if check and wire is not None:
            body = _checked(body, x, wire)
        return self._run("all_reduce", signature, body, async_op, shared=shared)

    def _check_pair(self, what: str, input: np.ndarray, output: np.ndarray,
                    whole: str) -> tuple[np.ndarray, np.ndarray]:
        """The checked arrays of a collective whose ``whole`` side ("input" or "output") holds
        world_size times the other side's elements."""
        x = _check_array(input, f"{what} input", writable=False)
        out = _check_array(output, f"{what} output", writable=True)
        _same_dtype(x, out, what)
        big, small, part = (x, out, "output") if whole == "input" else (out, x, "input")
        if big.size != small.size * self.world_size:
            raise ConfigError(f"{what}: {whole} has {big.size} elements, expected world_size × {part} "
                              f"= {self.world_size} × {small.size}")
        return x, out

    def reduce_scatter(self, input: np.ndarray, output: np.ndarray, op: Any = "sum",
                       async_op: bool = False) -> Work | None:
        """``output`` (count elements) = the reduction of every rank's ``input`` (world × count),
        segment ``rank``."""
        x, out = self._check_pair("reduce_scatter", input, output, whole="input")
        rop = ops.ReduceOp.parse(op)
        if self._single_host_shm():
            return self._run("reduce_scatter", (x.dtype, out.size, rop),
                             lambda ctx: self.hier.reduce_scatter(ctx, x, out, rop), async_op, shared=True)

        def go(ctx: CallContext) -> None:
            if self.world_size == 1:
                ops.finalize(ops.init_acc(x).reshape(out.shape), rop, 1, out)
            else:
                ring.reduce_scatter(ctx, x, out, rop)

        return self._run("reduce_scatter", (x.dtype, out.size, rop), go, async_op)

    def all_gather(self, input: np.ndarray, output: np.ndarray, async_op: bool = False) -> Work | None:
        """``output`` (world × count) = every rank's ``input`` (count), in rank order."""
        x, out = self._check_pair("all_gather", input, output, whole="output")
        if self._single_host_shm():
            return self._run("all_gather", (x.dtype, x.size), lambda ctx: self.hier.all_gather(ctx, x, out),
                             async_op, shared=True)

        def go(ctx: CallContext) -> None:
            if self.world_size == 1:
                out.reshape(-1)[:] = x.reshape(-1)
            else:
                ring.all_gather(ctx, x, out)

        return self._run("all_gather", (x.dtype, x.size), go, async_op)

    def broadcast(self, array: np.ndarray, root: int = 0, async_op: bool = False) -> Work | None:
        """Copy ``array`` of rank ``root`` into ``array`` of every rank."""
        x = _check_array(array, "broadcast", writable=True)
        self._check_rank(root, "broadcast root")
        if self.hier is not None:
            return self._run("broadcast", (x.dtype, x.size, root), lambda ctx: self.hier.broadcast(ctx, x, root),
                             async_op, shared=True)
        return self._run("broadcast", (x.dtype, x.size, root),
                         lambda ctx: small.broadcast(ctx, x, root) if self.world_size > 1 else None, async_op)

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        if self.hier is not None:
            self._run("barrier", (), self.hier.barrier, False, shared=True)
            return
        token = np.zeros(1, np.uint8)
        self._run("barrier", (), lambda ctx: small.all_reduce(ctx, token, ops.ReduceOp.SUM)
                  if self.world_size > 1 else None, False)

    def send(self, array: np.ndarray, dst: int, tag: int = 0) -> None:
        """Send ``array`` to rank ``dst`` (matched by ``tag``, in order)."""
        x = _check_array(array, "send", writable=False)
        limit = timeout_for_call(self.config.timeout_s)
        self._p2p(dst, "send", lambda conn: conn.send(x, _P2P_TAG | _user_tag(tag), timeout=limit))

    def recv(self, array: np.ndarray, src: int | None = None, tag: int = 0, timeout: float | None = None) -> int:
        """Receive the next message with ``tag`` from rank ``src`` into ``array`` (sizes must
        match); with ``src=None``, from whichever rank's message arrives first (each rank's
        messages still in order).  Returns the sender's rank.  ``timeout``: seconds without
        progress (default: the ``call_timeout`` in effect, else ``REDSOCK_TIMEOUT_S``)."""
        x = _check_array(array, "recv", writable=True)
        limit = timeout_for_call(self.config.timeout_s) if timeout is None else timeout
        if src is not None:
            self._p2p(src, "recv", lambda conn: conn.recv(x, _P2P_TAG | _user_tag(tag), timeout=limit))
            return src
        self._check_usable()
        if self.world_size == 1:
            raise ConfigError("recv from any source in a world of 1: no other rank can send")
        try:
            rank, handle = irecv_any(self._senders, x, _P2P_TAG | _user_tag(tag), timeout=limit)
            handle.wait(limit)
        except RedsockError as e:
            raise self._failed("recv from any source", None, e) from e
        return rank

    def _senders(self) -> dict[int, Connection]:
        """The peers that can send to this rank now.  A higher rank waits for this one to
        connect before it sends, so connect to all of them; a lower rank connects itself."""
        for peer in range(self.rank + 1, self.world_size):
            self.peers.get(peer)
        return self.peers.connections()

    def close(self) -> None:
        """Close every connection.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        for pool in (self._executor, self._drainer):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        if self.servers is not None:
            self.servers.close()
        if self.hier is not None:
            self.hier.close()
        self.peers.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def choose_algorithm(self, nbytes: int, algorithm: str | None) -> str:
        algo = algorithm or self.config.algo
        if algo == "hier":
            if self.hier is None:
                raise ConfigError("the hier all-reduce needs several ranks on a host, with shm and hierarchy "
                                  f"on (hosts: {[len(h) for h in self.peers.topology.hosts]} ranks, "
                                  f"shm={self.config.shm}, hierarchy={self.config.hierarchy})")
            return algo
        if algo == "auto":
            if self.hier is not None:  # shared memory inside hosts; between them the choice below, per shard
                return "hier"
            if self.servers is not None and nbytes >= SERVER_MIN_BYTES:
                return "server"
            return "small" if nbytes <= SMALL_MAX_BYTES else "ring"
        if algo not in ALLREDUCE_ALGORITHMS:
            raise ConfigError(f"unknown all-reduce algorithm {algo!r}; choose from auto, "
                              + ", ".join(ALLREDUCE_ALGORITHMS))
        return algo

    # -- machinery ------------------------------------------------------------------

    def _single_host_shm(self) -> bool:
        return self.hier is not None and self.hier.nhosts == 1

    def _job_id(self, store: Any) -> int:
        """A job id all ranks share (rank 0 draws it), so servers keep jobs apart."""
        key = self.peers.prefix + "job"
        if self.rank == 0:
            store.set(key, str(random.getrandbits(63)))
        value = store.get(key)
        return int(value.decode() if isinstance(value, bytes) else value)

    def _run(self, name: str, signature: tuple, body: Callable[[CallContext], Finish | None], async_op: bool,
             shared: bool = False) -> Work | None:
        """Run one collective.  A ``body`` may return a ``finish`` that waits for its last
        results: an async call then hands it to the drain thread, and the next call starts
        while this one drains (calls start in order; drains finish in order).  ``shared``:
        the body uses the shared-memory arena, which serves calls one at a time in call order."""
        seq, ticket = self._number_call(shared)
        if shared:
            body = functools.partial(self.hier.in_turn, ticket, body)
        check = signature_check(name, signature)
        ctx = CallContext(self.peers, self.rank, self.world_size, _COLLECTIVE_TAG | seq, check,
                          timeout_for_call(self.config.timeout_s), self._pool, seq, self.servers)

        if not async_op:  # straight through, in the caller's thread (no closures: small calls count µs)
            try:
                rest = body(ctx)
                if rest is not None:
                    rest()
            except RedsockError as e:
                raise self._failed(name, seq, e) from e
            finally:
                ctx.release()
            return None

        def guarded(step: Callable[[], Finish | None]) -> Finish | None:
            try:
                return step()
            except RedsockError as e:
                raise self._failed(name, seq, e) from e

        def finish(rest: Finish) -> None:
            try:
                guarded(rest)
            finally:
                ctx.release()

        def start() -> Finish | None:
            rest = None
            try:
                rest = guarded(lambda: body(ctx))
                return rest
            finally:
                if rest is None:  # failed, or complete: nothing left for finish() to release
                    ctx.release()

        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"redsock-r{self.rank}")
            self._drainer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"redsock-r{self.rank}-drain")
        done: Future = Future()

        def run() -> None:  # settles ``done``, or leaves it to the drain thread
            rest = start()
            if rest is None:
                done.set_result(None)
            else:
                _chain(self._drainer.submit(finish, rest), done)

        # In the caller's context: calls the body makes itself (the hierarchy's inter-host
        # ones) keep the caller's call_timeout.
        _chain(self._executor.submit(contextvars.copy_context().run, run), done, only_failures=True)
        return Work(done)

    def _number_call(self, shared: bool) -> tuple[int, int]:
        """The next call's number and, for one that uses the shared arena (``shared``), its
        ticket there (else -1)."""
        self._check_usable()
        with self._seq_lock:  # every rank numbers its calls the same way: the tag is the call number
            seq = self._seq
            self._seq += 1
            return seq, next(self.hier.tickets) if shared else -1

    def _all_reduce_here(self, x: np.ndarray, plan: Any) -> None:
        """A synchronous all-reduce on one host by its prepared ``plan``:
        :meth:`Hierarchy.all_reduce_here`, with none of :meth:`_run`'s call context (it says why)."""
        if self._closed or self._failure is not None:
            self._check_usable()
        hier = self.hier
        with self._seq_lock:  # (_number_call's, inline: a call costs more than these lines)
            seq = self._seq
            self._seq = seq + 1
            ticket = next(hier.tickets)
        try:
            hier.all_reduce_here(ticket, plan, x, seq, timeout_for_call(self.config.timeout_s))
        except RedsockError as e:
            raise self._failed("all_reduce", seq, e) from e

    def _p2p(self, peer: int, what: str, io: Callable[[Any], None]) -> None:
        self._check_usable()
        self._check_rank(peer, what)
        if peer == self.rank:
            raise ConfigError(f"rank {self.rank}: {what} to itself")
        try:
            io(self.peers.get(peer))
        except RedsockError as e:
            raise self._failed(what, None, e) from e

    def _failed(self, name: str, seq: int | None, err: RedsockError) -> RedsockError:
        """Turn a transport failure into a PeerFailure naming the failed rank(s), and tell
        every connected rank, so ranks not adjacent to the failure stop waiting too."""
        if isinstance(err, (ConfigError, WireOverflow)) or (isinstance(err, PeerFailure) and err is self._failure):
            return err
        ranks = _failed_ranks(err, self.peers, self._global_ranks)
        call = f"{name} #{seq}" if seq is not None else name
        who = f"rank(s) {', '.join(map(str, ranks))} failed: " if ranks else ""
        failure = PeerFailure(f"rank {self.rank}: {call} failed: {who}{err}", ranks=tuple(ranks))
        if self._failure is None:
            self._failure = failure
            reason = wire.failed_ranks_reason(ranks, f"rank {self.rank} gives up: {err}")
            self.peers.fail(reason)
            if self.hier is not None:  # local ranks wait in shared memory: wake them with the reason
                self.hier.fail(reason)
            if self.servers is not None:  # nothing more will be asked of the reducers: tell them why
                self.servers.fail(reason)
        return failure

    def _check_usable(self) -> None:
        if self._closed:
            raise ConfigError("communicator is closed")
        if self._failure is not None:
            raise PeerFailure(f"communicator unusable after an earlier failure: {self._failure}",
                              ranks=self._failure.ranks)

    def _check_rank(self, r: int, what: str) -> None:
        if not isinstance(r, (int, np.integer)) or not 0 <= r < self.world_size:
            raise ConfigError(f"{what} {r!r} is not a rank of a world of {self.world_size}")


def _chain(source: Future, target: Future, only_failures: bool = False) -> None:
    """Settle ``target`` as ``source`` settles (``only_failures``: only if ``source`` failed
    or was cancelled by close()), so that no call is left pending."""
    def copy(f: Future) -> None:
        if f.cancelled():
            target.cancel()
        elif f.exception() is not None:
            target.set_exception(f.exception())
        elif not only_failures:
            target.set_result(f.result())
    source.add_done_callback(copy)


def _failed_ranks(err: RedsockError, peers: PeerTable, global_ranks: Sequence[int]) -> list[int]:
    """The failed ranks, named as ``global_ranks`` names them (the reasons ranks tell each
    other already name them so)."""
    told = wire.failed_ranks_in(str(err))
    if told is not None and not isinstance(err, PeerFailure):  # another rank already diagnosed it and told us
        return list(told)
    return sorted({global_ranks[r] for r in _own_failed_ranks(err, peers) if 0 <= r < len(global_ranks)})


def _own_failed_ranks(err: RedsockError, peers: PeerTable) -> list[int]:
    if isinstance(err, PeerFailure):
        return list(err.ranks)
    if isinstance(err, TransportError) and err.peer:
        for r, conn in peers.connections().items():
            if conn.peer == err.peer:
                return [r]
        m = re.match(r"rank (\d+)", err.peer)
        if m:
            return [int(m.group(1))]
    return []


def _check_array(a: Any, what: str, *, writable: bool) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise ConfigError(f"{what}: expected a numpy array, got {type(a).__name__}")
    ops.check_dtype(a.dtype)
    if not a.flags.c_contiguous:
        raise ConfigError(f"{what}: array is not C-contiguous (use np.ascontiguousarray, then copy back)")
    if writable and not a.flags.writeable:
        raise ConfigError(f"{what}: array is read-only")
    return a


def _same_dtype(a: np.ndarray, b: np.ndarray, what: str) -> None:
    if a.dtype != b.dtype:
        raise ConfigError(f"{what}: input is {a.dtype} but output is {b.dtype}")


def _user_tag(tag: int) -> int:
    if not isinstance(tag, (int, np.integer)) or not 0 <= tag < _P2P_TAG:
        raise ConfigError(f"tag must be an integer in [0, 2**61), got {tag!r}")
    return int(tag)


def _checked(body: Callable[[CallContext], Finish | None], x: np.ndarray,
             wire: np.dtype) -> Callable[[CallContext], Finish | None]:
    """``body`` followed, once its results are in, by the wire's overflow verdict on ``x``."""
    def run(ctx: CallContext) -> Finish | None:
        rest = body(ctx)
        if rest is None:
            ops.check_wire_result(x, wire)
            return None

        def finish() -> None:
            rest()
            ops.check_wire_result(x, wire)
        return finish
    return run


def _solo(x: np.ndarray, op: ops.ReduceOp) -> None:
    """A world of one: the reduction of a single contribution (16-bit rounding unchanged)."""
    ops.finalize(ops.init_acc(x), op, 1, x)
