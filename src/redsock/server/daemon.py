"""``redsock serve``: the reduction server daemon.

Workers connect over Fast Socket (one connection per worker); each connection
is served by one thread that reads the worker's Announce, receives its pieces
(a window of them posted ahead, straight into pooled buffers), adds each into
the piece's accumulator and — when it brings the last of the N contributions —
sends the reduced piece to every worker of the job from that same thread.

State lives only as long as a round: a round that stalls past the timeout, or
whose worker disconnects, is aborted (every worker of that job learns which
ranks were missing) and its memory freed; other jobs carry on.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .. import ops, wire
from ..config import Config
from ..errors import ProtocolError, RedsockError, TransportError
from ..transport import Connection, Handle, Listener
from .aggregate import BufferPool, Piece, Round

log = logging.getLogger("redsock.server")

WINDOW = 4  # pieces a worker may have outstanding per server (workers use the same number)
IDLE_WAIT_S = 7 * 24 * 3600.0  # a worker between steps is idle, not stalled


@dataclass
class Job:
    job: int
    world: int
    conns: dict[int, Connection] = field(default_factory=dict)
    sending: deque = field(default_factory=deque)  # (buffer, handles) of results still going out


class ReductionServer:
    """One reducer.  ``start()`` returns at once; ``close()`` stops it (idempotent)."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0, *, config: Config | None = None,
                 threads: int | None = None, metrics_port: int | None = None):
        _fixed_mmap_threshold()
        self.config = config or Config.from_env()
        self.pool = BufferPool()
        self._lock = threading.Lock()
        self._jobs: dict[int, Job] = {}
        self._rounds: dict[tuple[int, int], Round] = {}
        self._kernels = threading.BoundedSemaphore(threads) if threads else None
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._metrics = _Metrics(metrics_port) if metrics_port else None
        self.listener = Listener(host, port, config=self.config, on_connection=self._on_connection)
        self.address = self.listener.address
        self._janitor = threading.Thread(target=self._reap_stalled, daemon=True, name="redsock-janitor")
        self._janitor.start()

    # -- lifecycle ------------------------------------------------------------------

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.listener.close()
        with self._lock:
            conns = [c for j in self._jobs.values() for c in j.conns.values()]
        for c in conns:
            c.close()
        for t in list(self._threads):
            t.join(timeout=5)
        self._janitor.join(timeout=5)

    def stop_on_signals(self) -> None:
        """Make SIGTERM/SIGINT stop :meth:`serve_forever` cleanly (call before announcing readiness)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._closed.set())

    def serve_forever(self) -> None:
        """Block until SIGTERM/SIGINT (see :meth:`stop_on_signals`) or :meth:`close`."""
        log.info("reduction server listening on %s:%d", *self.address)
        while not self._closed.wait(0.5):
            pass
        log.info("shutting down")
        self._closed.clear()
        self.close()

    def __enter__(self) -> "ReductionServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"jobs": len(self._jobs), "rounds": len(self._rounds)}

    # -- one worker connection --------------------------------------------------------

    def _on_connection(self, conn: Connection) -> None:
        t = threading.Thread(target=self._serve, args=(conn,), daemon=True, name=f"redsock-serve-{conn.peer}")
        self._threads.append(t)
        t.start()

    def _serve(self, conn: Connection) -> None:
        me: tuple[int, int] | None = None  # (job, rank), bound on the first announce
        buf = bytearray(wire.ANNOUNCE_SIZE)
        try:
            while not self._closed.is_set():
                conn.recv(buf, wire.ANNOUNCE_TAG, timeout=IDLE_WAIT_S)
                ann = wire.decode_announce(bytes(buf), max_elements=self.config.max_message_bytes,
                                           valid_dtype=ops.dtype_from_code, valid_op=ops.ReduceOp.from_code)
                if me is None:
                    me = (ann.job, ann.rank)
                    self._join(conn, ann)
                elif me != (ann.job, ann.rank):  # identity is bound to the (authenticated) connection
                    raise ProtocolError(f"{conn.peer} is job {me[0]:#x} rank {me[1]} but announced "
                                        f"job {ann.job:#x} rank {ann.rank}")
                self._serve_round(conn, ann)
        except (RedsockError, OSError) as e:
            if me is not None:
                self._worker_lost(me[0], me[1], conn, e)
            elif not self._closed.is_set():
                log.warning("dropped %s: %s", conn.peer, e)
        finally:
            conn.close()
            self._threads = [t for t in self._threads if t is not threading.current_thread()]

    def _join(self, conn: Connection, ann: wire.Announce) -> None:
        with self._lock:
            job = self._jobs.get(ann.job)
            if job is None:
                job = self._jobs[ann.job] = Job(ann.job, ann.world)
                log.info("job %#x joined (world %d)", ann.job, ann.world)
            if job.world != ann.world:
                raise ProtocolError(f"job {ann.job:#x} has world {job.world}, {conn.peer} says {ann.world}")
            old = job.conns.get(ann.rank)
            if old is not None and not old.closed:
                raise ProtocolError(f"job {ann.job:#x} rank {ann.rank} is already connected")
            job.conns[ann.rank] = conn
        if self._metrics:
            self._metrics.jobs.set(len(self._jobs))

    def _round(self, ann: wire.Announce) -> Round:
        dtype = ops.dtype_from_code(ann.dtype_code)
        op = ops.ReduceOp.from_code(ann.op_code)
        signature = (ann.dtype_code, ann.op_code, ann.count, ann.piece_elems, ann.nservers, ann.flags)
        with self._lock:
            if ann.job not in self._jobs:
                raise TransportError(f"job {ann.job:#x} was aborted", op="round")
            key = (ann.job, ann.op_seq)
            rnd = self._rounds.get(key)
            if rnd is None:
                ordered = bool(ann.flags & wire.FLAG_DETERMINISTIC)
                pieces = {p: Piece(dtype, ann.piece_range(p)[1] - ann.piece_range(p)[0], ann.world, op, ordered,
                                   self.pool) for p in ann.my_pieces()}
                rnd = self._rounds[key] = Round(ann.job, ann.op_seq, ann.world, signature, pieces)
            elif rnd.signature != signature:
                raise ProtocolError(f"job {ann.job:#x} rank {ann.rank} called all-reduce #{ann.op_seq} with "
                                    f"{signature}, other ranks with {rnd.signature}")
            if ann.rank in rnd.contributors:
                raise ProtocolError(f"job {ann.job:#x} rank {ann.rank} announced #{ann.op_seq} twice")
            rnd.contributors.add(ann.rank)
            rnd.last_progress = time.monotonic()
            return rnd

    def _serve_round(self, conn: Connection, ann: wire.Announce) -> None:
        rnd = self._round(ann)
        dtype = ops.dtype_from_code(ann.dtype_code)
        pieces = list(ann.my_pieces())
        posted: deque[tuple[int, np.ndarray, Handle]] = deque()

        def post(p: int) -> None:
            nbytes = rnd.pieces[p].count * dtype.itemsize
            buf = self.pool.take(nbytes)
            posted.append((p, buf, conn.irecv(buf[:nbytes], wire.piece_tag(ann.op_seq, p))))

        # Posted ahead, so pieces land without a copy; only a worker's next call, which may
        # start before this round's results are back, can have up to WINDOW pieces here first.
        for p in pieces[:WINDOW]:
            post(p)
        next_i = min(WINDOW, len(pieces))
        while posted:
            p, buf, h = posted.popleft()
            try:
                h.wait(self.config.timeout_s)
            except BaseException:
                self.pool.give(buf)
                for _, b, _ in posted:
                    self.pool.give(b)
                raise
            if next_i < len(pieces):
                post(pieces[next_i])
                next_i += 1
            rnd.last_progress = time.monotonic()
            if self._kernels:
                with self._kernels:
                    result = rnd.pieces[p].add(ann.rank, buf)
            else:
                result = rnd.pieces[p].add(ann.rank, buf)
            if result is not None:
                self._piece_done(rnd, p, result)
        if self._metrics:
            self._metrics.bytes_in.inc(sum(rnd.pieces[p].count for p in pieces) * dtype.itemsize)

    def _piece_done(self, rnd: Round, p: int, result: np.ndarray) -> None:
        """Send the reduced piece to every worker of the job (from this thread: no hop)."""
        with self._lock:
            job = self._jobs.get(rnd.job)
            conns = list(job.conns.values()) if job else []
            rnd.done_pieces += 1
            finished = rnd.done_pieces == len(rnd.pieces)
            if finished:
                self._rounds.pop((rnd.job, rnd.op_seq), None)
        handles = [c.isend(result, wire.piece_tag(rnd.op_seq, p)) for c in conns]
        if job is not None:
            self._reap_sent(job, (result, handles))
        if finished and self._metrics:
            self._metrics.rounds.inc()

    def _reap_sent(self, job: Job, new: tuple[np.ndarray, list[Handle]] | None = None) -> None:
        """Return result buffers whose sends have all left to the pool."""
        done: list[np.ndarray] = []
        with self._lock:
            if new is not None:
                job.sending.append(new)
            while job.sending and all(h.done for h in job.sending[0][1]):
                done.append(job.sending.popleft()[0])
        for buf in done:
            self.pool.give(buf)

    # -- failures -------------------------------------------------------------------

    def _worker_lost(self, job_id: int, rank: int, conn: Connection, err: BaseException) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.conns.get(rank) is not conn:
                return
            del job.conns[rank]
            busy = [k for k, r in self._rounds.items() if k[0] == job_id]
        if busy:
            self._abort_job(job_id, [rank], f"worker rank {rank} of job {job_id:#x} failed ({err})")
            return
        log.info("job %#x rank %d left", job_id, rank)
        with self._lock:
            if job_id in self._jobs and not self._jobs[job_id].conns:
                del self._jobs[job_id]
                log.info("job %#x left", job_id)
        if self._metrics:
            self._metrics.jobs.set(len(self._jobs))

    def _abort_job(self, job_id: int, ranks: list[int], why: str) -> None:
        """Abort a job's rounds here: free their memory and tell every worker which ranks failed."""
        with self._lock:
            job = self._jobs.pop(job_id, None)
            rounds = [self._rounds.pop(k) for k in list(self._rounds) if k[0] == job_id]
        for rnd in rounds:
            for piece in rnd.pieces.values():
                piece.release()
        log.warning("job %#x aborted: %s", job_id, why)
        if job is None:
            return
        reason = f"[failed ranks: {', '.join(map(str, ranks))}] reduction server: {why}"
        for c in job.conns.values():
            c.abort(reason)
        self._reap_sent(job)
        if self._metrics:
            self._metrics.aborts.inc()

    def _reap_stalled(self) -> None:
        while not self._closed.wait(min(1.0, self.config.timeout_s / 4)):
            now = time.monotonic()
            with self._lock:
                stalled = [r for r in self._rounds.values()
                           if now - r.last_progress > self.config.timeout_s]
            for rnd in stalled:
                missing = rnd.missing_ranks()
                self._abort_job(rnd.job, missing, f"all-reduce #{rnd.op_seq} got nothing from rank(s) "
                                f"{', '.join(map(str, missing))} for {self.config.timeout_s:g}s")


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
    """Prometheus metrics on ``--metrics-port``."""

    def __init__(self, port: int):
        from prometheus_client import Counter, Gauge, start_http_server

        self.jobs = Gauge("redsock_server_jobs", "jobs connected")
        self.rounds = Counter("redsock_server_rounds_total", "all-reduce rounds completed")
        self.bytes_in = Counter("redsock_server_bytes_in_total", "contribution bytes received")
        self.aborts = Counter("redsock_server_aborts_total", "jobs aborted (failed worker or deadline)")
        start_http_server(port)
