"""The reducer's event loops: workers' Fast Socket connections served over non-blocking sockets.

A worker's connection is a control stream plus K data streams (see
:mod:`redsock.transport`).  Here no thread belongs to a connection: each
:class:`Loop` thread owns a set of connections in one epoll set, decodes their
records with the pure :mod:`redsock.wire` functions, receives contributions
straight into pooled buffers, and hands each complete contribution to the
server (:class:`Handler`), which sums it at once on the same thread.  Whoever
completes a piece writes the result to every worker of the job right away
(non-blocking; only what the kernel cannot take now waits for the socket's
owner loop to see it writable), so a small piece never leaves the thread that
read its last contribution.

Records the reducer understands, worker to reducer:

* control stream: ``INLINE`` messages (an Announce, possibly followed by the
  call's only piece for this reducer; or a piece) and ``ABORT``;
* data streams: ``SLICE`` records of pieces too large to go inline, and
  ``PING`` probes (answered with ``PONG`` on data stream 0).

Results go back the same way: inline on the control stream up to the
connection's inline threshold, else as slices spread over whichever data
streams have room (Fast Socket's dynamic slicing).
"""

from __future__ import annotations

import logging
import select
import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

import numpy as np

from .. import wire
from ..config import Config
from ..errors import ProtocolError, RedsockError, TransportError
from ..transport.sockets import (
    ControlReader,
    advance_parts,
    read_available,
    send_all,
    shutdown_quietly,
    translate_oserror,
)
from .aggregate import BufferPool

log = logging.getLogger("redsock.server")

STAGE_BYTES = 64 * 1024  # one control-stream read brings whole small records, usually several
RCVLOWAT_MAX = 4 * 1024 * 1024  # a data stream's loop is woken about once per slice, not per segment
#: Messages a connection may have arriving, or waiting for their announce, at once: workers keep
#: WINDOW (4) pieces in flight per reducer, so more is a broken or hostile peer (memory stays bounded).
MAX_AHEAD = 32
#: How long an aborted connection's last control records (the one the kernel had taken in part,
#: then the ABORT record with the reason) may wait for a worker behind on reading to make room:
#: it reads its control stream to the end once the data streams end (for up to 10 s).
ABORT_FLUSH_S = 10.0
_IN = select.EPOLLIN | select.EPOLLRDHUP
_OUT = select.EPOLLOUT


class Handler(Protocol):
    """What the server does with a connection's decoded messages (called on its loop's thread)."""

    def on_announce(self, link: "Link", payload: memoryview) -> None:
        """``payload`` may be the control stream's staging buffer: valid during the call only."""

    def on_piece(self, link: "Link", tag: int, buf: np.ndarray) -> None: ...

    def on_progress(self, link: "Link") -> None: ...

    def on_lost(self, link: "Link", err: RedsockError) -> None: ...


class Outgoing:
    """A result buffer shared by the slices that carry it to every worker: back to the pool
    once the last of them is written (slices of one message may finish in any order)."""

    __slots__ = ("buf", "pool", "left", "lock")

    def __init__(self, buf: np.ndarray, pool: BufferPool, users: int):
        self.buf, self.pool, self.left = buf, pool, users
        self.lock = threading.Lock()

    def release(self) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self.pool.give(self.buf)


class _Incoming:
    """A contribution arriving in slices on the data streams."""

    __slots__ = ("buf", "got")

    def __init__(self, buf: np.ndarray | bytearray):
        self.buf, self.got = buf, 0


class _Stream:
    """One data stream's receive state (a header, then its payload) and send state."""

    __slots__ = ("sock", "fd", "hdr", "hview", "hgot", "msg", "key", "target", "tgot", "lowat",
                 "tx", "tx_owner", "want_out")

    def __init__(self, sock: socket.socket):
        self.sock, self.fd = sock, sock.fileno()
        self.hdr = bytearray(wire.SLICE_SIZE)
        self.hview = memoryview(self.hdr)
        self.hgot = 0
        self.msg: _Incoming | None = None
        self.key = (0, 0)
        self.target: memoryview | None = None
        self.tgot = 0
        self.lowat = 1
        self.tx: list | None = None  # the parts of the slice (or probe) being written
        self.tx_owner: Outgoing | None = None
        self.want_out = False


class Link:
    """One worker's connection, owned by one :class:`Loop`.

    Receiving runs only on the owner loop's thread.  Sending may come from any thread
    (whoever completed a piece) under ``tx_lock``; the owner loop finishes what the
    kernel could not take at once.  An aborted link closed before its last control records
    are out hands its control socket to a thread of its own (:func:`_finish_abort`): nothing
    else touches that socket from then on (``closed`` is set under ``tx_lock``)."""

    def __init__(self, ctrl: socket.socket, data: list[socket.socket], *, peer: str, config: Config,
                 inline_bytes: int, pool: BufferPool, handler: Handler):
        self.peer, self.config, self.inline_bytes = peer, config, inline_bytes
        self.pool, self.handler = pool, handler
        self.ctrl, self.ctrl_fd = ctrl, ctrl.fileno()
        self.streams = [_Stream(s) for s in data]
        self.loop: Loop | None = None
        self.identity: tuple[int, int] | None = None  # (job, rank), bound by the first announce
        self.announces = 0  # announces received (their seq on the wire)
        self.pending: dict[int, object] = {}  # server's per-connection state (op_seq -> round)
        self.early: dict[int, np.ndarray] = {}  # contributions that came before their announce
        self.incoming: dict[tuple[int, int], _Incoming] = {}  # (tag, seq) -> a message arriving in slices
        self._announce_early: dict[int, np.ndarray | bytearray] = {}  # announces that overtook one
        self.max_early = MAX_AHEAD
        # control stream receive state: the record under way, for ctrl_end
        self._crx = ControlReader(ctrl, STAGE_BYTES, max(inline_bytes, wire.ANNOUNCE_SIZE))
        self._crec: wire.CtrlRecord | None = None
        self._cbuf: np.ndarray | bytearray | None = None
        # send state
        self.tx_lock = threading.Lock()
        self._ctrl_out: deque[bytes | memoryview] = deque()
        self._ctrl_want_out = False
        self._slices: deque[tuple[bytes, memoryview, Outgoing]] = deque()  # not yet on a stream
        self.closed = False
        self.error: RedsockError | None = None

    def __repr__(self) -> str:
        return f"<Link {self.peer} {self.identity}>"

    # -- receiving (owner loop only) --------------------------------------------------

    def on_ctrl(self) -> None:
        """Parse what the control stream has: records and their payloads (until a read comes
        back short: epoll says when more comes)."""
        self._crx.pump(self)

    def ctrl_whole(self, rec: wire.CtrlRecord, payload: memoryview) -> None:
        """A message staged whole (a small one usually is): taken at once.  An announce in
        turn (nearly always) is handled where it lies; anything else gets its own buffer."""
        if rec.tag == wire.ANNOUNCE_TAG and self._announce_in_turn(rec.seq, payload):
            return
        buf = self._message_buffer(rec.tag, rec.seq, rec.length)
        memoryview(buf).cast("B")[:] = payload
        self._message(rec.tag, rec.seq, buf)

    def ctrl_begin(self, rec: wire.CtrlRecord) -> memoryview:
        self._crec = rec
        if rec.type == wire.RecordType.ABORT:
            self._cbuf = bytearray(rec.length)
        else:
            self._cbuf = self._message_buffer(rec.tag, rec.seq, rec.length)
        return memoryview(self._cbuf).cast("B")

    def ctrl_end(self) -> None:
        rec, buf = self._crec, self._cbuf
        self._crec = self._cbuf = None
        assert rec is not None and buf is not None
        if rec.type == wire.RecordType.ABORT:
            reason = bytes(buf).decode(errors="replace")
            raise TransportError(f"{self.peer} aborted the connection: {reason}", peer=self.peer, op="peer abort")
        self._message(rec.tag, rec.seq, buf)

    def _message(self, tag: int, seq: int, buf: np.ndarray | bytearray) -> None:
        """A whole message arrived (inline or in slices)."""
        if tag != wire.ANNOUNCE_TAG:
            self.handler.on_piece(self, tag, buf)  # type: ignore[arg-type]
            return
        if self._announce_in_turn(seq, memoryview(buf)):
            return
        if seq < self.announces or seq in self._announce_early or len(self._announce_early) >= self.max_early:
            raise ProtocolError(f"{self.peer} sent announce #{seq} out of turn (expected #{self.announces})")
        self._announce_early[seq] = buf
        while self.announces in self._announce_early:  # in call order, whichever stream each came on
            ann = self._announce_early.pop(self.announces)
            self.announces += 1
            self.handler.on_announce(self, memoryview(ann))

    def _announce_in_turn(self, seq: int, payload: memoryview) -> bool:
        """Hand announce #``seq`` to the handler if it is the next one, as nearly always."""
        if seq != self.announces or self._announce_early:
            return False
        self.announces += 1
        self.handler.on_announce(self, payload)
        return True

    def _message_buffer(self, tag: int, seq: int, nbytes: int) -> np.ndarray | bytearray:
        """Where a message of ``nbytes`` goes: a small bytearray for an announce, else a pooled
        buffer for a contribution (bounded in size and in number)."""
        if tag == wire.ANNOUNCE_TAG:
            if nbytes > wire.ANNOUNCE_SIZE + max(self.inline_bytes, wire.MAX_INLINE):
                raise ProtocolError(f"{self.peer} sent a {nbytes}-byte announce")
            return bytearray(nbytes)
        # A piece's tag names its call and piece: it is used once per connection.
        if seq != 0 or tag < (1 << wire.PIECE_BITS):
            raise ProtocolError(f"{self.peer} sent message #{seq} with tag {tag:#x}: not a piece of a call")
        if nbytes > self.config.max_message_bytes:
            raise ProtocolError(f"{self.peer} sent a {nbytes}-byte piece, above the limit "
                                f"{self.config.max_message_bytes} (--max-piece-bytes)")
        if len(self.incoming) + len(self.early) >= self.max_early:
            raise ProtocolError(f"{self.peer} sent more pieces ahead than its credits allow")
        return self.pool.take(nbytes)

    def on_data(self, i: int) -> None:
        """Parse what data stream ``i`` has: slice headers, payloads straight into their piece."""
        st = self.streams[i]
        sock = st.sock
        while True:
            target = st.target
            if target is None:
                n = read_available(sock, st.hview[st.hgot:])
                if n is None:
                    return
                st.hgot += n
                if st.hgot < wire.SLICE_SIZE:
                    continue
                st.hgot = 0
                rec = wire.decode_slice(st.hdr, self.config.max_message_bytes)
                if rec.type != wire.RecordType.SLICE:
                    if rec.type == wire.RecordType.PING:
                        self._send_probe_answer(rec.tag)
                    continue
                key = (rec.tag, rec.seq)
                msg = self.incoming.get(key)
                if msg is None:
                    msg = self.incoming[key] = _Incoming(self._message_buffer(rec.tag, rec.seq, rec.total))
                elif len(msg.buf) != rec.total:
                    raise ProtocolError(f"{self.peer} changed the size of message {key} mid-way")
                st.msg, st.key, st.tgot = msg, key, 0
                st.target = memoryview(msg.buf).cast("B")[rec.offset:rec.offset + rec.length]
                continue
            n = read_available(sock, target[st.tgot:]) or 0
            st.tgot += n
            left = len(target) - st.tgot
            if left:  # the socket is empty: wake this loop once the rest is there, not per segment
                want = min(left, RCVLOWAT_MAX)
                if want != st.lowat:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                    st.lowat = want
                return
            msg = st.msg
            assert msg is not None
            msg.got += len(target)
            st.target = st.msg = None
            if st.lowat != 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
                st.lowat = 1
            self.handler.on_progress(self)
            if msg.got == len(msg.buf):
                del self.incoming[st.key]
                self._message(*st.key, msg.buf)

    # -- sending (any thread) -----------------------------------------------------------

    def send_inline(self, record: bytes) -> None:
        """A whole inline record (header and payload) on the control stream."""
        with self.tx_lock:
            if self.closed or self.error is not None:  # failing: nothing goes after the ABORT record
                return
            if not self._ctrl_out:
                try:
                    n = self.ctrl.send(record, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    n = 0
                except OSError as e:
                    self._tx_failed(e)
                    return
                if n == len(record):
                    return
                record = memoryview(record)[n:]
            self._ctrl_out.append(record)
            self._watch_ctrl_out(True)

    def send_slices(self, slices: list[tuple[bytes, memoryview]], out: Outgoing) -> None:
        """A message as slice records; each goes out on whichever data stream has room first."""
        with self.tx_lock:
            if self.closed or self.error is not None:
                for _ in slices:
                    out.release()
                return
            for hdr, payload in slices:
                self._slices.append((hdr, payload, out))
            for i in range(len(self.streams)):
                self._pump(i)

    def _send_probe_answer(self, nonce: int) -> None:
        with self.tx_lock:
            if not self.closed and self.error is None:
                self._slices.appendleft((wire.encode_probe(wire.RecordType.PONG, nonce), memoryview(b""), None))
                self._pump(0)

    def _pump(self, i: int) -> None:
        """Write on data stream ``i`` until the kernel is full or nothing is left (tx_lock held)."""
        st = self.streams[i]
        try:
            while True:
                if st.tx is None:
                    if not self._slices:
                        break
                    hdr, payload, owner = self._slices.popleft()
                    st.tx, st.tx_owner = ([hdr, payload] if len(payload) else [hdr]), owner
                total = sum(len(p) for p in st.tx)
                try:
                    n = st.sock.sendmsg(st.tx, (), socket.MSG_DONTWAIT)
                except BlockingIOError:
                    n = 0
                if n < total:
                    st.tx = advance_parts(st.tx, n)
                    break
                owner, st.tx, st.tx_owner = st.tx_owner, None, None
                if owner is not None:
                    owner.release()
        except OSError as e:
            self._tx_failed(e)
            return
        self._watch_out(st, st.tx is not None)

    def on_writable_ctrl(self) -> None:
        with self.tx_lock:
            if not self.closed:
                self._flush_ctrl()

    def _flush_ctrl(self) -> None:
        """Write the queued control records until the kernel is full (tx_lock held).  Once an
        aborted connection's ABORT record is out, the control stream ends behind it."""
        try:
            while self._ctrl_out:
                head = self._ctrl_out[0]
                try:
                    n = self.ctrl.send(head, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                if n < len(head):
                    self._ctrl_out[0] = memoryview(head)[n:]
                    break
                self._ctrl_out.popleft()
        except OSError as e:
            self._tx_failed(e)
            return
        self._watch_ctrl_out(bool(self._ctrl_out))
        if self.error is not None and not self._ctrl_out:
            shutdown_quietly(self.ctrl)

    def on_writable_data(self, i: int) -> None:
        with self.tx_lock:
            # Failing: the data streams are shut, and a write's error there must not cut the
            # control stream before the ABORT record is out (see abort()).
            if not self.closed and self.error is None:
                self._pump(i)

    def _watch_ctrl_out(self, on: bool) -> None:
        if on != self._ctrl_want_out and self.loop is not None:
            self._ctrl_want_out = on
            self.loop.modify(self.ctrl_fd, _IN | (_OUT if on else 0))

    def _watch_out(self, st: _Stream, on: bool) -> None:
        if on != st.want_out and self.loop is not None:
            st.want_out = on
            self.loop.modify(st.fd, _IN | (_OUT if on else 0))

    def _tx_failed(self, e: OSError) -> None:
        """A write failed: the receive side meets the same end and reports it (owner loop)."""
        if self.error is None:
            self.error = translate_oserror(e, self.peer, "send")
        self._ctrl_out.clear()  # nothing more can reach the worker
        for s in self._sockets():
            shutdown_quietly(s)

    # -- ending -------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Tell the worker why and cut the connection; any thread, never blocking.

        The reason goes as an ABORT record behind any control record the kernel has taken in
        part (a worker behind on reading its results), so the worker reads what it was owed,
        then why.  The data streams end at once: the worker's readers meet their end and read
        the control stream to its end, which follows the ABORT record (see :meth:`_flush_ctrl`
        and :meth:`close`).  The owner loop then sees the end and frees what the connection holds."""
        with self.tx_lock:
            if self.closed or self.error is not None:
                return  # closed, or already failing (the first reason is the one that counts)
            self.error = TransportError(reason, peer=self.peer, op="abort")
            self._ctrl_out.append(wire.encode_abort(reason))
            for st in self.streams:
                shutdown_quietly(st.sock)
            self._flush_ctrl()

    def close(self) -> None:
        """Close the sockets and give back every buffer held (owner loop, once)."""
        with self.tx_lock:
            if self.closed:
                return
            self.closed = True
            for st in self.streams:
                if st.tx_owner is not None:
                    st.tx_owner.release()
                st.tx = st.tx_owner = None
            for _, _, owner in self._slices:
                if owner is not None:
                    owner.release()
            self._slices.clear()
            for st in self.streams:
                st.sock.close()
            unsent, self._ctrl_out = list(self._ctrl_out), deque()
            aborted = isinstance(self.error, TransportError) and self.error.op == "abort"
            if unsent and aborted:  # its ABORT record (and what it queued behind) not yet out: see abort()
                threading.Thread(target=_finish_abort, args=(self.ctrl, unsent, self.peer),
                                 name=f"redsock-abort-{self.peer}", daemon=True).start()
            else:
                self.ctrl.close()
        for msg in self.incoming.values():
            if isinstance(msg.buf, np.ndarray):
                self.pool.give(msg.buf)
        for buf in self.early.values():
            self.pool.give(buf)
        if isinstance(self._cbuf, np.ndarray):
            self.pool.give(self._cbuf)
        self.incoming.clear()
        self.early.clear()
        self._cbuf = None

    def _sockets(self) -> list[socket.socket]:
        return [self.ctrl, *(st.sock for st in self.streams)]


def _finish_abort(ctrl: socket.socket, unsent: list[bytes | memoryview], peer: str) -> None:
    """Write an aborted connection's last control records, then close it: on a thread of its
    own (rare: a failure meeting a worker behind on reading), so a slow worker never holds up
    the loop's other connections.  A write that waits ABORT_FLUSH_S for room gives up (a
    frozen worker never reads)."""
    try:
        ctrl.settimeout(ABORT_FLUSH_S)
        send_all(ctrl, unsent)
        ctrl.shutdown(socket.SHUT_WR)
    except OSError as e:  # the worker went, or never read in time: it meets the end without the reason
        log.info("the reason for aborting %s did not reach it: %s", peer, e)
    finally:
        ctrl.close()


class Loop:
    """One event-loop thread and the connections it owns."""

    def __init__(self, name: str):
        self._ep = select.epoll()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._ep.register(self._wake_r.fileno(), select.EPOLLIN)
        self._fds: dict[int, tuple[Link, int]] = {}  # fd -> (link, -1 for control or stream index)
        self._links: set[Link] = set()
        self._calls: deque[Callable[[], None]] = deque()
        self._stopping: str | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def __len__(self) -> int:
        return len(self._links)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on this loop's thread (any thread may call this)."""
        self._calls.append(fn)
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already woken (buffer full) or closing

    def adopt(self, link: Link) -> None:
        self.call_soon(lambda: self._register(link))

    def modify(self, fd: int, events: int) -> None:
        try:
            self._ep.modify(fd, events)
        except (OSError, ValueError):
            pass  # the connection is being closed

    def stop(self, reason: str) -> None:
        """Abort every connection with ``reason``, close them, end the thread."""
        def stopping() -> None:
            self._stopping = reason
        self.call_soon(stopping)

    def _register(self, link: Link) -> None:
        link.loop = self
        self._links.add(link)
        for fd, idx in [(link.ctrl_fd, -1), *((st.fd, i) for i, st in enumerate(link.streams))]:
            self._fds[fd] = (link, idx)
            self._ep.register(fd, _IN)
        for s in link._sockets():
            s.setblocking(False)
        if self._stopping:
            link.abort(self._stopping)

    def _drop(self, link: Link, err: RedsockError | None) -> None:
        if link not in self._links:
            return
        self._links.discard(link)
        for fd in [link.ctrl_fd, *(st.fd for st in link.streams)]:
            self._fds.pop(fd, None)
            try:
                self._ep.unregister(fd)
            except (OSError, ValueError):
                pass
        if err is not None:
            # The handler first (it clears the link's job and tells the job's other workers), so
            # that what a worker sees once it learns of the failure is already so.
            try:
                link.handler.on_lost(link, link.error or err)
            except Exception:  # a bug in the handler must not take the loop down
                log.exception("while dropping %s", link.peer)
            if isinstance(err, ProtocolError):  # the worker broke the protocol: tell it how before cutting it off
                link.abort(f"the reduction server refused what it was sent: {err}")
        link.close()

    def _run(self) -> None:
        ep, fds = self._ep, self._fds
        wake_fd = self._wake_r.fileno()
        try:
            while True:
                if self._stopping is not None:
                    self._shut_down()
                    return
                for fd, ev in ep.poll():
                    if fd == wake_fd:
                        self._run_calls()
                        continue
                    entry = fds.get(fd)
                    if entry is None:
                        continue
                    link, idx = entry
                    try:
                        if ev & _OUT:
                            if idx < 0:
                                link.on_writable_ctrl()
                            else:
                                link.on_writable_data(idx)
                        if ev & (select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP | select.EPOLLRDHUP):
                            if idx < 0:
                                link.on_ctrl()
                            else:
                                link.on_data(idx)
                    except (OSError, EOFError, RedsockError) as e:
                        self._drop(link, e if isinstance(e, RedsockError) else translate_oserror(e, link.peer, "recv"))
        finally:
            self._wake_r.close()
            self._wake_w.close()
            ep.close()

    def _run_calls(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while self._calls:
            self._calls.popleft()()

    def _shut_down(self) -> None:
        self._run_calls()
        for link in list(self._links):
            link.abort(self._stopping or "reduction server shutting down")
            self._drop(link, TransportError(self._stopping or "shutting down", peer=link.peer, op="close"))

