"""Making connections: :func:`connect` on one side, :class:`Listener` on the other."""

from __future__ import annotations

import logging
import os
import queue
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import wire
from ..config import Config, check_port
from ..errors import ProtocolError, RedsockError, Timeout, TransportError
from .connection import Connection
from .handshake import ClosedBeforeHello, client_handshake, send_verdict, server_handshake
from .sockets import same_host, translate_oserror, tune

log = logging.getLogger("redsock.transport")

HANDSHAKE_TIMEOUT_S = 10.0  # a half-open or silent stream is dropped after this


def connect(address: tuple[str, int], *, config: Config | None = None, name: str = "",
            peer_name: str | None = None, retry_s: float = 0.0) -> Connection:
    """Open a connection (control stream + ``config.nsocks`` data streams) to a Listener.

    A Listener on this same host gets the same-host profile instead (``config.local_nsocks``
    streams, see :meth:`Config.for_peer`); both ends decide it from the control stream's addresses.

    ``retry_s``: keep retrying a refused connection this long (the peer may still be starting).
    Raises :class:`TransportError` (refused, unreachable, timed out) or
    :class:`~redsock.errors.ProtocolError`/:class:`~redsock.errors.AuthError` (handshake refused).
    """
    config = config or Config.from_env()
    host, port = address
    peer = peer_name or f"{host}:{port}"
    deadline = time.monotonic() + retry_s
    delay = 0.01
    while True:
        try:
            return _connect_once(host, port, config, name, peer)
        except TransportError as e:
            refused = isinstance(e.__cause__, (ConnectionRefusedError, ConnectionResetError))
            if not refused or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _connect_once(host: str, port: int, config: Config, name: str, peer: str) -> Connection:
    conn_id = random.getrandbits(64)
    socks: list[socket.socket] = []
    timeout = min(config.timeout_s, HANDSHAKE_TIMEOUT_S)
    source = (config.bind_addr, 0) if config.bind_addr else None
    try:
        inline = config.inline_bytes
        i = 0
        while i <= config.nsocks:
            kind = wire.StreamKind.CONTROL if i == 0 else wire.StreamKind.DATA
            s = socket.create_connection((host, port), timeout=timeout, source_address=source)
            socks.append(s)
            if i == 0:  # the control stream tells whether the peer is on this host
                config = config.for_peer(same_host(s))
            tune(s, config, data=i > 0)
            hello = wire.Hello(kind, max(0, i - 1), config.nsocks, conn_id, os.urandom(wire.NONCE_BYTES),
                               name, config.inline_bytes)
            challenge = client_handshake(s, hello, config.token, peer)
            if i == 0:
                inline = min(inline, challenge.inline_bytes)
            i += 1
        for s in socks:
            s.settimeout(None)  # data threads block; deadlines are enforced by waiters
        return Connection(socks[0], socks[1:], peer=peer, config=config, inline_bytes=inline)
    except BaseException as e:
        for s in socks:
            s.close()
        if isinstance(e, RedsockError):
            raise
        if isinstance(e, OSError):
            raise translate_oserror(e, peer, "connect") from e
        raise


@dataclass
class _Pending:
    """A control stream whose data streams are still arriving."""

    hello: wire.Hello
    ctrl: socket.socket
    addr: str
    data: list[socket.socket | None]
    complete: threading.Event = field(default_factory=threading.Event)


class Listener:
    """Accepts connections.  Either call :meth:`accept` or pass ``on_connection``.

    Bad handshakes (garbage, wrong version, wrong token) are logged once and
    dropped; the listener keeps serving.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, config: Config | None = None,
                 on_connection: Callable[[Connection], None] | None = None, backlog: int = 1024,
                 connection_factory: Callable[..., Any] = Connection):
        self.config = config or Config.from_env()
        # What serves an established connection's sockets (the reduction server's event loops
        # take the raw sockets instead of a threaded Connection).
        self._connection_factory = connection_factory
        check_port(host, port, "listen")
        try:
            self._sock = socket.create_server((host, port), backlog=backlog)
        except OSError as e:
            raise translate_oserror(e, f"{host}:{port}", "listen") from e
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._on_connection = on_connection
        self._ready: queue.Queue[Connection] = queue.Queue()
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.rejected = 0  # streams refused (bad handshakes), for tests and metrics
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"redsock-listen-{self.address[1]}")
        self._thread.start()

    def accept(self, timeout: float | None = None) -> Connection:
        """The next fully established connection; :class:`Timeout` after ``timeout`` s."""
        try:
            return self._ready.get(timeout=self.config.timeout_s if timeout is None else timeout)
        except queue.Empty:
            raise Timeout(f"no connection arrived at {self.address[0]}:{self.address[1]} in time",
                          op="accept") from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._sock.close()
        with self._lock:
            for p in self._pending.values():
                for s in [p.ctrl, *p.data]:
                    if s is not None:
                        s.close()
            self._pending.clear()
        while not self._ready.empty():
            self._ready.get_nowait().close()

    def __enter__(self) -> "Listener":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # e.g. EMFILE: back off rather than spin
                continue
            threading.Thread(target=self._handshake, args=(sock, f"{addr[0]}:{addr[1]}"),
                             daemon=True, name="redsock-handshake").start()

    def _handshake(self, sock: socket.socket, addr: str) -> None:
        timeout = min(self.config.timeout_s, HANDSHAKE_TIMEOUT_S)
        sock.settimeout(timeout)
        try:
            hello = server_handshake(sock, self.config.token, self.config.inline_bytes)
            if hello.kind == wire.StreamKind.CONTROL:
                self._add_control(sock, hello, addr, timeout)
            else:
                self._add_data(sock, hello, addr)
        except ClosedBeforeHello:
            log.debug("%s connected and closed (a probe)", addr)
            sock.close()
        except (OSError, RedsockError) as e:
            self.rejected += 1
            why = e if isinstance(e, RedsockError) else translate_oserror(e, addr, "handshake")
            log.warning("refused a stream from %s: %s", addr, why)
            sock.close()

    def _add_control(self, sock: socket.socket, hello: wire.Hello, addr: str, timeout: float) -> None:
        p = _Pending(hello, sock, addr, [None] * hello.nstreams)
        with self._lock:
            if hello.conn_id in self._pending:
                raise ProtocolError(f"duplicate connection id from {addr}")
            self._pending[hello.conn_id] = p
        send_verdict(sock, wire.Status.OK)
        if p.complete.wait(timeout):
            return
        with self._lock:  # its data streams never all came: drop what did
            if self._pending.pop(hello.conn_id, None) is None:
                return
        for s in p.data:
            if s is not None:
                s.close()
        raise ProtocolError(f"{hello.name or addr} opened a control stream but not its {hello.nstreams} data streams")

    def _add_data(self, sock: socket.socket, hello: wire.Hello, addr: str) -> None:
        with self._lock:
            p = self._pending.get(hello.conn_id)
            ok = (p is not None and p.hello.nstreams == hello.nstreams and p.data[hello.index] is None
                  and p.addr.rsplit(":", 1)[0] == addr.rsplit(":", 1)[0])
            if ok:
                p.data[hello.index] = sock
                done = all(s is not None for s in p.data)
                if done:
                    del self._pending[hello.conn_id]
        if not ok:
            send_verdict(sock, wire.Status.UNKNOWN_CONNECTION)
            raise ProtocolError(f"data stream for unknown connection {hello.conn_id:#x}")
        send_verdict(sock, wire.Status.OK)
        if not done:
            return
        config = self.config.for_peer(same_host(p.ctrl), nstreams=len(p.data))
        for s in [p.ctrl, *p.data]:
            s.settimeout(None)
            tune(s, config, data=s is not p.ctrl)
        inline = min(config.inline_bytes, p.hello.inline_bytes)
        peer = f"{p.hello.name}@{p.addr}" if p.hello.name else p.addr
        conn = self._connection_factory(p.ctrl, p.data, peer=peer, config=config, inline_bytes=inline)
        p.complete.set()
        if self._closed:
            conn.close()
        elif self._on_connection is not None:
            self._on_connection(conn)
        else:
            self._ready.put(conn)
