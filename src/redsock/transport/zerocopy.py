"""``MSG_ZEROCOPY`` sends: the kernel pins the user pages instead of copying them,
and reports on the socket's error queue when it has released them.  A send is
complete only after that report, because until then the caller's buffer is
still being read by the kernel.

Each ``sendmsg`` call with ``MSG_ZEROCOPY`` gets the next number of a per-socket
counter; completions arrive as inclusive ranges ``[ee_info, ee_data]`` of those
numbers in a ``sock_extended_err`` control message.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable

from .sockets import MSG_ZEROCOPY, SO_ZEROCOPY, advance_parts

log = logging.getLogger("redsock.transport")

SO_EE_ORIGIN_ZEROCOPY = 5
SO_EE_CODE_ZEROCOPY_COPIED = 1
IP_RECVERR = 11
IPV6_RECVERR = 25
_EXTENDED_ERR = struct.Struct("=IBBBBII")  # ee_errno, origin, type, code, pad, info, data

_disabled = threading.Event()  # set once for the whole process on an unexpected error


def disable(reason: str) -> None:
    if not _disabled.is_set():
        _disabled.set()
        log.warning("MSG_ZEROCOPY switched off for this process: %s; using copying sends", reason)


def available() -> bool:
    return not _disabled.is_set()


class ZeroCopySender:
    """Zero-copy sends on one socket, with completion callbacks run on release."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
        self._next = 0  # number the kernel gives the next zero-copy sendmsg
        # (last number, callback, buffers): the buffers stay referenced until the kernel releases
        # them, or Python could reuse a freed header's memory while the kernel still reads it.
        self._pending: deque[tuple[int, Callable[[], None], list]] = deque()
        self._released = -1
        self.copied = 0  # completions where the kernel fell back to copying (e.g. loopback)
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLERR)

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    def send(self, parts: list, on_release: Callable[[], None]) -> None:
        keep = parts
        total = sum(len(p) for p in parts)
        sent = 0
        while True:
            n = self.sock.sendmsg(parts, (), MSG_ZEROCOPY)
            self._next += 1
            sent += n
            if sent >= total:
                break
            parts = advance_parts(parts, n)
        self._pending.append((self._next - 1, on_release, keep))
        self.reap(0)

    def reap(self, timeout_s: float) -> None:
        """Run callbacks of sends the kernel has released; wait up to ``timeout_s`` for one."""
        if not self._pending:
            return
        if timeout_s > 0 and not self._poller.poll(int(timeout_s * 1000)):
            return
        while True:
            try:
                _, ancdata, _, _ = self.sock.recvmsg(0, socket.CMSG_SPACE(_EXTENDED_ERR.size + 16),
                                                     socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            for level, typ, data in ancdata:
                if (level, typ) not in ((socket.IPPROTO_IP, IP_RECVERR), (socket.IPPROTO_IPV6, IPV6_RECVERR)):
                    continue
                errno_, origin, _t, code, _p, lo, hi = _EXTENDED_ERR.unpack_from(data)
                if origin != SO_EE_ORIGIN_ZEROCOPY or errno_ != 0:
                    disable(f"unexpected error-queue report (errno {errno_}, origin {origin})")
                    continue
                if code & SO_EE_CODE_ZEROCOPY_COPIED:
                    self.copied += hi - lo + 1
                self._released = max(self._released, hi)
        while self._pending and self._pending[0][0] <= self._released:
            self._pending.popleft()[1]()
