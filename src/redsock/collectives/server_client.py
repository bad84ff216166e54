"""All-reduce through reduction servers: each piece goes out once and comes back reduced once.

The buffer is cut into pieces of ``REDSOCK_PIECE_BYTES``; piece i belongs to
server (i + call number) mod S (the same on every rank, and balanced by bytes over calls).  A worker
announces the call to each server, then streams its pieces with at most
``WINDOW`` outstanding per server, while the reduced pieces stream back
straight into the caller's array: pushing piece i+1 overlaps pulling piece i.
Per worker that is S bytes out and S bytes in, whatever the number of workers.
A small call runs in the caller's thread end to end: its only piece per server
rides in the announce's inline record, and the caller reads the result off the
control stream itself (the transport's inline path).

The window is the connection's, not the call's: a call returns once its last
piece is posted, with a ``finish`` that waits for its results, so the next call
(DDP's next gradient bucket) streams out while this one's last results come back
and the link never idles between calls.

On a 16-bit wire (``wire_dtype``: bfloat16 or float16, for float32 data) the worker rounds its
buffer once, sends and receives the pieces in 16 bits (half the bytes each way), and widens
each reduced piece into the caller's array as it lands; the reducer sums in float32.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NoReturn

import numpy as np

from .. import ops, wire
from ..config import Config, parse_hostport
from ..errors import PeerFailure, TransportError
from ..server.daemon import WINDOW
from ..transport import Connection, Handle, connect
from . import ring, small
from .context import CallContext, Finish, flat

log = logging.getLogger("redsock.collectives")

#: While the reducers are unusable and calls fall back to ring, warn at most this often.
FALLBACK_WARNING_S = 10.0
#: After a call fell back to ring, the reducers are tried again once this many times what the
#: failed try cost has passed: a refused connection (a reducer restarting) costs microseconds and
#: is retried at the next call, a host that is gone costs a timeout and is retried after four
#: (at most a fifth of the time goes to trying, not one timeout per call).
RETRY_COST_FACTOR = 4.0


class ServerGroup:
    """This rank's connections to the reduction servers, (re)opened on demand.

    Reopened only while the job may still use the reducers: with ``REDSOCK_SERVER_FALLBACK=ring``
    a later call tries them again; without it, the first failure is the job's last word there
    (:meth:`fail`).  A connection reopened after that would start a new job at the reducer
    under the same id, whose round waits for the ranks that are gone and then blames the
    one that is missing there, which may only have given up (hier-reducers / worker SIGKILL
    named the dead rank's host-mate).

    ``_lock`` guards ``_conns``, ``in_flight`` and ``_failure``; it is a leaf: connections are
    opened under it, but never failed or closed under it.
    """

    def __init__(self, servers: tuple[str, ...], config: Config, job: int, rank: int, world: int,
                 global_ranks: Sequence[int] | None = None):
        self.addresses = [parse_hostport(s) for s in servers]
        # The world's rank of each rank of this job (a hierarchical job's inter-host group is a
        # job of its own at the reducers, which name its ranks as it numbers them).
        self.global_ranks = tuple(global_ranks) if global_ranks is not None else tuple(range(world))
        # A worker's link carries its connections to every reducer: split the stream budget
        # among them (the reducers already spread the flows) rather than multiply it.
        self.config = config.sharing_link(len(self.addresses))
        self.job, self.rank, self.world = job, rank, world
        self._conns: list[Connection | None] = [None] * len(self.addresses)
        # Per server, the results of the pieces in flight to it (of this call and earlier
        # ones still finishing): a worker may send a piece once the result WINDOW pieces back is in.
        self.in_flight: list[deque[Handle]] = [deque() for _ in self.addresses]
        self._lock = threading.Lock()
        self._failure: TransportError | None = None  # set once by fail(): no connection is opened again
        self._fallbacks_unreported = 0  # ring fallbacks since the last warning
        self._last_warning = -float("inf")
        # Since when calls go to ring (None: they try the reducers), and for how long before
        # the next try.  Changed only by a call's outcome, which every rank agrees on.
        self.down_since: float | None = None
        self.retry_after_s = 0.0

    def warn_fallback(self, seq: int, reason: object) -> None:
        """Warn that call ``seq`` is finished by ring: the first time, then at most once per
        FALLBACK_WARNING_S with the count since (a reducer down for a minute must not write a
        line per call)."""
        self._fallbacks_unreported += 1
        now = time.monotonic()
        if now - self._last_warning < FALLBACK_WARNING_S:
            return
        more = f" ({self._fallbacks_unreported} calls since the last warning)" if self._fallbacks_unreported > 1 else ""
        log.warning("all-reduce #%d: %s; finishing it by ring all-reduce (REDSOCK_SERVER_FALLBACK=ring)%s",
                    seq, reason, more)
        self._fallbacks_unreported, self._last_warning = 0, now

    def in_world_ranks(self, e: TransportError) -> TransportError:
        """``e`` with a reducer's own diagnosis (ranks of this job) also named in world ranks,
        as every other failure note is, so that the communicator names the right ranks."""
        job_ranks = wire.failed_job_ranks_in(str(e))
        if job_ranks is None or wire.failed_ranks_in(str(e)) is not None:
            return e
        ranks = [self.global_ranks[r] for r in job_ranks if 0 <= r < len(self.global_ranks)]
        named = TransportError(wire.failed_ranks_reason(ranks, str(e)), peer=e.peer, op=e.op)
        named.__cause__ = e
        return named

    def conn(self, i: int) -> Connection:
        """The connection to reducer ``i``, opened if need be; raises the group's failure once
        it has one (a connection that failed counts as one unless the fallback is armed)."""
        with self._lock:
            c = self._conns[i]
            if self._failure is None and c is not None and c.error is not None and not self.retries():
                self._failure = self.in_world_ranks(TransportError(
                    f"reduction server {self.name(i)}: connection is down ({c.error})", peer=c.peer, op="connect"))
            if self._failure is not None:
                raise self._failure
            if c is None or c.closed:  # with the fallback, a restarted reducer is used again from the next call
                if c is not None:
                    c.close()
                c = self._conns[i] = connect(self.addresses[i], config=self.config, name=f"rank{self.rank}",
                                             peer_name=f"reduction server {self.name(i)}")
            return c

    def retries(self) -> bool:
        """Whether a failed reducer is tried again later (``REDSOCK_SERVER_FALLBACK=ring``)."""
        return self.config.server_fallback == "ring" and self.world > 1

    def name(self, i: int) -> str:
        return "%s:%d" % self.addresses[i]

    def fail(self, reason: str) -> None:
        """The job is done with the reducers: tell each one ``reason`` (:meth:`close`), and
        from now on raise it rather than open a connection (calls already queued behind the
        failed one would otherwise reopen the job at the reducer)."""
        with self._lock:
            if self._failure is None:
                self._failure = TransportError(reason, op="connect")
        self.close(reason)

    def close(self, reason: str | None = None) -> None:
        """Close every connection; with ``reason``, tell each reducer why first (a worker that
        gives up because of another reducer or rank passes that diagnosis on, rather than
        looking like the rank that failed)."""
        with self._lock:
            conns = self._conns
            self._conns = [None] * len(self.addresses)
            # Fresh queues: a call still posting keeps the old one, whose handles now fail.
            self.in_flight = [deque() for _ in self.addresses]
        for c in conns:  # failing a connection takes its locks: not under ours
            if c is not None:
                if reason is not None:
                    c.abort(reason)
                c.close()


def all_reduce(ctx: CallContext, x: np.ndarray, op: ops.ReduceOp,
               wire_dtype: np.dtype | None = None) -> Finish | None:
    """Start the call; returns ``finish`` (wait for the results) unless it is already complete.
    ``wire_dtype``: the 16-bit type the pieces travel as (float32 ``x`` only), None for ``x``'s own."""
    group = ctx.servers
    if group is None:
        raise PeerFailure("algorithm 'server' needs reduction servers (REDSOCK_SERVERS or init(servers=...))")
    if not group.retries():
        return _through_servers(ctx, group, x, op, wire_dtype)
    # Fallback armed: keep the input, and let every rank agree on the outcome, so that
    # either all ranks keep the servers' result or all redo the call by ring.
    if group.down_since is not None:
        # The reducers failed a recent call: try them again once every rank's wait is over (a
        # rank that tried alone would keep the others waiting on a connect to a dead host).
        due = np.array([time.monotonic() - group.down_since >= group.retry_after_s], np.uint8)
        small.all_reduce(ctx, due, ops.ReduceOp.MIN)
        if not due[0]:
            group.warn_fallback(ctx.seq, "the reduction servers failed a recent call")
            ring.all_reduce(ctx, x, op)
            return None
    t0 = time.monotonic()
    saved = ctx.scratch(x.size, x.dtype)
    saved[:] = flat(x)
    failure: BaseException | None = None
    # First agree that every rank reaches every reducer: a rank that went ahead alone would
    # wait at a reducer for contributions that never come.
    try:
        nserv = len(group.addresses)
        itemsize = (x.dtype if wire_dtype is None else wire_dtype).itemsize
        npieces = -(-x.size // piece_elements(x.size, itemsize, nserv, group.config.piece_bytes))
        for p in range(min(nserv, npieces)):  # the reducers the call uses, as _through_servers picks them
            group.conn((p + ctx.seq) % nserv)
    except TransportError as e:
        group.close()
        failure = e
    reachable = np.array([0 if failure else 1], np.uint8)
    small.all_reduce(ctx, reachable, ops.ReduceOp.MIN)
    if reachable[0]:
        try:
            _through_servers(ctx, group, x, op, wire_dtype)()  # all ranks must agree on the outcome first
        except (PeerFailure, TransportError) as e:
            # Even a reducer's word that rank r failed (wire.failed_ranks_reason) may only mean
            # that rank r gave up this call because another reducer failed (it closes all its
            # reducer connections): the agreement below, over the workers' own connections,
            # raises naming a rank that is really gone, and falls back to ring when every rank
            # is still there.
            failure = e
    ok = np.array([0 if failure or not reachable[0] else 1], np.uint8)
    small.all_reduce(ctx, ok, ops.ReduceOp.MIN)
    if ok[0]:
        group.down_since = None
        return None
    group.down_since = time.monotonic()
    group.retry_after_s = RETRY_COST_FACTOR * (group.down_since - t0)
    group.warn_fallback(ctx.seq, failure or "a reduction server failed on another rank")
    flat(x)[:] = saved
    ring.all_reduce(ctx, x, op, wire_dtype)
    return None


#: A message is cut into at least this many pieces per server (when pieces stay above
#: MIN_PIECE_BYTES): a reducer forwards a piece only once it has all of it from every worker,
#: so its link idles until a first round of pieces is in (the fill), and a worker's flows to
#: the reducers never progress quite evenly, so pieces wait for the last worker's share: both
#: cost a round of pieces, a quarter of the message with 4 pieces per server, a sixteenth with
#: 16.  4 workers + 4 reducers, 4 MiB, 2 alternating rounds: 59-64 ms -> 41-42 ms at 1 Gbit/s
#: (0.83-0.86x -> 1.25-1.29x gloo), 108-110 ms -> 82 ms at 500 Mbit/s; 2 + 2 at 1 Gbit/s,
#: 1 MiB: 13.0-13.2 ms -> 8.9-9.1 ms.  Below 64 KiB a piece's own cost shows: 16 KiB pieces
#: took 4 + 4 at 1 MiB from 0.9x to 0.4x gloo (the machine CPU-bound).
PIECES_PER_SERVER = 16
MIN_PIECE_BYTES = 64 * 1024


def piece_elements(count: int, itemsize: int, nservers: int, piece_bytes: int) -> int:
    """Elements per piece for a ``count``-element message: ``piece_bytes`` at most, and small
    enough that each server gets ``PIECES_PER_SERVER`` pieces to pipeline (the same on every rank)."""
    want = -(-count * itemsize // (nservers * PIECES_PER_SERVER))
    nbytes = min(piece_bytes, max(MIN_PIECE_BYTES, want))
    return max(1, nbytes // itemsize)


def _piece_nbytes(xf: np.ndarray, piece: int, p: int) -> int:
    return (min(xf.size, (p + 1) * piece) - p * piece) * xf.itemsize


def _take_credit(in_flight: deque[Handle], timeout_s: float) -> None:
    """Wait until fewer than WINDOW pieces are in flight to a server (it posts WINDOW receives)."""
    while len(in_flight) >= WINDOW:
        in_flight.popleft().wait(timeout_s)


def _through_servers(ctx: CallContext, group: ServerGroup, x: np.ndarray, op: ops.ReduceOp,
                     wire_dtype: np.dtype | None) -> Finish:
    """Announce the call and post every piece (waiting only for window credits); the
    returned ``finish`` waits for the reduced pieces (and widens them, on a 16-bit wire)."""
    out = flat(x)
    # What travels: x itself, or x rounded once to the wire type (the results land there too).
    xf = out if wire_dtype is None else ops.to_wire(out, ctx.scratch(out.size, wire_dtype))
    codes = ops.dtype_code(x.dtype), 0 if wire_dtype is None else ops.dtype_code(wire_dtype)
    nserv = len(group.addresses)
    piece = piece_elements(xf.size, xf.itemsize, nserv, group.config.piece_bytes)
    npieces = -(-xf.size // piece)
    flags = wire.FLAG_DETERMINISTIC if group.config.deterministic else 0
    # Piece p goes to reducer (p + first) mod S, ``first`` turning with the call number: a call
    # of n pieces gives S - n mod S reducers one piece fewer, and always the same ones would
    # carry more than their share (a 32 MiB hierarchical call in 14-piece shards on 4 reducers:
    # 4, 4, 3, 3 pieces, and reducer 0's link, not the hosts', set the pace).
    first = ctx.seq % nserv
    server = first  # the reducer being talked to, for the error message

    def failed(e: TransportError) -> NoReturn:
        # Receives may still be posted into x on the other servers' connections: closing
        # them all guarantees no late result lands in x.  The next call reconnects.
        e = group.in_world_ranks(e)
        told = wire.failed_ranks_in(str(e))
        give_up = group.close if group.retries() else group.fail
        if told is not None:  # the server diagnosed a failed worker: the communicator names it
            give_up(wire.failed_ranks_reason(told, f"rank {ctx.rank} gives up all-reduce #{ctx.seq}: {e}"))
            raise e
        culprit = wire.failed_reducer_in(str(e)) or group.name(server)  # another worker may have found it
        failure = PeerFailure(f"reduction server {culprit} failed: {e}")
        give_up(wire.failed_reducer_reason(culprit, f"rank {ctx.rank} gives up all-reduce #{ctx.seq}: {failure}"))
        raise failure from e

    if npieces == 1:
        try:
            conn = group.conn(first)
            if wire.ANNOUNCE_SIZE + xf.nbytes <= conn.inline_bytes:
                return _one_record(ctx, group, first, conn, xf, out, codes, op, flags, piece, nserv, failed)
        except TransportError as e:
            failed(e)

    results: list[Handle] = []
    sends: list[Handle] = []
    try:
        owner = [(p + first) % nserv for p in range(min(nserv, npieces))]  # of pieces 0..S-1, and so on
        conns = {}
        for server in owner:
            conns[server] = group.conn(server)
        # Results land straight in x; safe before our piece has gone, because a reduced piece
        # only comes back after the server has received every rank's contribution to it.
        for p in range(npieces):
            lo, hi = p * piece, min(xf.size, (p + 1) * piece)
            results.append(conns[owner[p % nserv]].irecv(xf[lo:hi], wire.piece_tag(ctx.seq, p)))
        fused = set()
        for p, server in enumerate(owner):  # the announce names the server's pieces: p, p + S, ...
            ann = wire.Announce(group.job, ctx.seq, codes[0], op.code, ctx.world, ctx.rank, flags,
                                       xf.size, piece, nserv, p, wire.timeout_ms(ctx.timeout_s), codes[1])
            record = ann.encode()
            if p + nserv >= npieces and wire.ANNOUNCE_SIZE + _piece_nbytes(xf, piece, p) <= conns[server].inline_bytes:
                # The call's only piece for this server fits inline: it travels in the announce's
                # record (one write here, one record there: a small all-reduce is one round trip).
                _take_credit(group.in_flight[server], ctx.timeout_s)
                lo, hi = p * piece, min(xf.size, (p + 1) * piece)
                record += xf[lo:hi].tobytes()
                fused.add(p)
                group.in_flight[server].append(results[p])
            sends.append(conns[server].isend(record, wire.ANNOUNCE_TAG))
        for p in range(npieces):
            if p in fused:
                continue
            server = owner[p % nserv]
            _take_credit(group.in_flight[server], ctx.timeout_s)
            lo, hi = p * piece, min(xf.size, (p + 1) * piece)
            sends.append(conns[server].isend(xf[lo:hi], wire.piece_tag(ctx.seq, p)))
            group.in_flight[server].append(results[p])
    except TransportError as e:
        failed(e)

    def finish() -> None:
        nonlocal server
        try:
            for p, h in enumerate(results):
                server = owner[p % nserv]
                h.wait(ctx.timeout_s)
                if xf is not out:  # widened while the next pieces are still coming
                    lo, hi = p * piece, min(xf.size, (p + 1) * piece)
                    ops.from_wire(xf[lo:hi], out[lo:hi])
            for h in sends:
                h.wait(ctx.timeout_s)
        except TransportError as e:
            failed(e)

    return finish


def _one_record(ctx: CallContext, group: ServerGroup, server: int, conn: Connection, xf: np.ndarray,
                out: np.ndarray, codes: tuple[int, int], op: ops.ReduceOp, flags: int, piece: int, nserv: int,
                failed: Callable[[TransportError], NoReturn]) -> Finish:
    """A call that is one piece small enough to ride in the announce's record: one write out,
    one record back, all in the caller's thread (the general path's bookkeeping per piece
    and per server would cost this call several times its network time)."""
    try:
        result = conn.irecv(xf, wire.piece_tag(ctx.seq, 0))
        in_flight = group.in_flight[server]
        _take_credit(in_flight, ctx.timeout_s)
        in_flight.append(result)
        record = wire.encode_announce(group.job, ctx.seq, codes[0], op.code, ctx.world, ctx.rank, flags,
                                             xf.size, piece, nserv, 0, wire.timeout_ms(ctx.timeout_s),
                                             codes[1]) + xf.tobytes()
        sent = conn.isend(record, wire.ANNOUNCE_TAG)
    except TransportError as e:
        failed(e)

    def finish() -> None:
        try:
            result.wait(ctx.timeout_s)
            sent.wait(ctx.timeout_s)
        except TransportError as e:
            failed(e)
        if xf is not out:
            ops.from_wire(xf, out)

    return finish
