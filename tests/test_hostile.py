"""Hostile input: fuzzed decoders, and a live reducer under attack while a real job runs beside it."""

import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redsock import ops, wire
from redsock.config import Config
from redsock.errors import AuthError, ProtocolError, RedsockError
from redsock.server import ReductionServer
from redsock.transport import connect
from test_collectives import run_world

# -- fuzzing the pure decoders: only redsock's own errors, whatever the bytes ------------

DECODERS = [
    (wire.HELLO_SIZE, wire.decode_hello),
    (wire.CHALLENGE_SIZE, wire.decode_challenge),
    (wire.PROOF_SIZE, wire.decode_proof),
    (wire.VERDICT_SIZE, wire.decode_verdict),
    (wire.CTRL_SIZE, lambda b: wire.decode_ctrl(b, 1 << 16)),
    (wire.SLICE_SIZE, lambda b: wire.decode_slice(b, 1 << 30)),
    (wire.ANNOUNCE_SIZE, lambda b: wire.decode_announce(b, max_elements=1 << 28, valid_dtype=ops.dtype_from_code,
                                                        valid_op=ops.ReduceOp.from_code)),
]


@pytest.mark.parametrize("size, decode", DECODERS)
@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_decoders_raise_only_protocol_errors(size, decode, data):
    # Mostly the right length (the interesting case), sometimes any length.
    raw = data.draw(st.one_of(st.binary(min_size=size, max_size=size), st.binary(max_size=2 * size)))
    if data.draw(st.booleans()) and len(raw) >= 4:
        raw = b"RSCK" + raw[4:]  # get past the magic more often
    try:
        decode(raw)
    except ProtocolError:
        pass
    except Exception as e:  # struct.error, ValueError, UnicodeError...: a decoder bug
        raise AssertionError(f"{type(e).__name__} from {decode}: {e}") from e


@settings(max_examples=300, deadline=None)
@given(total=st.integers(0, 2**64 - 1), offset=st.integers(0, 2**64 - 1), length=st.integers(0, 2**32 - 1))
def test_slice_bounds_never_exceed_the_limit(total, offset, length):
    limit = 1 << 30
    try:
        rec = wire.decode_slice(wire.encode_slice(1, 0, total, offset, length), limit)
    except ProtocolError:
        return
    assert rec.total <= limit and rec.offset + rec.length <= rec.total and rec.length > 0


# -- a live reducer under attack ----------------------------------------------------------

TOKEN = b"s3cret-token"


def _attack(addr, stop: threading.Event, log: list):
    """Random bytes, truncated handshakes, a wrong token, oversized fields — in a loop."""
    rng = np.random.default_rng(0)
    good = Config(timeout_s=5, token=TOKEN, nsocks=1)
    while not stop.is_set():
        # random bytes
        with socket.create_connection(addr, timeout=5) as s:
            s.sendall(rng.integers(0, 256, 200, dtype=np.uint8).tobytes())
        # truncated handshake: half a hello, then gone
        with socket.create_connection(addr, timeout=5) as s:
            hello = wire.Hello(wire.StreamKind.CONTROL, 0, 1, 7, bytes(16), "evil").encode()
            s.sendall(hello[:30])
        # wrong token
        try:
            connect(addr, config=Config(timeout_s=5, token=b"wrong", nsocks=1)).close()
            log.append("wrong token accepted!")
        except AuthError:
            pass
        # authenticated, but hostile frames: an oversized slice, then a bogus announce
        for frame in ("slice", "announce"):
            try:
                c = connect(addr, config=good, name="evil")
            except RedsockError as e:
                log.append(f"legit handshake failed: {e}")
                continue
            if frame == "slice":
                c._data[0].sendall(wire.encode_slice(wire.ANNOUNCE_TAG, 0, 1 << 62, 0, 1 << 20))
            else:
                bogus = wire.Announce(job=1, op_seq=0, dtype_code=99, op_code=1, world=2, rank=0, flags=0,
                                      count=10, piece_elems=10, nservers=1, server_index=0,
                                      timeout_ms=5000).encode()
                c.isend(bogus, wire.ANNOUNCE_TAG)
            time.sleep(0.05)
            c.close()


def test_reducer_survives_hostile_clients_while_a_job_runs():
    cfg = Config(timeout_s=20, token=TOKEN, max_message_bytes=64 << 20)
    with ReductionServer("127.0.0.1", 0, config=cfg) as server:
        addr = server.address
        # 500 half-open connections: connected, never a byte.
        flood = [socket.create_connection(addr, timeout=5) for _ in range(500)]
        stop, log = threading.Event(), []
        attacker = threading.Thread(target=_attack, args=(addr, stop, log), daemon=True)
        attacker.start()
        try:
            outs = run_world("server_async", 3, timeout=180,
                             env={"REDSOCK_SERVERS": "%s:%d" % addr, "REDSOCK_TOKEN": TOKEN.decode(),
                                  "TEST_REPS": "15", "REDSOCK_PIECE_BYTES": "256K"})
        finally:
            stop.set()
            attacker.join(30)
            for s in flood:
                s.close()
        for r, (code, out, err) in enumerate(outs):
            assert code == 0 and out.rstrip().endswith("ok"), f"rank {r}:\n{err[-3000:]}"
        assert not log, log
        assert server.listener.rejected > 0
        assert server.stats()["rounds"] == 0


def _announce(conn, job, rank, world=2, op_seq=0):
    ann = wire.Announce(job=job, op_seq=op_seq, dtype_code=ops.dtype_code(np.float32), op_code=ops.ReduceOp.SUM.code,
                        world=world, rank=rank, flags=0, count=4, piece_elems=4, nservers=1, server_index=0,
                        timeout_ms=5000)
    conn.send(ann.encode(), wire.ANNOUNCE_TAG, timeout=5)


def test_job_identity_is_bound_to_the_connection():
    """A connection that joined job A as rank 0 cannot switch to job B, nor can a second
    connection take over a live (job, rank): both are cut off, the first job is untouched."""
    cfg = Config(timeout_s=10, token=TOKEN)
    with ReductionServer("127.0.0.1", 0, config=cfg) as server:
        a0 = connect(server.address, config=cfg, name="a0")
        a1 = connect(server.address, config=cfg, name="a1")
        _announce(a0, job=111, rank=0)
        a0.send(np.ones(4, np.float32), wire.piece_tag(0, 0), timeout=5)
        thief = connect(server.address, config=cfg, name="thief")
        _announce(thief, job=111, rank=0)  # rank 0 of job 111 is taken
        with pytest.raises(RedsockError):
            thief.recv(np.empty(4, np.float32), wire.piece_tag(0, 0), timeout=5)
        _announce(a1, job=111, rank=1)
        a1.send(np.full(4, 2, np.float32), wire.piece_tag(0, 0), timeout=5)
        out0, out1 = np.empty(4, np.float32), np.empty(4, np.float32)
        a0.recv(out0, wire.piece_tag(0, 0), timeout=5)
        a1.recv(out1, wire.piece_tag(0, 0), timeout=5)
        assert np.all(out0 == 3) and np.all(out1 == 3)  # the job's own sum, untouched
        _announce(a1, job=222, rank=1, op_seq=1)  # switching jobs on a bound connection
        with pytest.raises(RedsockError):
            a1.recv(np.empty(4, np.float32), wire.piece_tag(1, 0), timeout=5)
        for c in (a0, a1, thief):
            c.close()


def _slow_on_lost(server):
    """The reducer's handling of a dropped link held up for 0.5 s (as a loaded machine does)."""
    on_lost = server.on_lost

    def slow_on_lost(link, err):
        time.sleep(0.5)
        on_lost(link, err)
    server.on_lost = slow_on_lost


def test_a_piece_beyond_its_announce_cuts_the_connection():
    """A piece sent on its own for a call whose only piece here rides in its announce is one
    too many: the reducer cuts the connection instead of summing either, and the announce
    joins no round.  The reducer tells the worker before it clears a dropped link's job (it
    is held up here for 0.5 s, as a loaded machine once did): a round that the bad announce
    had made would still be there when the worker's call fails."""
    cfg = Config(timeout_s=10, token=TOKEN)
    with ReductionServer("127.0.0.1", 0, config=cfg) as server:
        _slow_on_lost(server)
        c = connect(server.address, config=cfg, name="extra")
        try:
            c.send(np.ones(4, np.float32), wire.piece_tag(0, 0), timeout=5)  # ahead of its announce
            ann = wire.Announce(job=333, op_seq=0, dtype_code=ops.dtype_code(np.float32),
                                op_code=ops.ReduceOp.SUM.code, world=1, rank=0, flags=0, count=4, piece_elems=4,
                                nservers=1, server_index=0, timeout_ms=5000)
            c.send(ann.encode() + np.ones(4, np.float32).tobytes(), wire.ANNOUNCE_TAG, timeout=5)
            with pytest.raises(RedsockError):
                c.recv(np.empty(4, np.float32), wire.piece_tag(0, 0), timeout=5)
        finally:
            c.close()
        assert server.stats()["rounds"] == 0


def test_a_worker_that_breaks_the_protocol_is_told_why():
    """A piece of the wrong size: the reducer cuts the connection, and the worker's error
    carries the reducer's reason, not just "peer closed the connection".  By then the job's
    round is gone (the reducer clears a dropped link's job first; held up here for 0.5 s)."""
    cfg = Config(timeout_s=10, token=TOKEN)
    with ReductionServer("127.0.0.1", 0, config=cfg) as server:
        _slow_on_lost(server)
        c = connect(server.address, config=cfg, name="sloppy")
        try:
            _announce(c, job=444, rank=0)  # 4 float32 in one piece, world 2
            c.send(np.ones(8, np.float32), wire.piece_tag(0, 0), timeout=5)
            with pytest.raises(RedsockError, match="refused what it was sent.*32 bytes, expected 16"):
                c.recv(np.empty(4, np.float32), wire.piece_tag(0, 0), timeout=5)
        finally:
            c.close()
        assert server.stats()["rounds"] == 0
