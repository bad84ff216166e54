"""The stream handshake over a socket (the byte layouts live in :mod:`redsock.wire`).

connecting side            listening side
  Hello  ------------------>   validate magic, version, fields
         <------------------  Challenge (its nonce, HMAC proving it knows the token)
  Proof  ------------------>   HMAC over both nonces: checked before anything is allocated
         <------------------  Verdict (OK, or why not)

Without a token the MACs are zeros and the same four records flow, so there is
one code path.  The secret never crosses the wire.
"""

from __future__ import annotations

import os
import socket

from .. import wire
from ..errors import AuthError, ProtocolError


class ClosedBeforeHello(ProtocolError):
    """The connecting side closed without sending a byte: a liveness probe or a port check
    (a rank waiting for a peer, a load balancer), not a failed handshake."""


def _read(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0 and what == "hello":
                raise ClosedBeforeHello("connection closed before its hello")
            raise ProtocolError(f"connection closed during the handshake (reading {what}, {got}/{n} bytes)")
        got += k
    return bytes(buf)


def client_handshake(sock: socket.socket, hello: wire.Hello, token: bytes | None, peer: str) -> wire.Challenge:
    """Run the connecting side; returns the listener's Challenge (for its inline threshold)."""
    sock.sendall(hello.encode())
    challenge = wire.decode_challenge(_read(sock, wire.CHALLENGE_SIZE, "challenge"))
    if token is not None:
        wire.check_mac(wire.handshake_mac(token, b"server", hello, challenge.nonce), challenge.mac,
                       f"listener {peer}")
    sock.sendall(wire.encode_proof(wire.handshake_mac(token, b"client", hello, challenge.nonce)))
    status = wire.decode_verdict(_read(sock, wire.VERDICT_SIZE, "verdict"))
    if status == wire.Status.BAD_AUTH:
        raise AuthError(f"{peer} refused the connection: shared-secret check failed (REDSOCK_TOKEN mismatch?)",
                        peer=peer, op="connect")
    if status != wire.Status.OK:
        raise ProtocolError(f"{peer} refused the connection: {status.name}", peer=peer, op="connect")
    return challenge


def server_handshake(sock: socket.socket, token: bytes | None, inline_bytes: int) -> wire.Hello:
    """Run the listening side up to (not including) the verdict; the caller sends it
    with :func:`send_verdict` once it knows whether the stream fits a connection."""
    try:
        hello = wire.decode_hello(_read(sock, wire.HELLO_SIZE, "hello"))
    except ProtocolError as e:
        if getattr(e, "status", None) == wire.Status.BAD_VERSION:
            # Answer in our version so the peer can report the mismatch clearly.
            sock.sendall(wire.Challenge(bytes(wire.NONCE_BYTES), bytes(wire.MAC_BYTES)).encode())
        raise
    nonce = os.urandom(wire.NONCE_BYTES)
    mac = wire.handshake_mac(token, b"server", hello, nonce)
    sock.sendall(wire.Challenge(nonce, mac, inline_bytes).encode())
    proof = wire.decode_proof(_read(sock, wire.PROOF_SIZE, "proof"))
    if token is not None:
        try:
            wire.check_mac(wire.handshake_mac(token, b"client", hello, nonce), proof, f"peer {hello.name!r}")
        except AuthError:
            send_verdict(sock, wire.Status.BAD_AUTH)
            raise
    return hello


def send_verdict(sock: socket.socket, status: wire.Status) -> None:
    try:
        sock.sendall(wire.encode_verdict(status))
    except OSError:
        if status == wire.Status.OK:
            raise
