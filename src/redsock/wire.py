"""The redsock wire format: fixed-layout records, encoded and decoded with no I/O.

Every stream starts with a handshake (:class:`Hello` from the connecting side,
:class:`Challenge` back, :class:`Proof` forward, :class:`Verdict` back).  Then:

* the **control stream** carries :data:`CTRL` records (24 bytes): ``INLINE``
  messages with their payload right behind the header, and ``ABORT`` notices;
* each **data stream** carries :data:`SLICE` records (40 bytes), each followed
  by ``length`` payload bytes that belong at ``offset`` of message
  ``(tag, seq)`` of ``total`` bytes.  Slices are self-describing, so they may
  arrive on any stream in any order.

Messages are matched by ``(tag, seq)``: ``seq`` counts the messages sent with
that tag on the connection, on both sides, so no ordering between streams is
needed.  Decoders validate every field before it is used and raise
:class:`~redsock.errors.ProtocolError`; nothing here allocates more than the
fixed header sizes.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from .errors import AuthError, ProtocolError

MAGIC = b"RSCK"
VERSION = 2  # 2: the reducer's Announce carries the worker's timeout
NONCE_BYTES = 16
MAC_BYTES = 32
NAME_BYTES = 32
MAX_NSTREAMS = 16
MAX_INLINE = 1 << 20


class StreamKind(IntEnum):
    CONTROL = 0
    DATA = 1


class Status(IntEnum):
    """Why a listener refused a stream (sent in :class:`Verdict`)."""

    OK = 0
    BAD_VERSION = 1
    BAD_AUTH = 2
    UNKNOWN_CONNECTION = 3
    BAD_REQUEST = 4


class RecordType(IntEnum):
    INLINE = 1
    ABORT = 2
    SLICE = 16
    PING = 17  # "are you alive?", answered by the peer's receive thread (even while its app is blocked)
    PONG = 18


# --- handshake ---------------------------------------------------------------

_HELLO = struct.Struct(f"<4sHBBHHQ{NONCE_BYTES}s{NAME_BYTES}sI")
_CHALLENGE = struct.Struct(f"<4sHBx{NONCE_BYTES}s{MAC_BYTES}sI")
_PROOF = struct.Struct(f"<4s{MAC_BYTES}s")
_VERDICT = struct.Struct("<4sBxH")
HELLO_SIZE = _HELLO.size
CHALLENGE_SIZE = _CHALLENGE.size
PROOF_SIZE = _PROOF.size
VERDICT_SIZE = _VERDICT.size


@dataclass(frozen=True)
class Hello:
    """First bytes of every stream, from the connecting side."""

    kind: StreamKind
    index: int  # data stream index (0 for the control stream)
    nstreams: int  # data streams of this connection
    conn_id: int  # random; groups a connection's streams at the listener
    nonce: bytes
    name: str  # who is connecting, for error messages ("rank 3")
    inline_bytes: int = 0  # largest inline message this side sends; the connection uses the smaller
    version: int = VERSION

    def encode(self) -> bytes:
        name = self.name.encode()[:NAME_BYTES]
        return _HELLO.pack(MAGIC, self.version, self.kind, 0, self.index, self.nstreams,
                           self.conn_id, self.nonce, name, self.inline_bytes)


def decode_hello(data: bytes) -> Hello:
    """Validate and decode a :class:`Hello`.  A wrong version raises with ``.status``."""
    if len(data) != HELLO_SIZE:
        raise ProtocolError(f"hello is {len(data)} bytes, expected {HELLO_SIZE}")
    magic, version, kind, _flags, index, nstreams, conn_id, nonce, name, inline = _HELLO.unpack(data)
    if magic != MAGIC:
        raise _refusal(f"not a redsock peer (magic {magic!r})", Status.BAD_REQUEST)
    if version != VERSION:
        raise _refusal(f"protocol version {version}, this side speaks {VERSION}", Status.BAD_VERSION)
    if kind not in (StreamKind.CONTROL, StreamKind.DATA):
        raise _refusal(f"unknown stream kind {kind}", Status.BAD_REQUEST)
    if not 1 <= nstreams <= MAX_NSTREAMS:
        raise _refusal(f"{nstreams} data streams (allowed 1..{MAX_NSTREAMS})", Status.BAD_REQUEST)
    if kind == StreamKind.DATA and index >= nstreams:
        raise _refusal(f"data stream index {index} of {nstreams}", Status.BAD_REQUEST)
    try:
        text = name.rstrip(b"\0").decode()
    except UnicodeDecodeError:
        raise _refusal("peer name is not UTF-8", Status.BAD_REQUEST) from None
    if inline > MAX_INLINE:
        raise _refusal(f"inline threshold {inline} above {MAX_INLINE}", Status.BAD_REQUEST)
    return Hello(StreamKind(kind), index, nstreams, conn_id, nonce, text, inline, version)


@dataclass(frozen=True)
class Challenge:
    """Listener's answer to a Hello: its nonce and its proof of the shared secret."""

    nonce: bytes
    mac: bytes
    inline_bytes: int = 0
    version: int = VERSION

    def encode(self) -> bytes:
        return _CHALLENGE.pack(MAGIC, self.version, 0, self.nonce, self.mac, self.inline_bytes)


def decode_challenge(data: bytes) -> Challenge:
    if len(data) != CHALLENGE_SIZE:
        raise ProtocolError(f"challenge is {len(data)} bytes, expected {CHALLENGE_SIZE}")
    magic, version, _flags, nonce, mac, inline = _CHALLENGE.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"not a redsock listener (magic {magic!r})")
    if version != VERSION:
        raise ProtocolError(f"listener speaks protocol version {version}, this side {VERSION}")
    if inline > MAX_INLINE:
        raise ProtocolError(f"listener's inline threshold {inline} above {MAX_INLINE}")
    return Challenge(nonce, mac, inline, version)


def encode_proof(mac: bytes) -> bytes:
    return _PROOF.pack(MAGIC, mac)


def decode_proof(data: bytes) -> bytes:
    if len(data) != PROOF_SIZE:
        raise ProtocolError(f"proof is {len(data)} bytes, expected {PROOF_SIZE}")
    magic, mac = _PROOF.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad proof record (magic {magic!r})")
    return mac


def encode_verdict(status: Status) -> bytes:
    return _VERDICT.pack(MAGIC, status, 0)


def decode_verdict(data: bytes) -> Status:
    if len(data) != VERDICT_SIZE:
        raise ProtocolError(f"verdict is {len(data)} bytes, expected {VERDICT_SIZE}")
    magic, status, _r = _VERDICT.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad verdict record (magic {magic!r})")
    try:
        return Status(status)
    except ValueError:
        raise ProtocolError(f"unknown verdict status {status}") from None


def handshake_mac(token: bytes | None, role: bytes, hello: Hello, server_nonce: bytes) -> bytes:
    """HMAC-SHA256 over both nonces and the stream identity; zeros when no token is set.

    ``role`` differs per direction so a proof cannot be reflected back.
    """
    if token is None:
        return bytes(MAC_BYTES)
    msg = role + hello.encode() + server_nonce
    return hmac.new(token, msg, hashlib.sha256).digest()


def check_mac(expected: bytes, got: bytes, who: str) -> None:
    if not hmac.compare_digest(expected, got):
        raise AuthError(f"{who} failed the shared-secret check (REDSOCK_TOKEN mismatch?)")


def _refusal(msg: str, status: Status) -> ProtocolError:
    err = ProtocolError(msg)
    err.status = status  # type: ignore[attr-defined]
    return err


# --- records -----------------------------------------------------------------

CTRL = struct.Struct("<BBHIQQ")  # type, flags, check, length, tag, seq
SLICE = struct.Struct("<BBHIQQQQ")  # type, flags, check, length, tag, seq, total, offset
CTRL_SIZE = CTRL.size
SLICE_SIZE = SLICE.size
_RECORD_TYPES = {t.value: t for t in RecordType}  # a dict lookup: RecordType(v) costs more


# Records are named tuples, not dataclasses: one is decoded per message, and a tuple
# is built several times faster (a small all-reduce's whole budget is tens of us).
class CtrlRecord(NamedTuple):
    type: RecordType
    length: int
    tag: int
    seq: int
    check: int = 0  # 16 bits the sender and receiver must agree on (collective signature)


class SliceRecord(NamedTuple):
    length: int
    tag: int
    seq: int
    total: int
    offset: int
    check: int = 0
    type: RecordType = RecordType.SLICE


def encode_inline(tag: int, seq: int, length: int, check: int = 0) -> bytes:
    return CTRL.pack(RecordType.INLINE, 0, check, length, tag, seq)


def encode_abort(reason: str) -> bytes:
    text = reason.encode()[:4096]
    return CTRL.pack(RecordType.ABORT, 0, 0, len(text), 0, 0) + text


_FAILED_RANKS = re.compile(r"\[failed ranks: ([0-9, ]*)\]")


def failed_ranks_reason(ranks: Iterable[int], why: str) -> str:
    """An abort reason that names the ranks its sender found failed (a reducer, or a rank
    giving up), so that every rank that hears of the failure names the same ones."""
    return f"[failed ranks: {', '.join(map(str, ranks))}] {why}"


def failed_ranks_in(reason: str) -> tuple[int, ...] | None:
    """The ranks a :func:`failed_ranks_reason` names (anywhere in ``reason``, which may have
    been wrapped in other messages since), or None if it names none."""
    m = _FAILED_RANKS.search(reason)
    ranks = tuple(sorted({int(v) for v in m.group(1).split(",") if v.strip()})) if m else ()
    return ranks or None


_FAILED_JOB_RANKS = re.compile(r"\[failed job ranks: ([0-9, ]*)\]")


def failed_job_ranks_reason(ranks: Iterable[int], why: str) -> str:
    """A reducer's own diagnosis: the ranks of the job (numbered as the job's announces number
    them, which for a hierarchical job's inter-host group is not the world's numbering) that it
    found missing.  A worker turns it into a :func:`failed_ranks_reason` in world ranks."""
    return f"[failed job ranks: {', '.join(map(str, ranks))}] {why}"


def failed_job_ranks_in(reason: str) -> tuple[int, ...] | None:
    """The ranks a :func:`failed_job_ranks_reason` names (anywhere in ``reason``), or None."""
    m = _FAILED_JOB_RANKS.search(reason)
    ranks = tuple(sorted({int(v) for v in m.group(1).split(",") if v.strip()})) if m else ()
    return ranks or None


_FAILED_REDUCER = re.compile(r"\[failed reducer: ([^\]\s]+)\]")


def failed_reducer_reason(address: str, why: str) -> str:
    """An abort reason that names the reducer its sender found failed, so that a worker that
    hears of it through another reducer names that one, not the messenger."""
    return f"[failed reducer: {address}] {why}"


def failed_reducer_in(reason: str) -> str | None:
    """The reducer a :func:`failed_reducer_reason` names (anywhere in ``reason``), or None."""
    m = _FAILED_REDUCER.search(reason)
    return m.group(1) if m else None


def decode_ctrl(data: bytes | memoryview, max_inline: int) -> CtrlRecord:
    if len(data) != CTRL_SIZE:
        raise ProtocolError(f"control record is {len(data)} bytes, expected {CTRL_SIZE}")
    typ, _flags, check, length, tag, seq = CTRL.unpack(data)
    if typ == RecordType.INLINE:
        if length > max_inline:
            raise ProtocolError(f"inline message of {length} bytes exceeds the limit {max_inline}")
    elif typ == RecordType.ABORT:
        if length > 4096:
            raise ProtocolError(f"abort reason of {length} bytes")
    else:
        raise ProtocolError(f"unknown control record type {typ}")
    return CtrlRecord(_RECORD_TYPES[typ], length, tag, seq, check)


def encode_slice(tag: int, seq: int, total: int, offset: int, length: int, check: int = 0) -> bytes:
    return SLICE.pack(RecordType.SLICE, 0, check, length, tag, seq, total, offset)


def encode_probe(kind: RecordType, nonce: int) -> bytes:
    """A PING or PONG on a data stream; ``nonce`` (in the tag field) pairs them."""
    return SLICE.pack(kind, 0, 0, 0, nonce, 0, 0, 0)


def decode_slice(data: bytes | memoryview, max_message: int) -> SliceRecord:
    if len(data) != SLICE_SIZE:
        raise ProtocolError(f"slice record is {len(data)} bytes, expected {SLICE_SIZE}")
    typ, _flags, check, length, tag, seq, total, offset = SLICE.unpack(data)
    if typ in (RecordType.PING, RecordType.PONG):
        if length or total or offset:
            raise ProtocolError(f"liveness probe with a payload ({length} bytes)")
        return SliceRecord(0, tag, seq, 0, 0, 0, _RECORD_TYPES[typ])
    if typ != RecordType.SLICE:
        raise ProtocolError(f"expected a slice record, got type {typ}")
    if total > max_message:
        raise ProtocolError(f"message of {total} bytes exceeds the limit {max_message}")
    if length == 0 or offset + length > total:
        raise ProtocolError(f"slice [{offset}, {offset + length}) outside a message of {total} bytes")
    return SliceRecord(length, tag, seq, total, offset, check)


# --- reduction-server protocol -------------------------------------------------
#
# A worker opens one Fast Socket connection to each reduction server.  Per
# all-reduce it sends, on tag ANNOUNCE_TAG, one Announce describing the call;
# then each of its pieces for that server on tag piece_tag(op_seq, piece); the
# server answers each piece with the reduced piece on the same tag.  When the
# call has exactly one piece for a server and it fits inline, its bytes follow
# the Announce in the same message (a small all-reduce is one record each way).

ANNOUNCE_TAG = 1
PIECE_BITS = 24
MAX_PIECES = (1 << PIECE_BITS) - 1
MAX_WORLD = 1 << 14
_ANNOUNCE = struct.Struct("<4sQQBBHHHQQHHI")
ANNOUNCE_SIZE = _ANNOUNCE.size
FLAG_DETERMINISTIC = 1
KNOWN_FLAGS = FLAG_DETERMINISTIC


class Announce(NamedTuple):
    """One all-reduce as one server sees it: which job, call, dtype, op and pieces."""

    job: int
    op_seq: int
    dtype_code: int
    op_code: int
    world: int
    rank: int
    flags: int
    count: int  # elements in the whole buffer
    piece_elems: int  # elements per piece (the last may be shorter)
    nservers: int
    server_index: int  # this server owns pieces i with i % nservers == server_index
    # The worker's no-progress timeout (REDSOCK_TIMEOUT_S) in ms: the reducer gives up on the
    # round by then, so that a worker's wait and the reducer's deadline are one deadline.
    timeout_ms: int

    def encode(self) -> bytes:
        return encode_announce(*self)

    @property
    def npieces(self) -> int:
        return -(-self.count // self.piece_elems) if self.count else 0

    def my_pieces(self) -> range:
        return range(self.server_index, self.npieces, self.nservers)

    def piece_range(self, piece: int) -> tuple[int, int]:
        lo = piece * self.piece_elems
        return lo, min(self.count, lo + self.piece_elems)


def encode_announce(job: int, op_seq: int, dtype_code: int, op_code: int, world: int, rank: int, flags: int,
                    count: int, piece_elems: int, nservers: int, server_index: int, timeout_ms: int) -> bytes:
    """:meth:`Announce.encode` without building the Announce (a small call's hot path)."""
    return _ANNOUNCE.pack(MAGIC, job, op_seq, dtype_code, op_code, world, rank, flags, count, piece_elems,
                          nservers, server_index, timeout_ms)


def timeout_ms(timeout_s: float) -> int:
    """A timeout as an Announce carries it (whole ms, at least 1, at most ~49 days)."""
    return max(1, min(MAX_TIMEOUT_MS, round(timeout_s * 1000)))


MAX_TIMEOUT_MS = (1 << 32) - 1


def decode_announce(data: bytes | memoryview, *, max_elements: int, valid_dtype, valid_op) -> Announce:
    """Validate every field; ``valid_dtype``/``valid_op`` raise on unknown codes."""
    if len(data) != ANNOUNCE_SIZE:
        raise ProtocolError(f"announce is {len(data)} bytes, expected {ANNOUNCE_SIZE}")
    magic, job, op_seq, dt, op, world, rank, flags, count, piece, nservers, index, timeout = _ANNOUNCE.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad announce record (magic {magic!r})")
    valid_dtype(dt)
    valid_op(op)
    if not 1 <= world <= MAX_WORLD or rank >= world:
        raise ProtocolError(f"rank {rank} of world {world} is out of range")
    if count > max_elements or piece == 0 or (count and -(-count // piece) > MAX_PIECES):
        raise ProtocolError(f"{count} elements in pieces of {piece} is out of range")
    if not 1 <= nservers <= 4096 or index >= nservers:
        raise ProtocolError(f"server index {index} of {nservers}")
    if flags & ~KNOWN_FLAGS:  # a newer worker's option this reducer would silently ignore
        raise ProtocolError(f"announce flags {flags:#x}: unknown bits {flags & ~KNOWN_FLAGS:#x}")
    if op_seq >= (1 << (64 - PIECE_BITS)) - 1:
        raise ProtocolError(f"operation number {op_seq} out of range")
    if timeout == 0:
        raise ProtocolError("announce with a zero timeout")
    return Announce(job, op_seq, dt, op, world, rank, flags, count, piece, nservers, index, timeout)


def piece_tag(op_seq: int, piece: int) -> int:
    return ((op_seq + 1) << PIECE_BITS) | piece  # +1: never collides with ANNOUNCE_TAG
