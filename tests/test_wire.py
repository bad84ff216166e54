"""The wire format, byte by byte, with no sockets."""

import struct

import pytest

from redsock import ops, wire
from redsock.errors import AuthError, ProtocolError


def hello(**kw):
    base = dict(kind=wire.StreamKind.DATA, index=2, nstreams=4, conn_id=0x1122334455667788,
                nonce=bytes(range(16)), name="rank 3", inline_bytes=65536)
    base.update(kw)
    return wire.Hello(**base)


def test_hello_layout_is_fixed_and_little_endian():
    b = hello().encode()
    assert len(b) == wire.HELLO_SIZE == 72
    assert b[:4] == b"RSCK"
    assert struct.unpack_from("<H", b, 4)[0] == wire.VERSION
    assert b[6] == wire.StreamKind.DATA
    assert struct.unpack_from("<HHQ", b, 8) == (2, 4, 0x1122334455667788)
    assert b[20:36] == bytes(range(16))
    assert b[36:42] == b"rank 3" and b[42:68] == bytes(26)
    assert struct.unpack_from("<I", b, 68)[0] == 65536


def test_hello_round_trip():
    h = hello()
    assert wire.decode_hello(h.encode()) == h


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b"XXXX" + b[4:], "not a redsock peer"),
    (lambda b: b[:4] + struct.pack("<H", 99) + b[6:], "protocol version 99"),
    (lambda b: b[:6] + b"\x07" + b[7:], "unknown stream kind"),
    (lambda b: b[:10] + struct.pack("<H", 0) + b[12:], "data streams"),
    (lambda b: b[:10] + struct.pack("<H", 17) + b[12:], "data streams"),
    (lambda b: b[:8] + struct.pack("<H", 4) + b[10:], "index 4 of 4"),
    (lambda b: b[:36] + b"\xff\xfe" + b[38:], "UTF-8"),
    (lambda b: b[:68] + struct.pack("<I", (1 << 20) + 1), "inline threshold"),
    (lambda b: b[:-1], "expected 72"),
])
def test_hello_rejects(mutate, message):
    with pytest.raises(ProtocolError, match=message):
        wire.decode_hello(mutate(hello().encode()))


def test_wrong_version_carries_status():
    b = hello(version=wire.VERSION + 1).encode()
    with pytest.raises(ProtocolError) as e:
        wire.decode_hello(b)
    assert e.value.status == wire.Status.BAD_VERSION


def test_challenge_proof_verdict_round_trip():
    c = wire.Challenge(bytes(16), bytes(range(32)), 4096)
    assert len(c.encode()) == wire.CHALLENGE_SIZE
    assert wire.decode_challenge(c.encode()) == c
    assert wire.decode_proof(wire.encode_proof(b"m" * 32)) == b"m" * 32
    for s in wire.Status:
        assert wire.decode_verdict(wire.encode_verdict(s)) == s
    with pytest.raises(ProtocolError, match="unknown verdict"):
        wire.decode_verdict(b"RSCK\x09\x00\x00\x00")
    with pytest.raises(ProtocolError):
        wire.decode_challenge(b"RSCX" + c.encode()[4:])


def test_mac_is_zero_without_token_and_role_bound_with_one():
    h = hello()
    assert wire.handshake_mac(None, b"server", h, bytes(16)) == bytes(32)
    a = wire.handshake_mac(b"secret", b"server", h, bytes(16))
    b = wire.handshake_mac(b"secret", b"client", h, bytes(16))
    assert a != b and len(a) == 32  # a proof cannot be reflected back
    assert wire.handshake_mac(b"other", b"server", h, bytes(16)) != a
    wire.check_mac(a, a, "x")
    with pytest.raises(AuthError):
        wire.check_mac(a, b, "x")


def test_ctrl_record_layout():
    b = wire.encode_inline(tag=7, seq=3, length=8)
    assert len(b) == wire.CTRL_SIZE == 24
    assert b == struct.pack("<BBHIQQ", 1, 0, 0, 8, 7, 3)
    rec = wire.decode_ctrl(b, max_inline=8)
    assert (rec.type, rec.length, rec.tag, rec.seq) == (wire.RecordType.INLINE, 8, 7, 3)
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.decode_ctrl(b, max_inline=7)
    with pytest.raises(ProtocolError, match="unknown control record"):
        wire.decode_ctrl(b"\x09" + b[1:], 8)
    a = wire.encode_abort("boom")
    assert wire.decode_ctrl(a[:24], 0).type == wire.RecordType.ABORT and a[24:] == b"boom"


def test_an_abort_reason_names_failed_ranks_through_any_wrapping():
    reason = wire.failed_ranks_reason([3, 1], "reduction server: all-reduce #7 got nothing from rank(s) 1, 3")
    assert reason.startswith("[failed ranks: 3, 1] reduction server:")
    wrapped = f"rank 2: all_reduce #7 failed: peer 198.18.0.101:7700 aborted the connection: {reason}"
    assert wire.failed_ranks_in(wrapped) == (1, 3)
    assert wire.failed_ranks_in(wire.encode_abort(reason)[wire.CTRL_SIZE:].decode()) == (1, 3)
    # No ranks named, or no such note: None (the failure is the sender's own).
    assert wire.failed_ranks_in(wire.failed_ranks_reason([], "gives up")) is None
    assert wire.failed_ranks_in("reduction server 198.18.0.101:7700 failed: connection reset") is None


def test_a_reducers_own_diagnosis_names_ranks_of_its_job_not_of_the_world():
    """A reducer numbers ranks as its job does (a hierarchical job's inter-host group: one rank
    per host), workers as the world does: the two notes never read as each other."""
    own = wire.failed_job_ranks_reason([1], "reduction server: all-reduce #30 got nothing from rank(s) 1")
    assert own.startswith("[failed job ranks: 1] reduction server:")
    wrapped = f"reduction server 198.18.0.101:7700 aborted the connection: {own}"
    assert wire.failed_job_ranks_in(wrapped) == (1,) and wire.failed_ranks_in(wrapped) is None
    told = wire.failed_ranks_reason([2], "reduction server: worker rank 0 gave up")
    assert wire.failed_job_ranks_in(told) is None and wire.failed_ranks_in(told) == (2,)
    assert wire.failed_job_ranks_in(wire.failed_job_ranks_reason([], "x")) is None


def test_slice_record_layout_and_bounds():
    b = wire.encode_slice(tag=1, seq=2, total=100, offset=60, length=40)
    assert len(b) == wire.SLICE_SIZE == 40
    assert b == struct.pack("<BBHIQQQQ", 16, 0, 0, 40, 1, 2, 100, 60)
    rec = wire.decode_slice(b, max_message=100)
    assert (rec.length, rec.tag, rec.seq, rec.total, rec.offset) == (40, 1, 2, 100, 60)
    with pytest.raises(ProtocolError, match="outside"):
        wire.decode_slice(wire.encode_slice(1, 2, 100, 61, 40), 100)
    with pytest.raises(ProtocolError, match="outside"):
        wire.decode_slice(wire.encode_slice(1, 2, 100, 0, 0), 100)
    with pytest.raises(ProtocolError, match="limit"):
        wire.decode_slice(b, max_message=99)
    with pytest.raises(ProtocolError, match="expected a slice"):
        wire.decode_slice(b"\x01" + b[1:], 100)


def test_announce_round_trips_and_unknown_flag_bits_are_refused():
    def decode(b):
        return wire.decode_announce(b, max_elements=1 << 30, valid_dtype=ops.dtype_from_code,
                                    valid_op=ops.ReduceOp.from_code)

    ann = wire.Announce(job=7, op_seq=3, dtype_code=1, op_code=1, world=4, rank=1, flags=wire.FLAG_DETERMINISTIC,
                        count=1000, piece_elems=64, nservers=3, server_index=2, timeout_ms=1500)
    assert decode(ann.encode()) == ann
    with pytest.raises(ProtocolError, match="unknown bits 0x4"):
        decode(ann._replace(flags=4 | wire.FLAG_DETERMINISTIC).encode())
    with pytest.raises(ProtocolError, match="zero timeout"):
        decode(ann._replace(timeout_ms=0).encode())
    assert wire.timeout_ms(0.0001) == 1 and wire.timeout_ms(15) == 15000 and wire.timeout_ms(1e12) == wire.MAX_TIMEOUT_MS


def test_failure_reasons_name_ranks_or_a_reducer_through_any_wrapping():
    inner = wire.failed_reducer_reason("198.18.0.101:7700", "rank 0 gives up all-reduce #3: timeout")
    relayed = wire.failed_ranks_reason((), f"reduction server: worker rank 0 gave up (peer aborted: {inner})")
    outer = f"reduction server 198.18.0.102:7700 aborted the connection: {relayed}"
    assert wire.failed_ranks_in(outer) is None  # names no rank: nobody is to blame but the reducer
    assert wire.failed_reducer_in(outer) == "198.18.0.101:7700"
    assert wire.failed_reducer_in("recv with reduction server 198.18.0.101:7700: timeout") is None
    assert wire.failed_ranks_in(wire.failed_ranks_reason([3, 1, 3], "x")) == (1, 3)
