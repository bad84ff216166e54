"""Socket plumbing: options set in one place, exact reads/writes, and the one
boundary where ``OSError`` becomes a :class:`~redsock.errors.TransportError`."""

from __future__ import annotations

import errno
import ipaddress
import logging
import select
import socket
from typing import Protocol

from .. import wire
from ..config import Config
from ..errors import Timeout, TransportError

log = logging.getLogger("redsock.transport")

# Not exported by every Python's socket module; values from <linux/socket.h>.
SO_ZEROCOPY = getattr(socket, "SO_ZEROCOPY", 60)
MSG_ZEROCOPY = getattr(socket, "MSG_ZEROCOPY", 0x4000000)
SO_BUSY_POLL = getattr(socket, "SO_BUSY_POLL", 46)
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)


def same_host(sock: socket.socket) -> bool:
    """True if ``sock`` (connected) talks to this same host: a loopback peer, or a peer at the
    address this end uses.  (A host in another network namespace counts as another host.)"""
    try:
        peer, local = sock.getpeername()[0], sock.getsockname()[0]
    except OSError:
        return False
    return peer == local or ipaddress.ip_address(peer.removeprefix("::ffff:")).is_loopback


def tune(sock: socket.socket, config: Config, *, data: bool) -> None:
    """Set every socket option redsock relies on, with the reason for each."""
    # Small records (control, headers, latency-bound messages) must not wait for Nagle.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if data and config.notsent_lowat:
        # Keep unsent bytes in user space: a stream only takes its next slice once the
        # kernel has nearly drained the last one, so occupancy reflects real stream speed.
        sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, config.notsent_lowat)
    if not data and config.busy_poll_us:
        try:  # lets the kernel spin on the NIC queue for the latency-bound control stream
            sock.setsockopt(socket.SOL_SOCKET, SO_BUSY_POLL, config.busy_poll_us)
        except OSError as e:
            log.warning("SO_BUSY_POLL unavailable (%s); continuing without it", e.strerror)


def translate_oserror(exc: BaseException, peer: str, op: str) -> TransportError:
    """The single place where socket errors become redsock errors."""
    if isinstance(exc, TransportError):
        return exc
    if isinstance(exc, (socket.timeout, TimeoutError)):
        err: TransportError = Timeout(f"{op} with {peer}: timed out", peer=peer, op=op)
    elif isinstance(exc, ConnectionRefusedError):
        err = TransportError(f"{op} with {peer}: connection refused (is it listening?)", peer=peer, op=op)
    elif isinstance(exc, (ConnectionResetError, BrokenPipeError, EOFError)) or (
        isinstance(exc, OSError) and exc.errno in (errno.ECONNABORTED, errno.ENOTCONN, errno.EPIPE)
    ):
        err = TransportError(f"{op} with {peer}: peer closed the connection ({exc})", peer=peer, op=op)
    elif isinstance(exc, OSError):
        err = TransportError(f"{op} with {peer}: {exc.strerror or exc}", peer=peer, op=op)
    else:
        err = TransportError(f"{op} with {peer}: {exc}", peer=peer, op=op)
    err.__cause__ = exc
    return err


def read_available(sock: socket.socket, view: memoryview, flags: int = socket.MSG_DONTWAIT) -> int | None:
    """Read what ``sock`` has, up to ``len(view)`` (> 0) bytes, without blocking: None if
    nothing is there yet; EOFError at the end of the stream.  ``flags`` 0, on a blocking
    socket with a receive timeout: wait for the first bytes, at most that timeout."""
    try:
        n = sock.recv_into(view, len(view), flags)
    except BlockingIOError:
        return None
    if n == 0:
        raise EOFError("peer closed the stream")
    return n


class Awaited(Protocol):
    """What a waiter reads the control stream for (a receive): done once it has arrived."""

    done: bool


class ControlSink(Protocol):
    """Where a :class:`ControlReader` hands the records it parses."""

    def ctrl_whole(self, rec: wire.CtrlRecord, payload: memoryview) -> None:
        """An INLINE record that arrived whole (``payload`` is only valid during the call)."""

    def ctrl_begin(self, rec: wire.CtrlRecord) -> memoryview:
        """Any other record: the buffer of ``rec.length`` bytes its payload goes into."""

    def ctrl_end(self) -> None:
        """The payload of the record begun last is all in its buffer."""


class ControlReader:
    """The receiving side of a control stream, read without blocking: the same parser at both
    ends of a connection (a worker's Connection, a reducer's Link).

    Reads go through a small staging buffer, so one ``recv`` usually brings a whole small
    record, often several.  An INLINE record staged whole goes to ``sink.ctrl_whole`` at once
    (no thread hop and no second buffer for a small message); any other record's payload fills
    the buffer ``sink.ctrl_begin`` returns, from the stage and then straight from the socket.
    """

    def __init__(self, sock: socket.socket, stage_bytes: int, max_inline: int):
        self.sock, self.max_inline = sock, max_inline
        self._stage = bytearray(stage_bytes)
        self._view = memoryview(self._stage)
        self._lo = self._hi = 0  # staged bytes not yet parsed
        self._target: memoryview | None = None  # the payload under way, if any
        self._filled = 0

    @property
    def staged(self) -> bool:
        """Whether bytes already read wait to be parsed."""
        return self._hi > self._lo

    def pump(self, sink: ControlSink, until: Awaited | None = None, wait: bool = False) -> bool:
        """Parse what the socket has; True if anything moved.  Returns once a read comes back
        short or finds nothing (the socket is empty: the caller polls for more), or, with
        ``until``, as soon as it is done and nothing read is left unparsed (a waiter needs no
        extra read just to learn that the socket is empty).

        ``wait`` (a blocking socket with a receive timeout): the first read sleeps until bytes
        come, at most that timeout — one system call where a poll and a read would be two."""
        sock, view = self.sock, self._view
        progressed = drained = False
        flags = 0 if wait else socket.MSG_DONTWAIT
        while True:
            target = self._target
            if target is None:
                lo, hi = self._lo, self._hi
                if hi - lo >= wire.CTRL_SIZE:
                    progressed = True
                    body = lo + wire.CTRL_SIZE
                    rec = wire.decode_ctrl(view[lo:body], self.max_inline)
                    end = body + rec.length
                    if end <= hi and rec.type is wire.RecordType.INLINE:
                        self._lo = end
                        sink.ctrl_whole(rec, view[body:end])
                    else:
                        self._lo = body
                        self._begin(sink, rec)
                    continue
                if until is not None and lo == hi and until.done:
                    return True
                if drained:
                    return progressed
                if lo:  # keep a partial header at the front
                    self._stage[:hi - lo] = self._stage[lo:hi]
                    self._lo, self._hi = 0, hi - lo
                room = len(view) - self._hi
                n = read_available(sock, view[self._hi:], flags)
                flags = socket.MSG_DONTWAIT
                if n is None:
                    return progressed
                self._hi += n
                progressed, drained = True, n < room
                continue
            want = len(target) - self._filled
            staged = self._hi - self._lo
            if staged:
                n = min(want, staged)
                target[self._filled:self._filled + n] = view[self._lo:self._lo + n]
                self._lo += n
            else:
                if drained:
                    return progressed
                n = read_available(sock, target[self._filled:], flags)
                flags = socket.MSG_DONTWAIT
                if n is None:
                    return progressed
                drained = n < want
            progressed = True
            self._filled += n
            if n == want:
                self._target = None
                sink.ctrl_end()

    def _begin(self, sink: ControlSink, rec: wire.CtrlRecord) -> None:
        target = sink.ctrl_begin(rec)
        if len(target):
            self._target, self._filled = target, 0
        else:
            sink.ctrl_end()


class StreamReader:
    """Exact reads from a blocking stream that wake the reading thread about once per read,
    not once per arriving segment.

    A thread in ``recv(MSG_WAITALL)`` is woken for every segment that lands (the kernel wakes
    readers once ``SO_RCVLOWAT`` bytes are queued: 1 by default) and copies piecemeal: at link
    speed, dozens of context switches per slice.  Here the reader sets ``SO_RCVLOWAT`` to the
    bytes it still needs and waits in ``poll``, which wakes once they are all queued, then
    copies them in one call.  (Not in a blocking ``recv``: after a partial copy the kernel
    compares what is queued with the whole low-water mark, so the rest of a message could
    never wake it.)  The kernel still wakes the reader early under memory pressure or when
    the receive window would close, so a read never waits on data the sender cannot send.
    """

    def __init__(self, sock: socket.socket, max_lowat: int):
        self.sock = sock
        self.max_lowat = max_lowat
        self._lowat = 1
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)

    def read_exact(self, view: memoryview) -> bool:
        """Fill ``view``.  False on a clean EOF before the first byte; an EOF later raises EOFError."""
        n = len(view)
        got = 0
        while got < n:
            try:
                k = read_available(self.sock, view[got:])
            except EOFError:
                if got == 0:
                    return False
                raise EOFError(f"peer closed the connection after {got} of {n} bytes") from None
            if k is None:
                want = min(n - got, self.max_lowat)
                if want != self._lowat:
                    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                    self._lowat = want
                self._poll.poll()
                continue
            got += k
        return True


def send_all(sock: socket.socket, parts: list, flags: int = 0) -> int:
    """``sendmsg`` until every part is out; returns the number of calls made."""
    calls = 0
    total = sum(len(p) for p in parts)
    sent = sock.sendmsg(parts, (), flags)
    calls += 1
    while sent < total:
        parts = advance_parts(parts, sent)
        total -= sent
        sent = sock.sendmsg(parts, (), flags)
        calls += 1
    return calls


def advance_parts(parts: list, n: int) -> list:
    """Drop the first ``n`` bytes of a list of buffers, without copying."""
    out = []
    for p in parts:
        if n >= len(p):
            n -= len(p)
            continue
        out.append(memoryview(p)[n:] if n else p)
        n = 0
    return out


def shutdown_quietly(sock: socket.socket) -> None:
    """Wake every thread blocked on ``sock`` (shutdown works across threads; close does not)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
