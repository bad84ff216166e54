"""A Fast Socket connection: one control stream plus K data streams to one peer.

* Messages up to the inline threshold travel header+payload in one ``sendmsg``
  on the control stream, from the caller's thread.  Whoever *waits* for an
  inline message reads the control stream itself (busy-polling for
  ``spin_us`` while that pays, then sleeping in the read itself), so a small message
  costs no thread hop on either side, and a send and a receive are two system calls.
* Larger messages are queued for the data streams; each stream has a sender
  thread that pulls its next slice from the schedule (see :mod:`.schedule`)
  and a receiver thread that reads slice headers and receives each payload
  straight into the destination buffer at its offset.  A caller that finds a
  stream idle writes the message's first slice on it itself, without
  blocking; the stream's thread is woken only for what the kernel could not
  take at once.
* Messages are matched by ``(tag, seq)``; a message that arrives before its
  receive is posted is kept in an "unexpected" buffer and copied once.
* A receive from whichever of several peers sends first (:func:`irecv_any`)
  claims the first connection whose next message with the tag has begun to
  arrive, so per-peer order still holds.
* Any failure aborts the whole connection: every pending operation, on both
  sides, fails with a :class:`~redsock.errors.TransportError` naming the peer
  and the operation, and every thread wakes up and exits.
"""

from __future__ import annotations

import logging
import os
import random
import select
import socket
import struct
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from .. import wire
from ..config import Config
from ..errors import ConfigError, ProtocolError, RedsockError, Timeout, TransportError
from . import zerocopy
from .schedule import SendJob, Slice, make_schedule
from .sockets import ControlReader, StreamReader, advance_parts, send_all, shutdown_quietly, translate_oserror

log = logging.getLogger("redsock.transport")

_PROGRESS_CHECK_S = 1.0  # how often a blocked waiter looks for progress on a large message
_EVENT_LOCK = threading.Lock()
#: How long a stream's failure waits for a waiter reading the control stream, which meets the
#: peer's ABORT record (its reason) there, before it reports the failure as its own.
PEER_REASON_WAIT_S = 1.0
#: A wait that made no progress for its timeout probes the peer; if the peer answers, it is
#: blocked on someone else, and whoever detects that failure (a ring neighbour, a reducer: their
#: deadlines began within moments of ours) tells us within this long.  Not another whole
#: timeout: timeouts never stack (every survivor fails within REDSOCK_TIMEOUT_S + 5 s).
RELAY_GRACE_S = 4.0
# How long a waiter sleeps in one read of the control stream before it looks at its deadline.
CTRL_READ_WAIT_S = 0.05
CTRL_STAGE_BYTES = 4096  # one control-stream read brings a whole small record, often several
# A data-stream reader is woken at most once per this many bytes (one wake-up per slice: slices
# are at most 4 MiB by default).  4 ranks on loopback, 64 MiB ring all-reduce, against waking
# per arriving segment: 101-107 -> 92-98 ms, CPU 187-200 -> 173-185 ms per call over all ranks.
RCVLOWAT_MAX = 4 * 1024 * 1024
# The largest message a caller writes on an idle stream itself (_write_direct).  Above it the
# copy (about half a millisecond per MiB here) dwarfs the stream thread's wake-up it saves
# (tens of microseconds), and the caller is better off going on while the thread copies: 4
# ranks on one host over TCP, ring all-reduce in 4 MiB slices, 2 alternating rounds: 16 MiB
# 34.0 / 42.7 ms without direct writes, 49.9 / 45.7 ms with them at every size.
DIRECT_MAX_BYTES = 1024 * 1024
# How often a receive from any peer looks again at messages arriving on data streams (the
# control streams, which carry small messages, wake it at once).
ANY_SOURCE_POLL_S = 0.001

K = TypeVar("K")


def irecv_any(connections: Callable[[], Mapping[K, "Connection"]], buf: Any, tag: int, check: int = 0, *,
              timeout: float) -> tuple[K, Handle]:
    """Receive the next message with ``tag`` from whichever connection's begins to arrive first.

    ``connections`` is asked again on every pass (peers may connect while this waits).
    Returns the connection's key and the posted :class:`Handle` (wait on it for the rest of
    the message).  Raises :class:`Timeout` if no message began to arrive within ``timeout``
    seconds (nothing is posted then, so the connections stay usable), or a failed
    connection's :class:`TransportError`."""
    deadline = time.monotonic() + timeout
    turn = 0
    while True:
        conns = list(connections().items())
        for i in range(len(conns)):  # start one further each pass, so no peer starves the others
            key, conn = conns[(turn + i) % len(conns)]
            h = conn.irecv_arrived(buf, tag, check)
            if h is not None:
                return key, h
        turn += 1
        left = deadline - time.monotonic()
        if left <= 0:
            raise Timeout(f"recv from any of {len(conns)} connected peers (tag {tag}): timeout (nothing arrived "
                          f"for {timeout:g}s)", op="recv")
        poller = select.poll()
        for _, conn in conns:
            poller.register(conn._ctrl.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        poller.poll(int(min(left, ANY_SOURCE_POLL_S) * 1000) + 1)


def as_bytes(buf: Any, *, writable: bool) -> memoryview:
    """A flat byte view of ``buf`` without copying; refuses what cannot be sent in place."""
    if isinstance(buf, np.ndarray):
        flags = buf.flags
        if not flags.c_contiguous:
            raise ConfigError("array is not C-contiguous; pass np.ascontiguousarray(a) (a copy) instead")
        if writable and not flags.writeable:
            raise ConfigError("receive buffer is read-only")
        return memoryview(buf.reshape(-1).view(np.uint8))
    try:
        view = memoryview(buf)
    except TypeError:
        raise ConfigError(f"{type(buf).__name__} does not expose a buffer") from None
    if not view.c_contiguous:
        raise ConfigError("buffer is not C-contiguous")
    if writable and view.readonly:
        raise ConfigError("receive buffer is read-only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class Handle:
    """One outstanding send or receive.  ``wait()`` blocks, ``test()`` polls."""

    __slots__ = ("conn", "op", "tag", "seq", "check", "view", "nbytes", "got", "inline", "error", "done", "_event")

    def __init__(self, conn: "Connection", op: str, tag: int, seq: int, view: memoryview, inline: bool,
                 check: int = 0):
        self.conn, self.op, self.tag, self.seq, self.check = conn, op, tag, seq, check
        self.view, self.nbytes, self.inline = view, view.nbytes, inline
        self.got = 0  # bytes moved so far (progress, for the no-progress deadline)
        self.error: RedsockError | None = None
        self.done = False  # read-only outside the connection: a plain attribute, polled by waiters
        self._event: threading.Event | None = None  # made only if someone must block: most never do

    def test(self) -> bool:
        """True once complete; raises the operation's error if it failed."""
        if self.error is not None:
            raise self.error
        return self.done

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete.  Raises :class:`Timeout` if nothing moved for ``timeout``
        seconds (default ``REDSOCK_TIMEOUT_S``) — and then aborts the connection,
        because its stream state is no longer known — or the operation's error."""
        if not self.done:
            self.conn._wait(self, timeout)
        if self.error is not None:
            raise self.error

    def _block(self, timeout: float) -> bool:
        """Sleep until done or ``timeout``; True if done."""
        ev = self._event
        if ev is None:
            with _EVENT_LOCK:
                if self._event is None:
                    self._event = threading.Event()
                ev = self._event
            if self.done:  # completed before the event existed: nobody will set it
                return True
        return ev.wait(timeout)

    def _complete(self) -> None:
        self.done = True
        ev = self._event  # read after done is set; _block checks done after making the event
        if ev is not None:
            ev.set()

    def _fail(self, err: RedsockError) -> None:
        if not self.done:
            self.error = err
            self._complete()

    def __repr__(self) -> str:
        state = "failed" if self.error else "done" if self.done else "pending"
        return f"<Handle {self.op} {self.nbytes}B tag={self.tag} seq={self.seq} {state}>"


class AdaptiveSpin:
    """How long a waiter busy-polls before it blocks: the configured spin while answers
    usually come within it, none while they do not — with more ranks than cores, or a peer
    busy elsewhere, spinning only takes the CPU from the processes that are to answer (4
    ranks and a reducer on 2 cores, 8-byte all-reduce: 204-241 us of CPU per call and rank
    with a 100 us spin, 192-215 us without)."""

    __slots__ = ("spin_s", "usual_s")

    def __init__(self, spin_s: float):
        self.spin_s = spin_s
        self.usual_s = 0.0  # running mean of recent waits

    def budget(self) -> float:
        return self.spin_s if self.usual_s <= self.spin_s else 0.0

    def record(self, took_s: float) -> None:
        # A long wait counts as twice the spin, so that a few of them stop the spinning
        # and a few quick answers bring it back.
        self.usual_s += (min(took_s, 2 * self.spin_s) - self.usual_s) / 8


class _Unexpected:
    """A message that arrived before its receive was posted."""

    __slots__ = ("buf", "check", "got", "complete", "waiter")

    def __init__(self, total: int, check: int):
        self.buf = memoryview(np.empty(total, np.uint8))  # not zero-filled: every byte gets written
        self.check = check
        self.got = 0
        self.complete = False
        self.waiter: Handle | None = None


class Connection:
    """Tagged, any-size, any-number-outstanding messages to one peer.

    Created by :func:`redsock.transport.connect` or a :class:`~redsock.transport.Listener`.
    Thread-safe.  Use as a context manager or call :meth:`close`.

    Locks, what each guards, and the order they are taken in (never the other way round):

    1. ``_ctrl_rx_lock`` — the control stream's receive side (its reader and the record under
       way).  Held by whichever waiter reads it, across the read.
    2. ``_lock`` (``_send_cv``) — match tables, the send schedule, data streams' busy flags,
       the error state.  Never held across I/O that can block.
    3. ``_ctrl_tx_lock`` (``_ctrl_tx_cv``) — the control stream's send side and its backlog.
       Never held together with ``_lock``.
    4. ``_EVENT_LOCK`` — a leaf: only around making a handle's event.

    Failing the connection (:meth:`_abort`, :meth:`_io_failed`) takes ``_lock`` and then
    ``_ctrl_tx_lock``: call it with neither held (holding ``_ctrl_rx_lock`` is fine).  A path
    that meets an error under one of them notes it and fails the connection after letting go.
    Completing or failing a handle only sets its event: no code of anyone else's runs there.
    """

    def __init__(self, ctrl: socket.socket, data: list[socket.socket], *, peer: str,
                 config: Config, inline_bytes: int):
        self.peer = peer
        self.config = config
        self.inline_bytes = inline_bytes
        self.nstreams = len(data)
        self._ctrl = ctrl
        self._data = data
        self._lock = threading.Lock()  # match tables, schedule, error state
        self._send_cv = threading.Condition(self._lock)
        self._tx_seq: defaultdict[int, int] = defaultdict(int)
        self._rx_seq: defaultdict[int, int] = defaultdict(int)
        self._posted: dict[tuple[int, int], Handle] = {}
        self._unexpected: dict[tuple[int, int], _Unexpected] = {}
        self._sends: dict[Handle, SendJob] = {}  # large sends not yet complete
        self._schedule = make_schedule(config.balance, len(data), config.chunk_bytes)
        self._error: RedsockError | None = None
        self._closed = False
        self._streams_ended = 0
        # Control stream, receive side: read by whichever waiter holds the lock.
        self._ctrl_rx_lock = threading.Lock()
        self._crx = ControlReader(ctrl, CTRL_STAGE_BYTES, max(self.inline_bytes, 0))
        self._crx_target: memoryview | None = None  # the record under way (ControlReader's sink)
        self._crx_owner: Handle | _Unexpected | None = None
        self._crx_key = (0, 0)
        self._crx_abort = False
        # A waiter sleeps in its read of the control stream (a blocking socket, with a receive
        # timeout so that it looks at its deadline): the reply's arrival wakes it with the bytes.
        ctrl.settimeout(None)
        ctrl.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, int(CTRL_READ_WAIT_S * 1e6)))
        self._spin = AdaptiveSpin(config.spin_us / 1e6)
        # Control stream, send side: direct from the caller unless a backlog exists.
        self._ctrl_tx_lock = threading.Lock()
        self._ctrl_tx_cv = threading.Condition(self._ctrl_tx_lock)
        self._ctrl_backlog: deque[tuple[Handle | None, list]] = deque()
        self._ctrl_writing: Handle | None = None  # the backlog's head while its write is under way
        self._ctrl_tx_thread: threading.Thread | None = None
        # Stats, for benchmarks and tests (guarded by _lock): slices and bytes handed to each
        # data stream, and how many of the slices the caller wrote whole itself (_write_direct).
        self.slices_sent = [0] * len(data)
        self.bytes_sent = [0] * len(data)
        self.direct_slices = 0
        # One writer per data stream at a time (guarded by _lock): its sender thread, a caller
        # writing a slice itself (_write_direct), or a liveness probe (stream 0).
        self._stream_busy = [False] * len(data)
        # A slice a caller began that the kernel took only part of: the stream stays busy,
        # and its thread writes the rest before anything else.
        self._stream_rest: list[tuple[SendJob, int, list] | None] = [None] * len(data)
        self._probes_waiting = 0
        # Direct writes need a socket that takes a whole slice at once when it has room: not
        # with TCP_NOTSENT_LOWAT (it takes that much), nor zero-copy sends (their thread reaps them).
        self._direct_writes = not config.notsent_lowat and not config.zerocopy_min_bytes
        self._pongs: dict[int, threading.Event] = {}
        self._threads: list[threading.Thread] = []
        for i in range(len(data)):
            for fn, kind in ((self._send_loop, "tx"), (self._recv_loop, "rx")):
                t = threading.Thread(target=fn, args=(i,), name=f"redsock-{kind}{i}-{peer}", daemon=True)
                self._threads.append(t)
                t.start()

    # -- public API ---------------------------------------------------------

    def isend(self, buf: Any, tag: int = 0, check: int = 0) -> Handle:
        """Start sending ``buf`` (not copied: keep it unchanged until the handle completes).

        ``check`` (16 bits) must equal the receiver's: collectives put a signature of
        the call there so ranks that disagree get a clear error, not a wrong result."""
        view = as_bytes(buf, writable=False)
        n = view.nbytes
        with self._lock:
            self._check_open("send")
            seq = self._tx_seq[tag]
            self._tx_seq[tag] = seq + 1
            if n > self.inline_bytes:
                h = Handle(self, "send", tag, seq, view, inline=False, check=check)
                job = SendJob(tag, seq, view, h, check=check)
                self._sends[h] = job
                self._schedule.add(job)
                direct = self._claim_idle_stream() if n <= DIRECT_MAX_BYTES else None
                if self._schedule.has_work():
                    self._send_cv.notify_all()
        if n > self.inline_bytes:
            if direct is not None:
                self._write_direct(*direct)
            return h
        h = Handle(self, "send", tag, seq, view, inline=True, check=check)
        hdr = wire.encode_inline(tag, seq, n, check)
        self._send_inline(h, [hdr, view] if n else [hdr])
        return h

    def irecv(self, buf: Any, tag: int = 0, check: int = 0) -> Handle:
        """Start receiving the next message with ``tag`` into ``buf`` (sizes and ``check`` must match)."""
        return self._irecv(buf, tag, check, only_arrived=False)  # type: ignore[return-value]  # always posts

    def _irecv(self, buf: Any, tag: int, check: int, only_arrived: bool) -> Handle | None:
        view = as_bytes(buf, writable=True)
        copy_from = None
        with self._lock:
            seq = self._rx_seq[tag]
            key = (tag, seq)
            u = self._unexpected.get(key)
            if u is None or not u.complete:  # a message that arrived whole is delivered even now
                self._check_open("recv")
            if only_arrived and u is None:
                return None
            self._rx_seq[tag] = seq + 1
            h = Handle(self, "recv", tag, seq, view, inline=view.nbytes <= self.inline_bytes, check=check)
            if u is None:
                self._posted[key] = h
                return h
            if len(u.buf) != h.nbytes or u.check != check:
                err = self._mismatch(h, len(u.buf), u.check)
            elif u.complete:
                del self._unexpected[key]
                copy_from = u.buf
                err = None
            else:
                u.waiter = h
                h.got = u.got
                return h
        if err is not None:
            self._abort(err)
            raise err
        view[:] = copy_from
        h.got = h.nbytes
        h._complete()
        return h

    def irecv_arrived(self, buf: Any, tag: int = 0, check: int = 0) -> Handle | None:
        """:meth:`irecv`, but only if the next message with ``tag`` has begun to arrive
        (else None, and nothing is posted).  Reads what the control stream holds first,
        without blocking; checking and posting are one step, so no other receive can
        claim the message in between."""
        if self._ctrl_rx_lock.acquire(blocking=False):  # else another waiter is reading it
            try:
                self._pump_ctrl()
            except (OSError, EOFError, RedsockError) as e:
                self._io_failed(e, "recv", reading_ctrl=True)
            finally:
                self._ctrl_rx_lock.release()
        return self._irecv(buf, tag, check, only_arrived=True)

    def send(self, buf: Any, tag: int = 0, timeout: float | None = None, check: int = 0) -> None:
        self.isend(buf, tag, check).wait(timeout)

    def recv(self, buf: Any, tag: int = 0, timeout: float | None = None, check: int = 0) -> None:
        self.irecv(buf, tag, check).wait(timeout)

    def abort(self, reason: str) -> None:
        """Fail the connection now, telling the peer ``reason``."""
        self._abort(TransportError(reason, peer=self.peer, op="abort"))

    @property
    def error(self) -> RedsockError | None:
        return self._error

    @property
    def closed(self) -> bool:
        return self._closed or self._error is not None

    def close(self) -> None:
        """Close every stream; pending operations fail.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._abort(TransportError(f"connection to {self.peer} was closed locally", peer=self.peer, op="close"),
                    notify_peer=False)
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(timeout=5)
        if self._ctrl_tx_thread is not None and self._ctrl_tx_thread is not me:
            self._ctrl_tx_thread.join(timeout=5)
        for s in [self._ctrl, *self._data]:
            s.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Connection to {self.peer} streams={self.nstreams} {'closed' if self.closed else 'open'}>"

    # -- failure ------------------------------------------------------------

    def _check_open(self, op: str) -> None:
        if self._error is not None:
            raise TransportError(f"{op} with {self.peer}: connection is down ({self._error})",
                                 peer=self.peer, op=op) from self._error

    def _mismatch(self, h: Handle, got: int, check: int) -> ProtocolError:
        if check != h.check:  # checked first: it explains a size difference better than sizes do
            what = (f"peer's call signature {check:#06x} differs from this side's {h.check:#06x} "
                    "(the ranks called different collectives, or with different dtype, size or op)")
        else:
            what = f"peer sent {got} bytes, this side expected {h.nbytes}"
        return ProtocolError(f"recv from {self.peer} (tag {h.tag}, message #{h.seq}): {what}",
                             peer=self.peer, op="recv")

    def _abort(self, err: RedsockError, notify_peer: bool = True) -> None:
        """Fail the connection once: every pending operation gets ``err``."""
        with self._lock:
            if self._error is not None:
                return
            self._error = err
            # A send whose slice is being written is left to its writer: if the write
            # went through (the peer may have read it all and closed), the send succeeded.
            writing = {h: job for h, job in self._sends.items() if job.writing}
            pending = [*self._posted.values(), *(h for h in self._sends if h not in writing),
                       *(u.waiter for u in self._unexpected.values() if u.waiter)]
            self._posted.clear()
            self._sends = writing
            # Messages that arrived whole stay receivable (the peer sent them, then closed);
            # the partial ones go, their waiters failed above.
            self._unexpected = {k: u for k, u in self._unexpected.items() if u.complete}
            self._schedule.drain()
            self._send_cv.notify_all()
        with self._ctrl_tx_cv:
            # The backlog's head may be partly written (its writer met a full kernel): the
            # ABORT record must not go into its middle, where the peer would take the reason's
            # bytes for the message's.  With a reason to give, the head is finished and the
            # reason goes behind it, both by the backlog's thread, which then ends the control
            # stream (see _ctrl_send_loop; PEER_REASON_WAIT_S at most: a peer that never reads).
            backlog = self._ctrl_backlog
            linger = notify_peer and bool(backlog)
            head = backlog[0] if linger else None
            pending += [h for h, _ in backlog if h is not None and h is not self._ctrl_writing
                        and (head is None or h is not head[0])]
            backlog.clear()
            if head is not None:
                backlog.extend([head, (None, [wire.encode_abort(str(err))])])
            elif notify_peer:  # best effort, so the peer can say why rather than "connection closed"
                try:  # (under the lock: no other record starts meanwhile)
                    self._ctrl.send(wire.encode_abort(str(err)), socket.MSG_DONTWAIT)
                except OSError:
                    pass
            self._ctrl_tx_cv.notify_all()
        for h in pending:
            h._fail(err)
        if not self._closed:  # callers see it as an exception; the log is for debugging
            log.debug("connection to %s failed (%d operations pending): %s", self.peer, len(pending), err)
        for s in self._data if linger else [self._ctrl, *self._data]:
            shutdown_quietly(s)
        if linger:
            timer = threading.Timer(PEER_REASON_WAIT_S, shutdown_quietly, [self._ctrl])
            timer.daemon = True
            timer.start()

    def _io_failed(self, exc: BaseException, op: str, reading_ctrl: bool = False) -> None:
        """``exc`` ended an operation on a stream.  ``reading_ctrl``: the caller holds the
        control stream (it met the end there itself, after whatever the peer said)."""
        if self._error is not None:
            return
        if isinstance(exc, (EOFError, ConnectionResetError, BrokenPipeError)) and not isinstance(exc, ProtocolError):
            if not reading_ctrl:
                self._take_peer_reason()
            if self._error is not None:
                return
        self._abort(exc if isinstance(exc, RedsockError) else translate_oserror(exc, self.peer, op))

    def _drain_after_peer_close(self) -> None:
        """Every data stream ended cleanly: deliver what the control stream still holds
        (a last inline message sent just before the peer closed), then fail what remains."""
        with self._ctrl_rx_lock:  # a waiter holding it reads its message first, or meets the EOF itself
            self._read_ctrl_to_its_end(time.monotonic() + min(self.config.timeout_s, 10.0))
        self._abort(TransportError(f"{self.peer} closed the connection", peer=self.peer, op="recv"),
                    notify_peer=False)

    def _take_peer_reason(self) -> None:
        """The peer closed: if it said why (an ABORT record, sent before its control stream
        ends), fail with its reason.  A waiter reading the control stream meets that record
        itself: wait for it to do so or to let go (a data stream's reset otherwise wins, and a
        failure reported by the peer would name the peer)."""
        deadline = time.monotonic() + PEER_REASON_WAIT_S
        while not self._ctrl_rx_lock.acquire(timeout=0.01):
            if self._error is not None or time.monotonic() >= deadline:
                return
        try:
            self._read_ctrl_to_its_end(deadline)
        finally:
            self._ctrl_rx_lock.release()

    def _read_ctrl_to_its_end(self, deadline: float) -> None:
        """Deliver what the control stream brings until it ends, the connection fails, or
        ``deadline``; a peer's ABORT record fails the connection with its reason.  Not one
        read: the record may come behind others the peer is still writing (a reducer aborting
        a job while this worker was behind on its results).  Caller holds the rx lock."""
        try:
            while self._error is None and time.monotonic() < deadline:
                self._crx.pump(self, wait=True)  # sleeps in the read while nothing comes
        except TransportError as e:
            if e.op == "peer abort":  # the peer said why it closed
                self._abort(e, notify_peer=False)
        except (OSError, EOFError, RedsockError):
            pass

    # -- waiting ------------------------------------------------------------

    def _wait(self, h: Handle, timeout: float | None) -> None:
        limit = self.config.timeout_s if timeout is None else timeout
        wait_once = self._read_until if h.inline and h.op == "recv" else self._wait_progress
        wait_once(h, limit)
        waited = limit
        if not h.done and self._error is None and self.probe(min(1.0, limit)):
            # The peer is alive, so it is blocked on somebody else: if that one failed, the
            # diagnosis of whoever found it reaches us as an abort (see RELAY_GRACE_S).
            grace = min(limit, RELAY_GRACE_S)
            wait_once(h, grace)
            waited += grace
        if not h.done:
            err = Timeout(f"{h.op} of {h.nbytes} bytes (tag {h.tag}) with {self.peer}: timeout (no progress "
                          f"for {waited:g}s; the call's timeout, by default REDSOCK_TIMEOUT_S)", peer=self.peer, op=h.op)
            self._abort(err)
            h._fail(err)

    def _wait_progress(self, h: Handle, limit: float) -> None:
        """Sleep until ``h`` is done, or nothing of it moved for ``limit`` seconds (the
        threads of the data streams, or an inline receive's reader, complete it)."""
        deadline = time.monotonic() + limit
        last = h.got
        while not h._block(min(_PROGRESS_CHECK_S, max(0.0, deadline - time.monotonic()))):
            if h.got != last:  # moving: the deadline is for a stall, not for a long transfer
                last = h.got
                deadline = time.monotonic() + limit
            elif time.monotonic() >= deadline:
                return

    def probe(self, timeout: float = 1.0) -> bool:
        """True if the peer's process answers a PING within ``timeout`` (its receive threads
        answer even while its application is blocked; a stopped or dead process cannot)."""
        nonce = random.getrandbits(63)
        ev = self._pongs[nonce] = threading.Event()
        deadline = time.monotonic() + timeout
        try:
            return (self._send_probe(wire.RecordType.PING, nonce, deadline)
                    and ev.wait(max(0.0, deadline - time.monotonic())))
        finally:
            self._pongs.pop(nonce, None)

    def _send_probe(self, kind: wire.RecordType, nonce: int, deadline: float) -> bool:
        """Put a PING/PONG on stream 0 without ever blocking past ``deadline``."""
        with self._send_cv:
            self._probes_waiting += 1
            try:
                # A stream 0 stuck mid-send means the peer is not reading: that is the answer already.
                free = self._send_cv.wait_for(lambda: not self._stream_busy[0] or self._error is not None,
                                              max(0.0, deadline - time.monotonic()))
            finally:
                self._probes_waiting -= 1
            if not free or self._error is not None:
                return False
            self._stream_busy[0] = True
        try:
            sock, record = self._data[0], memoryview(wire.encode_probe(kind, nonce))
            try:
                sent = sock.send(record, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False  # nothing went out: the stream is still in step
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLOUT)
            while sent < len(record):  # a partial record must be finished, or the stream is lost
                left = deadline - time.monotonic()
                if left <= 0 or not poller.poll(int(left * 1000) + 1):
                    self._abort(Timeout(f"{self.peer} stopped reading mid-probe", peer=self.peer, op="probe"))
                    return False
                sent += sock.send(record[sent:], socket.MSG_DONTWAIT)
            return True
        except OSError:
            return False
        finally:
            with self._lock:
                self._release_stream(0)

    def _read_until(self, h: Handle, limit: float) -> None:
        """Read the control stream ourselves until inline receive ``h`` is done (no thread
        hop), or ``limit`` seconds have passed.  One frame for the whole wait: a small call's
        every Python call costs microseconds with caches cold from the last context switch."""
        start = time.perf_counter()
        deadline = time.monotonic() + limit
        spin_s = self._spin.budget()
        spin_until = start + spin_s
        try:
            while not h.done:
                if not self._ctrl_rx_lock.acquire(blocking=False):
                    h._block(0.0005)  # another waiter is reading; it completes us if ours comes
                    if time.monotonic() >= deadline:
                        return
                    continue
                try:
                    while not h.done:
                        if time.perf_counter() < spin_until:
                            # Busy-poll: the reply is usually microseconds away.  Yielding keeps a
                            # spinning rank from starving the one it waits for when cores are shared.
                            if self._crx.pump(self, h):
                                spin_until = time.perf_counter() + spin_s
                            else:
                                os.sched_yield()
                            continue
                        if time.monotonic() >= deadline:
                            return
                        # Sleep in the read itself (at most CTRL_READ_WAIT_S, the socket's receive
                        # timeout): the reply wakes us with its bytes, one system call.
                        if self._crx.pump(self, h, wait=True):
                            spin_until = time.perf_counter() + spin_s
                except (OSError, EOFError, RedsockError) as e:
                    self._io_failed(e, "recv", reading_ctrl=True)
                finally:
                    self._ctrl_rx_lock.release()
        finally:
            self._spin.record(time.perf_counter() - start)

    # -- control stream -----------------------------------------------------

    def _send_inline(self, h: Handle, parts: list) -> None:
        total = wire.CTRL_SIZE + h.nbytes  # the header, then h's bytes
        with self._ctrl_tx_lock:
            sent = 0
            failure: OSError | None = None
            if self._error is not None:  # failed since isend looked: nothing goes behind an ABORT record
                h._fail(self._error)
                self._check_open("send")
            if not self._ctrl_backlog:
                try:
                    sent = self._ctrl.sendmsg(parts, (), socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError as e:
                    failure = e  # failed below, once this lock is let go (see the lock order)
                if sent == total:
                    h.got = h.nbytes
                    h._complete()
                    return
            if failure is None:
                # The kernel buffer is full: a helper thread finishes the send, in order.
                self._ctrl_backlog.append((h, advance_parts(parts, sent)))
                if self._ctrl_tx_thread is None:
                    self._ctrl_tx_thread = threading.Thread(target=self._ctrl_send_loop, daemon=True,
                                                            name=f"redsock-ctx-{self.peer}")
                    self._ctrl_tx_thread.start()
                self._ctrl_tx_cv.notify()
                return
        self._io_failed(failure, "send")
        err = self._error or translate_oserror(failure, self.peer, "send")
        raise TransportError(f"send to {self.peer}: {err}", peer=self.peer, op="send") from failure

    def _ctrl_send_loop(self) -> None:
        h: Handle | None = None
        try:
            while True:
                with self._ctrl_tx_cv:
                    while not self._ctrl_backlog:
                        if self._error is not None:
                            shutdown_quietly(self._ctrl)  # behind the ABORT record, if _abort left one
                            return
                        self._ctrl_tx_cv.wait()
                    h, parts = self._ctrl_backlog[0]  # stays queued until sent, so order holds
                    self._ctrl_writing = h
                try:
                    send_all(self._ctrl, parts)
                finally:
                    with self._ctrl_tx_cv:
                        self._ctrl_writing = None
                        if self._ctrl_backlog and self._ctrl_backlog[0][0] is h:
                            self._ctrl_backlog.popleft()
                if h is not None:
                    h.got = h.nbytes
                    h._complete()
        except OSError as e:
            self._io_failed(e, "send")
            if h is not None:  # a failure that came first left it to us
                h._fail(self._error or translate_oserror(e, self.peer, "send"))

    def _pump_ctrl(self) -> bool:
        """Read whatever the control stream has, without blocking; True if anything moved.
        Caller holds the rx lock."""
        return self._crx.pump(self)

    def ctrl_whole(self, rec: wire.CtrlRecord, payload: memoryview) -> None:
        """An inline message that arrived whole: into its posted receive in one step."""
        key = (rec.tag, rec.seq)
        with self._lock:
            h = self._posted.get(key)
            if h is not None and h.nbytes == rec.length and h.check == rec.check:
                del self._posted[key]
            else:
                h = None
        if h is None:  # not posted yet, or mismatched: the general path keeps it or says why
            owner, target = self._message_target(rec.tag, rec.seq, rec.length, 0, rec.length, rec.check)
            target[:] = payload
            self._delivered(key, owner, rec.length)
            return
        h.view[:] = payload
        h.got = h.nbytes
        h._complete()

    def ctrl_begin(self, rec: wire.CtrlRecord) -> memoryview:
        """A control record whose payload was not staged whole: where it goes."""
        self._crx_abort = rec.type == wire.RecordType.ABORT
        if self._crx_abort:
            self._crx_owner = None
            self._crx_target = memoryview(bytearray(rec.length))
        else:
            self._crx_key = (rec.tag, rec.seq)
            owner, target = self._message_target(rec.tag, rec.seq, rec.length, 0, rec.length, rec.check)
            self._crx_owner, self._crx_target = owner, target
        return self._crx_target

    def ctrl_end(self) -> None:
        target, owner = self._crx_target, self._crx_owner
        self._crx_target = self._crx_owner = None
        if self._crx_abort:
            reason = bytes(target or b"").decode(errors="replace")
            raise TransportError(f"{self.peer} aborted the connection: {reason}", peer=self.peer, op="peer abort")
        self._delivered(self._crx_key, owner, len(target or b""))

    # -- data streams -------------------------------------------------------

    def _message_target(self, tag: int, seq: int, total: int, offset: int, length: int, check: int
                        ) -> tuple[Handle | _Unexpected, memoryview]:
        """Where bytes [offset, offset+length) of message (tag, seq) go."""
        key = (tag, seq)
        with self._lock:
            h = self._posted.get(key)
            if h is not None:
                if h.nbytes != total or h.check != check:
                    raise self._mismatch(h, total, check)
                return h, h.view[offset:offset + length]
            u = self._unexpected.get(key)
            if u is None:
                if total > self.config.max_message_bytes:
                    raise ProtocolError(f"{self.peer} sent a {total}-byte message, above the limit")
                try:
                    u = self._unexpected[key] = _Unexpected(total, check)
                except MemoryError:
                    raise ProtocolError(f"{self.peer} sent a {total}-byte message before it was expected, "
                                        "and there is no memory to hold it") from None
            elif len(u.buf) != total or u.check != check:
                raise ProtocolError(f"{self.peer} changed the size of message {key} mid-way")
            return u, u.buf[offset:offset + length]

    def _delivered(self, key: tuple[int, int], owner: Handle | _Unexpected, n: int) -> None:
        """``n`` more bytes of message ``key`` have landed in ``owner``."""
        waiter = None
        with self._lock:
            owner.got += n
            if isinstance(owner, Handle):
                if owner.got >= owner.nbytes:
                    self._posted.pop(key, None)
                    owner._complete()
                return
            if owner.got < len(owner.buf):
                if owner.waiter is not None:  # show progress, or a long message looks stalled
                    owner.waiter.got = owner.got
                return
            owner.complete = True
            if owner.waiter is not None:
                waiter = owner.waiter
                self._unexpected.pop(key, None)
        if waiter is not None:  # the receive was posted mid-message: one copy, outside the lock
            waiter.view[:] = owner.buf
            waiter.got = waiter.nbytes
            waiter._complete()

    def _send_loop(self, idx: int) -> None:
        sock = self._data[idx]
        zc = None
        if self.config.zerocopy_min_bytes and zerocopy.available():
            try:
                zc = zerocopy.ZeroCopySender(sock)
            except OSError as e:
                zerocopy.disable(f"SO_ZEROCOPY refused ({e.strerror})")
        try:
            while True:
                with self._send_cv:
                    work = self._next_work(idx)
                    while work is None:
                        if self._error is not None:
                            return
                        self._send_cv.wait(0.001 if zc and zc.outstanding else None)
                        if zc and zc.outstanding:
                            break
                        work = self._next_work(idx)
                if work is None:
                    zc.reap(0.001)  # type: ignore[union-attr]
                    continue
                job, n, parts = work
                written = 0
                try:
                    written = self._write_slice(sock, zc, job, parts, n)
                finally:
                    with self._lock:
                        self._slice_written(idx, job, written)
        except (OSError, RedsockError) as e:
            self._io_failed(e, "send")

    def _next_work(self, idx: int) -> tuple[SendJob, int, list] | None:
        """Under the lock: what stream ``idx``'s thread writes next (job, slice length, buffers),
        the stream now its own; None while there is nothing, or another writer has the stream."""
        rest = self._stream_rest[idx]
        if rest is not None:  # the stream is already ours: the caller that began it left it busy
            self._stream_rest[idx] = None
            return rest
        item = self._take_stream(idx)
        return None if item is None else (item.job, item.length, _slice_parts(item))

    def _claim_idle_stream(self) -> tuple[int, Slice] | None:
        """Under the lock: an idle stream and its next slice, for the caller to write itself."""
        if self._direct_writes:
            for idx in range(self.nstreams):
                item = self._take_stream(idx)
                if item is not None:
                    return idx, item
        return None

    def _take_stream(self, idx: int) -> Slice | None:
        """Under the lock: if stream ``idx`` is idle and has a slice to send, make it busy
        writing that slice and return it."""
        if self._stream_busy[idx]:
            return None
        item = self._schedule.next_slice(idx)
        if item is not None:
            self._stream_busy[idx] = True
            item.job.writing += 1
            self.slices_sent[idx] += 1
            self.bytes_sent[idx] += item.length
        return item

    def _write_direct(self, idx: int, item: Slice) -> None:
        """Write a slice from the caller's thread without blocking, so that a stream with room
        costs no wake-up of its thread: a reducer's piece, one slice, goes out as the caller
        posts it (4 workers + 4 reducers on loopback, 64 MiB in 256 KiB pieces: each worker's
        CPU 116-135 -> 101-107 ms per call).  What the kernel cannot take now, the stream's
        thread writes; a failure fails the connection, and so the send's handle."""
        job, n = item.job, item.length
        parts = _slice_parts(item)
        try:
            sent = self._data[idx].sendmsg(parts, (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            with self._lock:
                self._slice_written(idx, job, 0)
            self._io_failed(e, "send")
            return
        with self._lock:
            if sent == wire.SLICE_SIZE + n:
                self.direct_slices += 1
                self._slice_written(idx, job, n)
            elif self._error is None:  # else the thread may be gone: settled here
                self._stream_rest[idx] = (job, n, advance_parts(parts, sent))
                self._send_cv.notify_all()
            else:
                self._slice_written(idx, job, 0)

    def _answer_probe(self, sock: socket.socket, rec: wire.SliceRecord) -> None:
        if rec.type == wire.RecordType.PING:  # answered on stream 0, whichever stream it came on
            self._send_probe(wire.RecordType.PONG, rec.tag, time.monotonic() + 1.0)
        else:
            ev = self._pongs.get(rec.tag)
            if ev is not None:
                ev.set()

    def _write_slice(self, sock: socket.socket, zc: zerocopy.ZeroCopySender | None, job: SendJob,
                     parts: list, n: int) -> int:
        """Write one slice; returns its bytes now in the kernel (0 for a zero-copy send: the
        kernel's release of the pages reports them)."""
        if zc is not None and n >= self.config.zerocopy_min_bytes and zerocopy.available():
            try:
                zc.send(parts, lambda: self._slice_released(job, n))
                return 0
            except OSError as e:
                if e.errno not in (105, 12):  # ENOBUFS/ENOMEM: out of pinned memory
                    raise
                zerocopy.disable(f"zero-copy send failed ({e.strerror})")
        send_all(sock, parts)
        return n

    def _slice_written(self, idx: int, job: SendJob, n: int) -> None:
        """Under the lock: a write of a slice of ``job`` on stream ``idx`` returned, ``n`` bytes
        of it done (0 if it failed), and the stream is free.  If the connection failed
        meanwhile, the send is settled here."""
        job.writing -= 1
        self._account(job, n)
        self._release_stream(idx)

    def _release_stream(self, idx: int) -> None:
        """Under the lock: stream ``idx`` has no writer now; wake whoever waits for it."""
        self._stream_busy[idx] = False
        if self._schedule.has_work(idx) or (idx == 0 and self._probes_waiting):
            self._send_cv.notify_all()

    def _slice_released(self, job: SendJob, n: int) -> None:
        with self._lock:
            self._account(job, n)

    def _account(self, job: SendJob, n: int) -> None:
        """Count ``n`` more bytes of ``job`` as sent (under the lock); settle it once all are,
        or once the connection has failed and no write of it is left to report."""
        h = job.handle
        job.done_bytes += n
        h.got = job.done_bytes
        if job.done_bytes == job.total:
            self._sends.pop(h, None)
            h._complete()
        elif self._error is not None and not job.writing and self._sends.pop(h, None) is not None:
            h._fail(self._error)  # the rest of it was dropped with the connection

    def _recv_loop(self, idx: int) -> None:
        sock = self._data[idx]
        reader = StreamReader(sock, RCVLOWAT_MAX)
        hdr = bytearray(wire.SLICE_SIZE)
        hview = memoryview(hdr)
        limit = self.config.max_message_bytes
        try:
            while True:
                if not reader.read_exact(hview):
                    # A clean end of this stream.  Others may still carry data that was sent
                    # before the peer closed: the connection is down only when all have ended.
                    with self._lock:
                        self._streams_ended += 1
                        all_ended = self._streams_ended == len(self._data)
                    if all_ended:
                        self._drain_after_peer_close()
                    return
                rec = wire.decode_slice(hdr, limit)
                if rec.type != wire.RecordType.SLICE:
                    self._answer_probe(sock, rec)
                    continue
                owner, target = self._message_target(rec.tag, rec.seq, rec.total, rec.offset, rec.length, rec.check)
                if not reader.read_exact(target):
                    raise EOFError("peer closed the connection mid-slice")
                self._delivered((rec.tag, rec.seq), owner, rec.length)
        except (OSError, EOFError, RedsockError) as e:
            self._io_failed(e, "recv")


def _slice_parts(item: Slice) -> list:
    """A data-stream record: the slice header, then the bytes straight from the message."""
    job, off, n = item.job, item.offset, item.length
    return [wire.encode_slice(job.tag, job.seq, job.total, off, n, job.check), job.view[off:off + n]]
