"""``redsock serve``: the reduction server daemon.

Workers connect over Fast Socket (one connection per worker).  The connections
are spread over a few event-loop threads (:mod:`.engine`); a loop reads a
worker's Announce, receives its pieces straight into pooled buffers, adds each
into the piece's accumulator and — when it brings the last of the N
contributions — sends the reduced piece to every worker of the job from that
same thread.

State lives only as long as a round: a round that stalls past the timeout, or
whose worker disconnects, is aborted (every worker of that job learns which
ranks were missing) and its memory freed; other jobs carry on.  SIGTERM/SIGINT
wake the main thread through ``signal.set_wakeup_fd`` (a handler that takes a
lock can deadlock the thread it interrupted); the server then aborts what is in
flight, closes every connection and returns.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import select
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .. import ops, wire
from ..config import Config, check_port
from ..errors import ConfigError, ProtocolError, RedsockError, TransportError
from ..transport import Listener
from ..transport.sockets import translate_oserror
from .aggregate import BufferPool, Piece, Round
from .engine import Link, Loop, Outgoing

log = logging.getLogger("redsock.server")

WINDOW = 4  # pieces a worker may have outstanding per server (workers use the same number)
SHUTDOWN_REASON = "reduction server shutting down"
#: A round is given up this long after its timeout, so that a worker that stopped sending
#: because it is stuck on another reducer (it gives up after its timeout and a probe of at
#: most a second) tells this one why first, and is not blamed for it.  Workers wait for the
#: diagnosis longer than this (``redsock.transport.connection.RELAY_GRACE_S``).
DIAGNOSIS_MARGIN_S = 2.0
#: How often stalled rounds are looked for (part of how late a diagnosis can come).
REAP_INTERVAL_S = 0.25
#: How many aborted jobs' reasons are kept, for their workers' calls that arrive after the end.
ENDED_KEPT = 1024


@dataclass
class Job:
    job: int
    world: int
    links: dict[int, Link] = field(default_factory=dict)


@dataclass
class _Pending:
    """One worker's part of one round: the pieces it still owes this server."""

    round: Round
    left: int


class ReductionServer:
    """One reducer.  Serves as soon as it is built; ``close()`` stops it (idempotent).

    ``threads``: event-loop threads (default: the machine's cores).  ``metrics_port``: serve
    Prometheus metrics there, on ``host`` (None or 0: none; ``metrics_address`` says where)."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0, *, config: Config | None = None,
                 threads: int | None = None, metrics_port: int | None = None):
        if threads is not None and threads < 1:
            raise ConfigError(f"a reduction server needs at least one loop thread, got threads={threads}")
        _fixed_mmap_threshold()
        self.config = config or Config.from_env()
        self.pool = BufferPool()
        self._lock = threading.Lock()
        self._jobs: dict[int, Job] = {}
        self._rounds: dict[tuple[int, int], Round] = {}
        self._ended: dict[int, str] = {}  # why the last ENDED_KEPT aborted jobs ended, by job id
        self._closed = threading.Event()
        self._metrics = _Metrics(host, metrics_port) if metrics_port else None
        self._loops = [Loop(f"redsock-loop{i}") for i in range(threads or os.cpu_count() or 1)]
        self._next_loop = itertools.cycle(self._loops)
        try:
            self.listener = Listener(host, port, config=self.config, on_connection=self._adopt,
                                     connection_factory=self._make_link)
        except BaseException:
            for loop in self._loops:  # nothing was served: just end what was started above
                loop.stop("the reduction server did not start")
            if self._metrics:
                self._metrics.close()
            raise
        self.address = self.listener.address
        self.metrics_address = self._metrics.address if self._metrics else None
        self._wake_r, self._wake_w = socket.socketpair()  # serve_forever's wake-up (signals, close)
        self._wake_w.setblocking(False)
        self._janitor = threading.Thread(target=self._reap_stalled, daemon=True, name="redsock-janitor")
        self._janitor.start()

    # -- lifecycle ------------------------------------------------------------------

    def close(self) -> None:
        """Abort the rounds in flight (workers get the reason), close every connection, stop."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.listener.close()
        for loop in self._loops:
            loop.stop(SHUTDOWN_REASON)
        for loop in self._loops:
            loop.thread.join(timeout=5)
        self._janitor.join(timeout=5)
        with self._lock:
            rounds = list(self._rounds.values())
            self._rounds.clear()
            self._jobs.clear()
        for rnd in rounds:
            for piece in rnd.pieces.values():
                piece.release()
        if self._metrics:
            self._metrics.close()
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def stop_on_signals(self) -> None:
        """Make SIGTERM/SIGINT stop :meth:`serve_forever` cleanly (call from the main thread,
        before announcing readiness).  The C-level handler writes the signal's number to a
        socket that serve_forever sleeps on; the Python-level one does nothing (no locks)."""
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _ignore)

    def serve_forever(self) -> None:
        """Block until SIGTERM/SIGINT (see :meth:`stop_on_signals`) or :meth:`close`."""
        log.info("reduction server listening on %s:%d (%d loop threads)", *self.address, len(self._loops))
        while not self._closed.is_set():
            if select.select([self._wake_r], [], [])[0]:
                try:
                    self._wake_r.recv(64)
                except BlockingIOError:
                    pass
                break
        log.info("shutting down")
        self.close()

    def __enter__(self) -> "ReductionServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"jobs": len(self._jobs), "rounds": len(self._rounds)}

    # -- connections ------------------------------------------------------------------

    def _make_link(self, ctrl: socket.socket, data: list[socket.socket], *, peer: str, config: Config,
                   inline_bytes: int) -> Link:
        return Link(ctrl, data, peer=peer, config=config, inline_bytes=inline_bytes, pool=self.pool,
                    handler=self)

    def _adopt(self, link: Link) -> None:
        next(self._next_loop).adopt(link)  # round-robin: a job's workers spread over the loops

    # -- the handler interface (called on a link's loop thread) ------------------------

    def on_announce(self, link: Link, payload: memoryview) -> None:
        ann = wire.decode_announce(payload[:wire.ANNOUNCE_SIZE], max_elements=self.config.max_message_bytes,
                                   valid_dtype=ops.dtype_from_code, valid_op=ops.ReduceOp.from_code,
                                   valid_wire=ops.check_wire_code)
        if link.identity is None:
            self._join(link, ann)
            link.identity = (ann.job, ann.rank)
        elif link.identity != (ann.job, ann.rank):  # identity is bound to the (authenticated) connection
            raise ProtocolError(f"{link.peer} is job {link.identity[0]:#x} rank {link.identity[1]} but "
                                f"announced job {ann.job:#x} rank {ann.rank}")
        mine = ann.my_pieces()
        inline = len(payload) > wire.ANNOUNCE_SIZE  # the call's only piece here came along
        if inline and len(mine) != 1:
            raise ProtocolError(f"{link.peer} sent a piece with announce #{ann.op_seq}, "
                                f"which has {len(mine)} pieces here")
        # Pieces that overtook their announce (on the data streams, or sent ahead of it): more
        # than it has here on its own is refused before it joins a round, so a call broken so
        # leaves nothing behind (the link's early pieces go back to the pool when it is dropped).
        early = [t for t in link.early if _op_seq(t) == ann.op_seq] if link.early else []
        if len(early) > (0 if inline else len(mine)):
            raise ProtocolError(f"{link.peer} sent more pieces of all-reduce #{ann.op_seq} "
                                f"than its announce has here")
        rnd = self._round(ann)
        if rnd is None:
            # The job ended here a moment ago: whoever ended it tells its links why, but this
            # one is about to be dropped (closed) first.  Say why now.
            with self._lock:
                why = self._ended.get(ann.job, f"reduction server: job {ann.job:#x} was aborted")
            link.abort(why)
            raise TransportError(f"job {ann.job:#x} ended", op="round")
        entry = None if inline else _Pending(rnd, len(mine))
        if entry is not None:
            link.pending[ann.op_seq] = entry
            for tag in early:
                self._piece_of(link, ann.op_seq, entry, tag, link.early.pop(tag))
        if inline:  # summed where it lies (the piece copies it only if it must wait for its turn)
            piece = np.frombuffer(payload, np.uint8, len(payload) - wire.ANNOUNCE_SIZE, wire.ANNOUNCE_SIZE)
            self._contribute(link, rnd, mine[0], piece, borrowed=True)

    def on_piece(self, link: Link, tag: int, buf: np.ndarray) -> None:
        op_seq = _op_seq(tag)
        entry = link.pending.get(op_seq)
        if entry is None:  # its announce is still on the way (another stream): keep it till then
            if len(link.early) >= link.max_early:
                self.pool.give(buf)
                raise ProtocolError(f"{link.peer} sent more pieces ahead than its credits allow")
            link.early[tag] = buf
            return
        self._piece_of(link, op_seq, entry, tag, buf)

    def on_progress(self, link: Link) -> None:
        now = time.monotonic()
        for entry in link.pending.values():
            entry.round.last_progress = now

    # -- rounds -----------------------------------------------------------------------

    def _join(self, link: Link, ann: wire.Announce) -> None:
        with self._lock:
            job = self._jobs.get(ann.job)
            if job is None:
                job = self._jobs[ann.job] = Job(ann.job, ann.world)
                log.info("job %#x joined (world %d)", ann.job, ann.world)
            if job.world != ann.world:
                raise ProtocolError(f"job {ann.job:#x} has world {job.world}, {link.peer} says {ann.world}")
            old = job.links.get(ann.rank)
            if old is not None and not old.closed:
                raise ProtocolError(f"job {ann.job:#x} rank {ann.rank} is already connected")
            job.links[ann.rank] = link
        if self._metrics:
            self._metrics.jobs.set(len(self._jobs))

    def _round(self, ann: wire.Announce) -> Round | None:
        """The round ``ann`` joins (made by its first announce); None if its job has ended."""
        signature = (ann.dtype_code, ann.wire_code, ann.op_code, ann.count, ann.piece_elems, ann.nservers, ann.flags)
        with self._lock:
            if ann.job not in self._jobs:
                return None
            key = (ann.job, ann.op_seq)
            rnd = self._rounds.get(key)
            if rnd is None:
                # On a 16-bit wire the pieces are that type: summed in float32, answered in it.
                dtype = ops.check_wire_code(ann.dtype_code, ann.wire_code)
                op = ops.ReduceOp.from_code(ann.op_code)
                ordered = bool(ann.flags & wire.FLAG_DETERMINISTIC)
                pieces = {}
                for p in ann.my_pieces():
                    lo, hi = ann.piece_range(p)
                    pieces[p] = Piece(dtype, hi - lo, ann.world, op, ordered, self.pool)
                rnd = self._rounds[key] = Round(ann.job, ann.op_seq, ann.world, signature, pieces)
            elif rnd.signature != signature:
                raise ProtocolError(f"job {ann.job:#x} rank {ann.rank} called all-reduce #{ann.op_seq} with "
                                    f"{signature}, other ranks with {rnd.signature}")
            if ann.rank in rnd.contributors:
                raise ProtocolError(f"job {ann.job:#x} rank {ann.rank} announced #{ann.op_seq} twice")
            rnd.contributors.add(ann.rank)
            rnd.timeout_s = min(rnd.timeout_s, self.config.timeout_s, ann.timeout_ms / 1000)
            rnd.last_progress = time.monotonic()
            return rnd

    def _piece_of(self, link: Link, op_seq: int, entry: _Pending, tag: int, buf: np.ndarray) -> None:
        """A piece that came on its own (after its announce): one less owed."""
        entry.left -= 1
        if entry.left == 0:
            del link.pending[op_seq]
        self._contribute(link, entry.round, tag & wire.MAX_PIECES, buf)

    def _contribute(self, link: Link, rnd: Round, p: int, buf: np.ndarray, borrowed: bool = False) -> None:
        """Add ``buf`` (a pooled buffer, now the round's; or, ``borrowed``, memory valid during the
        call only) to piece ``p``; send the result if complete."""
        piece = rnd.pieces.get(p)
        if piece is None or buf.nbytes != piece.nbytes:
            if not borrowed:
                self.pool.give(buf)
            what = "is not this reducer's" if piece is None else f"is {buf.nbytes} bytes, expected {piece.nbytes}"
            raise ProtocolError(f"{link.peer}: piece {p} of all-reduce #{rnd.op_seq} {what}")
        rnd.last_progress = time.monotonic()
        result = piece.add(link.identity[1], buf, borrowed)  # type: ignore[index]
        if self._metrics:
            self._metrics.bytes_in.inc(buf.nbytes)
        if result is not None:
            self._piece_done(rnd, p, result)

    def _piece_done(self, rnd: Round, p: int, result: np.ndarray) -> None:
        """Send the reduced piece to every worker of the job, from this thread: no hop."""
        with self._lock:
            job = self._jobs.get(rnd.job)
            links = list(job.links.values()) if job else []
            rnd.done_pieces += 1
            finished = rnd.done_pieces == len(rnd.pieces)
            if finished:
                self._rounds.pop((rnd.job, rnd.op_seq), None)
        tag = wire.piece_tag(rnd.op_seq, p)
        n = result.nbytes
        view = memoryview(result)
        inline = [lk for lk in links if n <= lk.inline_bytes]
        sliced = [lk for lk in links if n > lk.inline_bytes]
        if inline:  # one record for everybody: a piece's tag is used once, so its seq is 0
            record = wire.encode_inline(tag, 0, n) + bytes(view)
            for lk in inline:
                lk.send_inline(record)
        if sliced:
            plans = {lk: _slices(tag, view, lk.config.chunk_bytes) for lk in sliced}
            out = Outgoing(result, self.pool, sum(len(s) for s in plans.values()))
            for lk, slices in plans.items():
                lk.send_slices(slices, out)
        else:
            self.pool.give(result)
        if finished and self._metrics:
            self._metrics.rounds.inc()

    # -- failures -------------------------------------------------------------------

    def on_lost(self, link: Link, err: RedsockError) -> None:
        if self._closed.is_set():
            return  # shutting down: every worker was told why already
        if link.identity is None:
            if not self._closed.is_set():
                log.warning("dropped %s: %s", link.peer, err)
            return
        job_id, rank = link.identity
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.links.get(rank) is not link:
                return
            del job.links[rank]
            busy = [k for k in self._rounds if k[0] == job_id]
        if isinstance(err, TransportError) and err.op == "peer abort":
            # The worker gave up and said why (a rank or a reducer it found failed): pass its
            # diagnosis on, also between rounds (the others' next round would wait for it, then
            # blame it); it failed only as a consequence and is not to be blamed.
            told = wire.failed_ranks_in(str(err))
            self._abort_job(job_id, list(told or ()), f"worker rank {rank} gave up ({err})", relayed=True)
            return
        if busy:
            self._abort_job(job_id, [rank], f"worker rank {rank} of job {job_id:#x} failed ({err})")
            return
        log.info("job %#x rank %d left", job_id, rank)
        with self._lock:
            if job_id in self._jobs and not self._jobs[job_id].links:
                del self._jobs[job_id]
                log.info("job %#x left", job_id)
        if self._metrics:
            self._metrics.jobs.set(len(self._jobs))

    def _abort_job(self, job_id: int, ranks: list[int], why: str, relayed: bool = False) -> None:
        """Abort a job's rounds here: free their memory and tell every worker which ranks failed:
        ranks of the job found here, or (``relayed``) the world's ranks a worker named."""
        note = wire.failed_ranks_reason if relayed else wire.failed_job_ranks_reason
        reason = note(ranks, f"reduction server: {why}")
        with self._lock:
            job = self._jobs.pop(job_id, None)
            rounds = [self._rounds.pop(k) for k in list(self._rounds) if k[0] == job_id]
            if job is not None:  # for a call that comes before its link is told (see on_announce)
                self._ended[job_id] = reason
                if len(self._ended) > ENDED_KEPT:
                    del self._ended[next(iter(self._ended))]
        for rnd in rounds:
            for piece in rnd.pieces.values():
                piece.release()
        log.warning("job %#x aborted: %s", job_id, why)
        if job is None:
            return
        for link in job.links.values():
            link.abort(reason)
        if self._metrics:
            self._metrics.aborts.inc()

    def _reap_stalled(self) -> None:
        while not self._closed.wait(REAP_INTERVAL_S):
            now = time.monotonic()
            with self._lock:
                stalled = [r for r in self._rounds.values()
                           if now - r.last_progress > r.timeout_s + DIAGNOSIS_MARGIN_S]
            by_job: dict[int, list[Round]] = {}
            for rnd in stalled:
                by_job.setdefault(rnd.job, []).append(rnd)
            for job_id, rounds in by_job.items():
                # A round whose pieces are all complete or untouched waits for a rank that is
                # behind in another one: the job's stalled rounds together name it.
                missing = sorted(set().union(*(r.missing_ranks() for r in rounds)))
                rnd = min(rounds, key=lambda r: r.op_seq)
                self._abort_job(job_id, missing, f"all-reduce #{rnd.op_seq} got nothing from rank(s) "
                                f"{', '.join(map(str, missing))} for {rnd.timeout_s:g}s (the job's timeout)")


def _ignore(signum: int, frame: object) -> None:
    """SIGTERM/SIGINT: the wake-up fd already told serve_forever (see stop_on_signals)."""


def _op_seq(tag: int) -> int:
    return (tag >> wire.PIECE_BITS) - 1


def _slices(tag: int, view: memoryview, chunk: int) -> list[tuple[bytes, memoryview]]:
    """A message cut into slice records of at most ``chunk`` bytes (header, payload view)."""
    total = len(view)
    return [(wire.encode_slice(tag, 0, total, off, min(chunk, total - off)), view[off:off + chunk])
            for off in range(0, total, chunk)]


def _fixed_mmap_threshold() -> None:
    """Make glibc serve every large buffer with its own mmap.  By default it raises the
    threshold after large frees, then carves big buffers out of a heap that fragments
    and never shrinks: the daemon's memory would creep up under changing sizes."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 256 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


class _Metrics:
    """Prometheus metrics on ``--metrics-port`` (its own registry and HTTP server: two servers
    in one process do not collide, and close() frees the port)."""

    def __init__(self, host: str, port: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        check_port(host, port, "serve metrics")
        registry = CollectorRegistry()
        self.jobs = Gauge("redsock_server_jobs", "jobs connected", registry=registry)
        self.rounds = Counter("redsock_server_rounds_total", "all-reduce rounds completed", registry=registry)
        self.bytes_in = Counter("redsock_server_bytes_in_total", "contribution bytes received", registry=registry)
        self.aborts = Counter("redsock_server_aborts_total", "jobs aborted (failed worker or deadline)",
                              registry=registry)
        try:
            self._http, _ = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            raise translate_oserror(e, f"{host}:{port}", "serve metrics") from e
        self.address: tuple[str, int] = self._http.server_address[:2]

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
