"""Fast Socket transport: real sockets on loopback, real processes for failures."""

import random
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest

from conftest import spawn_peer, wait_line
from peer_programs import pattern
from redsock import wire
from redsock.config import Config
from redsock.errors import AuthError, ConfigError, ProtocolError, Timeout, TransportError
from redsock.transport import Listener, connect
from redsock.transport.connection import PEER_REASON_WAIT_S
from redsock.transport.sockets import TCP_NOTSENT_LOWAT, ControlReader, shutdown_quietly


def roundtrip(a, b, data, tag=0):
    out = np.empty_like(data)
    h = b.irecv(out, tag)
    a.send(data, tag)
    h.wait(20)
    return out


@pytest.mark.parametrize("nsocks, balance", [(4, "dynamic"), (1, "dynamic"), (3, "static")])
def test_random_sizes_both_ways(make_pair, nsocks, balance):
    client, server = make_pair(nsocks=nsocks, balance=balance, chunk_bytes=128 * 1024)
    rng = random.Random(nsocks)
    sizes = [0, 1, 7, client.inline_bytes, client.inline_bytes + 1, 64 << 20] + [
        int(2 ** rng.uniform(0, 26)) for _ in range(14)]
    for i, n in enumerate(sizes):
        data = pattern(n, i)
        a, b = (client, server) if i % 2 == 0 else (server, client)
        assert np.array_equal(roundtrip(a, b, data, tag=i), data), f"size {n}"


def test_buffer_kinds_and_offsets(make_pair):
    client, server = make_pair()
    src = bytes(range(256)) * 1000
    dst = bytearray(len(src))
    h = server.irecv(memoryview(dst), 1)
    client.send(src, 1)
    h.wait(10)
    assert dst == bytearray(src)
    big = np.arange(300_000, dtype=np.float64)  # 2.4 MB, spans several slices
    out = np.zeros((600, 500), dtype=np.float64)
    h = server.irecv(out, 2)
    client.send(big.reshape(600, 500), 2)
    h.wait(10)
    assert np.array_equal(out.ravel(), big)


def test_unexpected_messages_are_delivered_in_order(make_pair):
    """Messages sent before the receive is posted, several with the same tag."""
    client, server = make_pair()
    msgs = [pattern(n, n) for n in (10, 5 << 20, 100, 3 << 20)]
    for m in msgs:
        client.isend(m, tag=9)
    time.sleep(0.3)  # let everything arrive unexpected
    for m in msgs:
        out = np.empty_like(m)
        server.recv(out, tag=9, timeout=10)
        assert np.array_equal(out, m)


@pytest.mark.parametrize("posted", [False, True])
def test_small_messages_back_to_back_straddle_reads(make_pair, posted):
    """Inline messages of many sizes sent back to back: a read of the control stream holds
    several records, and cuts headers and payloads at every position."""
    client, server = make_pair()
    # The first record ends 10 bytes before the first 4096-byte read does: the next header is cut.
    sizes = [4096 - 10 - wire.CTRL_SIZE] + [0, 1, 7, 23, 24, 25, 100, 4047, 4048, 4049, 4072, 4096, 5000, 65536] * 3
    msgs = [pattern(n, i) for i, n in enumerate(sizes)]
    outs = [np.zeros_like(m) for m in msgs]
    handles = [server.irecv(o, tag=3 + i % 2) for i, o in enumerate(outs)] if posted else []
    sends = [client.isend(m, tag=3 + i % 2) for i, m in enumerate(msgs)]
    if posted:
        for h in reversed(handles):  # the last waiter reads the records of all the others
            h.wait(20)
    else:
        time.sleep(0.3)  # everything lands unexpected, several records per read
        for i, o in enumerate(outs):
            server.recv(o, tag=3 + i % 2, timeout=10)
    for h in sends:
        h.wait(20)
    for i, (o, m) in enumerate(zip(outs, msgs)):
        assert np.array_equal(o, m), f"message {i} ({sizes[i]} bytes)"


def test_control_records_arriving_a_few_bytes_at_a_time(make_pair):
    """A control record cut into tiny writes: a header in pieces, a payload in pieces."""
    client, server = make_pair()
    msgs = [pattern(n, i) for i, n in enumerate([5, 0, 300, 24] + [random.Random(i).randint(0, 40) for i in range(60)])]
    raw = b"".join(wire.encode_inline(11, seq, m.nbytes) + m.tobytes() for seq, m in enumerate(msgs))
    outs = [np.zeros_like(m) for m in msgs]
    handles = [server.irecv(o, tag=11) for o in outs]

    def dribble():
        rng = random.Random(5)
        i = 0
        while i < len(raw):
            n = rng.randint(1, 7)
            client._ctrl.sendall(raw[i:i + n])  # the test speaks the wire format itself
            i += n
            time.sleep(0.001)

    t = threading.Thread(target=dribble)
    t.start()
    for h in handles:
        h.wait(20)
    t.join()
    for o, m in zip(outs, msgs):
        assert np.array_equal(o, m)


def test_receive_posted_mid_message_shows_progress(make_pair):
    """A receive posted while its message is landing unexpected reports the bytes so far
    (its no-progress deadline watches them: a long message must not look stalled)."""
    client, server = make_pair()
    data = pattern(512 << 20, 3)
    client.isend(data, tag=4)
    deadline = time.monotonic() + 10
    while not any(u.got for u in list(server._unexpected.values())):
        assert time.monotonic() < deadline, "nothing arrived"
        time.sleep(0.0005)
    out = np.empty_like(data)
    h = server.irecv(out, tag=4)
    assert h.got > 0
    h.wait(10)
    assert h.got == data.nbytes and np.array_equal(out, data)


def test_many_concurrent_tagged_messages_both_ways(make_pair):
    client, server = make_pair(chunk_bytes=64 * 1024)
    rng = random.Random(1)
    plan = [(rng.randrange(8), int(2 ** rng.uniform(0, 21))) for _ in range(120)]
    errors = []

    def run(me, other, seed):
        try:
            sends = []
            recvs = []
            for i, (tag, n) in enumerate(plan):
                sends.append(me.isend(pattern(n, seed + i), tag))
            order = list(range(len(plan)))
            random.Random(seed).shuffle(order)  # post receives in a different order per tag group
            by_tag = {}
            for i in order:
                by_tag.setdefault(plan[i][0], []).append(i)
            for tag, idxs in by_tag.items():
                for i in sorted(idxs):  # same-tag messages match in send order
                    buf = np.empty(plan[i][1], np.uint8)
                    recvs.append((i, buf, me.irecv(buf, tag)))
            for i, buf, h in recvs:
                h.wait(20)
                assert np.array_equal(buf, pattern(plan[i][1], other + i)), f"message {i}"
            for h in sends:
                h.wait(20)
        except Exception as e:  # relayed to the main thread
            errors.append(e)

    t1 = threading.Thread(target=run, args=(client, 1000, 2000))
    t2 = threading.Thread(target=run, args=(server, 2000, 1000))
    for t in (t1, t2):
        t.start()
    for t in (t1, t2):
        t.join(60)
    assert not t1.is_alive() and not t2.is_alive()
    assert not errors, errors


def test_dynamic_balancing_spreads_slices(make_pair):
    client, server = make_pair(nsocks=4, chunk_bytes=128 * 1024)
    data = pattern(32 << 20, 3)
    assert np.array_equal(roundtrip(client, server, data), data)
    assert sum(client.slices_sent) == 256
    assert all(n > 0 for n in client.slices_sent)


def test_a_caller_writes_a_slice_itself_when_the_stream_is_idle(make_pair):
    """A single-stream connection (no TCP_NOTSENT_LOWAT): a message of one slice goes out
    from the caller's thread when the socket has room; the stream's thread is not involved."""
    client, server = make_pair(nsocks=1, chunk_bytes=512 * 1024)
    for i in range(8):
        data = pattern(256 * 1024, i)
        assert np.array_equal(roundtrip(client, server, data, tag=i), data)
    assert client.slices_sent == [8]
    assert client.direct_slices == 8  # the receiver keeps up: every socket had room
    multi, _ = make_pair(nsocks=2, notsent_lowat=32 * 1024)  # the kernel takes only the low-water mark
    data = pattern(256 * 1024, 9)
    assert np.array_equal(roundtrip(multi, _, data), data)
    assert multi.direct_slices == 0


@pytest.mark.parametrize("posted", [True, False])
def test_what_the_kernel_cannot_take_from_a_caller_the_stream_thread_finishes(make_pair, posted):
    """Small socket buffers: the caller's non-blocking write of a 1 MiB slice goes out in part,
    and the stream's thread writes the rest, in order with the messages queued behind it."""
    client, server = make_pair(nsocks=1, chunk_bytes=1 << 20)
    client._data[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024)
    server._data[0].setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    msgs = [pattern(n, i) for i, n in enumerate([1 << 20, 300_000, 1 << 20, 70_000, 3 << 20])]
    outs = [np.empty_like(m) for m in msgs]
    recvs = [server.irecv(o, 5) for o in outs] if posted else []
    sends = [client.isend(m, 5) for m in msgs]
    recvs = recvs or [server.irecv(o, 5) for o in outs]
    for h in sends + recvs:
        h.wait(20)
    for m, o in zip(msgs, outs):
        assert np.array_equal(o, m)
    assert sum(client.slices_sent) == 7 and client.direct_slices < 7
    assert client.probe(5.0)  # the stream is free again for the liveness probe


def test_closing_while_the_stream_thread_finishes_a_callers_slice_settles_the_send(make_pair):
    client, server = make_pair(nsocks=1, chunk_bytes=1 << 20)
    client._data[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    server._data[0].setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sends = [client.isend(pattern(1 << 20, i), 1) for i in range(4)]
    assert client.direct_slices == 0  # the first went out in part: its thread has the rest
    start = time.monotonic()
    client.close()
    for h in sends:  # each one either went out before the close or failed: none is left hanging
        try:
            h.wait(5)
        except TransportError:
            pass
        assert h.done
    assert time.monotonic() - start < 5


def test_zerocopy_sends_complete_after_release(make_pair):
    client, server = make_pair(zerocopy_min_bytes=64 * 1024, chunk_bytes=256 * 1024)
    for i, n in enumerate([100, 1 << 20, 17 << 20]):
        data = pattern(n, i)
        assert np.array_equal(roundtrip(client, server, data, tag=i), data)


def test_size_mismatch_is_a_clear_error_on_both_sides(make_pair):
    client, server = make_pair()
    h = server.irecv(np.empty(1 << 20, np.uint8), 1)
    client.isend(np.zeros(2 << 20, np.uint8), 1)
    with pytest.raises(ProtocolError, match="sent 2097152 bytes, this side expected 1048576"):
        h.wait(10)
    with pytest.raises(TransportError):
        client.recv(np.empty(4, np.uint8), 2, timeout=10)


def test_bad_buffers_are_refused(make_pair):
    client, server = make_pair()
    with pytest.raises(ConfigError, match="C-contiguous"):
        client.isend(np.zeros((4, 4))[:, 1], 0)
    with pytest.raises(ConfigError, match="read-only"):
        server.irecv(b"immutable", 0)
    with pytest.raises(ConfigError, match="buffer"):
        client.isend(12345, 0)


def test_close_is_idempotent_and_fails_pending(make_pair):
    client, server = make_pair()
    h = server.irecv(np.empty(8, np.uint8), 0)
    server.close()
    server.close()
    with pytest.raises(TransportError, match="closed locally"):
        h.wait(1)
    with pytest.raises(TransportError):
        server.isend(b"x", 0)
    # The other side learns it too, and does not hang.
    with pytest.raises(TransportError):
        client.recv(np.empty(8, np.uint8), 0, timeout=10)


def test_wait_deadline_raises_timeout_and_aborts(make_pair):
    client, server = make_pair()
    t0 = time.monotonic()
    with pytest.raises(Timeout, match="no progress"):
        server.recv(np.empty(8, np.uint8), 0, timeout=0.5)
    assert time.monotonic() - t0 < 3
    with pytest.raises(TransportError):  # the peer sees the abort too
        client.recv(np.empty(8, np.uint8), 0, timeout=10)


# -- handshakes -------------------------------------------------------------------

def _raw(addr, payload):
    s = socket.create_connection(addr, timeout=5)
    s.sendall(payload)
    try:
        return s.recv(1024)
    except OSError:
        return b""
    finally:
        s.close()


def test_listener_rejects_garbage_and_wrong_version_and_keeps_serving():
    cfg = Config(timeout_s=10)
    with Listener(config=cfg) as listener:
        _raw(listener.address, b"GET / HTTP/1.1\r\n\r\n" + bytes(100))
        bad = wire.Hello(wire.StreamKind.CONTROL, 0, 4, 1, bytes(16), "old", version=wire.VERSION + 1).encode()
        reply = _raw(listener.address, bad)
        assert reply[:4] == b"RSCK"  # answered in its own version so the peer can say why
        deadline = time.monotonic() + 5
        while listener.rejected < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert listener.rejected == 2
        with connect(listener.address, config=cfg) as c, listener.accept(5) as s:
            assert np.array_equal(roundtrip(c, s, pattern(1000, 1)), pattern(1000, 1))


def test_bare_connect_and_close_is_a_probe_not_a_rejected_stream(caplog):
    # Ranks probe a peer's listener this way while they wait for it (bootstrap), as load
    # balancers check a reducer's port: no warning, no rejection, and the listener serves on.
    cfg = Config(timeout_s=10)
    with Listener(config=cfg) as listener, caplog.at_level("DEBUG", logger="redsock"):
        for _ in range(3):
            socket.create_connection(listener.address, timeout=5).close()
        deadline = time.monotonic() + 5
        while caplog.text.count("(a probe)") < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert caplog.text.count("(a probe)") == 3, caplog.text
        assert listener.rejected == 0 and "refused a stream" not in caplog.text
        with connect(listener.address, config=cfg) as c, listener.accept(5) as s:
            assert np.array_equal(roundtrip(c, s, pattern(1000, 1)), pattern(1000, 1))


def test_wrong_version_is_reported_by_the_connecting_side(monkeypatch):
    with Listener(config=Config(timeout_s=10)) as listener:
        monkeypatch.setattr(wire, "VERSION", wire.VERSION + 1)
        with pytest.raises(ProtocolError, match=f"version {wire.VERSION - 1}, this side {wire.VERSION}"):
            connect(listener.address, config=Config(timeout_s=10))


def test_token_mismatch_is_refused():
    with Listener(config=Config(timeout_s=10, token=b"right")) as listener:
        with pytest.raises(AuthError):
            connect(listener.address, config=Config(timeout_s=10, token=b"wrong"))
        with pytest.raises(AuthError):
            connect(listener.address, config=Config(timeout_s=10))  # no token at all
        with connect(listener.address, config=Config(timeout_s=10, token=b"right")) as c, listener.accept(5) as s:
            assert np.array_equal(roundtrip(c, s, pattern(10, 1)), pattern(10, 1))


def test_connect_refused_names_the_peer():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransportError, match=f"127.0.0.1:{port}.*refused"):
        connect(("127.0.0.1", port), config=Config(timeout_s=5))


# -- real processes dying or stalling ----------------------------------------------

def _accept_peer(listener, *args):
    proc = spawn_peer(*args)
    conn = listener.accept(timeout=20)
    wait_line(proc, "ready")
    return proc, conn


@pytest.mark.parametrize("role", ["sender", "receiver"])
def test_peer_killed_mid_message_fails_this_side(role):
    """SIGKILL the peer while a 1 GiB message is moving: this side raises, naming it, promptly.

    On a loaded machine the whole GiB can occasionally land before the kill; such an
    attempt proves nothing, so it is repeated (a hang or a silent success never passes)."""
    for attempt in range(3):
        with Listener(config=Config(timeout_s=20)) as listener:
            proc, conn = _accept_peer(listener, role, *listener.address, 1 << 30)
            try:
                if role == "sender":
                    h = conn.irecv(np.empty(1 << 30, np.uint8), tag=5)
                else:
                    h = conn.isend(np.ones(1 << 30, np.uint8), tag=6)
                while h.got == 0 and not h.done:
                    time.sleep(0.001)
                proc.kill()
                t0 = time.monotonic()
                try:
                    h.wait()
                except TransportError as e:
                    assert f"{role}@" in str(e)
                    assert time.monotonic() - t0 < 5
                    return
            finally:
                proc.kill()
                proc.wait()
                conn.close()
    pytest.fail("the message completed before the kill in every attempt")


def test_stalled_peer_is_detected_by_the_timeout():
    with Listener(config=Config(timeout_s=20)) as listener:
        proc, conn = _accept_peer(listener, "receiver", *listener.address, 256 << 20)
        try:
            proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(Timeout, match="no progress for 2s"):
                conn.send(np.ones(256 << 20, np.uint8), tag=6, timeout=2)
            assert time.monotonic() - t0 < 6
        finally:
            proc.kill()
            proc.wait()
            conn.close()


@pytest.mark.parametrize("nbytes", [1, 3 << 20])
def test_last_message_before_close_is_delivered(nbytes):
    """The peer sends and closes at once: the message must arrive, inline or sliced."""
    cfg = Config(timeout_s=10)
    with Listener(config=cfg) as listener:
        for i in range(60):
            c = connect(listener.address, config=cfg)
            s = listener.accept(timeout=5)
            data = pattern(nbytes, i)
            out = np.zeros_like(data)
            h = c.irecv(out, 2)
            t = threading.Thread(target=lambda: (s.send(data, 2), s.close()))
            t.start()
            h.wait(5)
            t.join()
            c.close()
            assert np.array_equal(out, data), f"session {i}"


def test_send_completes_when_the_peer_closes_right_after_receiving(make_pair):
    """The peer takes the whole message and closes before this side's stream thread has
    recorded the slice as sent (a descheduled thread on a busy machine): the bytes were
    delivered, so the send succeeded and must say so, not "closed the connection"."""
    client, server = make_pair(nsocks=2, chunk_bytes=256 * 1024)
    recorded = client._slice_written

    def late(*args):  # widen the window between the write returning and its bookkeeping
        time.sleep(0.3)
        recorded(*args)

    client._slice_written = late
    data = pattern(1 << 20, 7)
    out = np.empty_like(data)
    h = client.isend(data, 3)
    server.recv(out, 3, timeout=10)
    server.close()
    h.wait(10)
    assert np.array_equal(out, data)
    with pytest.raises(TransportError, match="closed the connection"):  # and the close is seen after it
        client.recv(np.empty(8, np.uint8), 4, timeout=10)


@pytest.mark.parametrize("nbytes", [1, 300_000])  # inline on the control stream; sliced over the data streams
def test_a_message_that_arrived_before_the_peer_closed_is_still_received(make_pair, nbytes):
    """The peer sends its last message and closes before this side posts the receive (the
    benchmark's final ack on a busy machine): the connection fails, but the message had
    arrived whole, so a receive of it delivers it; only the next one reports the close."""
    client, server = make_pair(nsocks=2, chunk_bytes=64 * 1024)
    data = pattern(nbytes, 11)
    server.send(data, 6, timeout=10)
    server.close()
    deadline = time.monotonic() + 10
    while client.error is None and time.monotonic() < deadline:  # the close is seen, the message kept
        time.sleep(0.01)
    assert client.error is not None
    out = np.empty_like(data)
    client.recv(out, 6, timeout=10)
    assert np.array_equal(out, data)
    with pytest.raises(TransportError, match="closed the connection"):
        client.recv(np.empty(8, np.uint8), 6, timeout=10)


def test_backlogged_control_sends_complete_when_the_peer_closes_right_after(make_pair, monkeypatch):
    """Small messages that met a full control-stream buffer are finished by a helper thread;
    the peer reads them all and closes at once: they were delivered, so they succeeded."""
    from redsock.transport import connection

    client, server = make_pair()
    written = connection.send_all

    def late(sock, parts):
        written(sock, parts)
        if sock is client._ctrl:
            time.sleep(0.05)

    monkeypatch.setattr(connection, "send_all", late)
    msgs = [pattern(60 * 1024, i) for i in range(200)]  # 12 MB: more than a loopback socket buffers
    handles = [client.isend(m, 5) for m in msgs]
    assert client._ctrl_tx_thread is not None, "the control stream never filled up"
    out = np.empty(60 * 1024, np.uint8)
    for i, m in enumerate(msgs):
        server.recv(out, 5, timeout=10)
        assert np.array_equal(out, m), f"message {i}"
    server.close()
    for h in handles:
        h.wait(10)


# ------------------------------------------------------------------ data-stream reads

@pytest.fixture
def tcp_pair():
    """A connected pair of blocking TCP sockets on loopback; closed afterwards."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname(), timeout=5)
        b, _ = srv.accept()
    a.settimeout(None)
    b.settimeout(None)
    yield a, b
    a.close()
    b.close()


def _read_in_thread(reader, sizes):
    """Read records of ``sizes`` in a thread; returns (thread, results list)."""
    got = []

    def run():
        try:
            for n in sizes:
                buf = bytearray(n)
                got.append(bytes(buf) if reader.read_exact(memoryview(buf)) else None)
        except Exception as e:  # noqa: BLE001 - handed to the test
            got.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, got


@pytest.mark.parametrize("max_lowat", [4096, 256 * 1024, 4 << 20])
def test_stream_reader_reads_records_however_the_bytes_arrive(tcp_pair, max_lowat):
    """Records of 1 B .. 5 MiB written in random cuts with pauses, including a record whose
    last few bytes come long after the rest (a reader that kept the old low-water mark
    after a partial copy would never wake for them)."""
    from redsock.transport.sockets import StreamReader

    a, b = tcp_pair
    rng = random.Random(max_lowat)
    sizes = [1, 7, 4096, 300 * 1024, 5 << 20, 65537, 2, 1 << 20]
    records = [pattern(n, i).tobytes() for i, n in enumerate(sizes)]
    t, got = _read_in_thread(StreamReader(b, max_lowat), sizes)
    stream = b"".join(records)
    tail_gap_at = sum(sizes[:4]) - 3  # the 300 KiB record's last 3 bytes come 0.2 s later
    pos = 0
    while pos < len(stream):
        end = tail_gap_at if pos < tail_gap_at else min(len(stream), pos + rng.choice([1, 100, 70000, 1 << 20]))
        a.sendall(stream[pos:end])
        pos = end
        time.sleep(0.2 if pos == tail_gap_at else rng.choice([0, 0, 0.002]))
    t.join(30)
    assert not t.is_alive(), "the reader never woke for the bytes it was waiting for"
    assert got == records


def test_stream_reader_wakes_once_per_read_not_per_segment(tcp_pair):
    """2 MiB arriving as 128 writes of 16 KiB, 1 ms apart: the reader sleeps until all of it
    is there instead of waking for each write."""
    from redsock.transport.sockets import StreamReader

    a, b = tcp_pair
    reader = StreamReader(b, 4 << 20)
    polls = []

    class CountingPoll:
        def __init__(self, inner):
            self.inner = inner

        def poll(self, *args):
            polls.append(1)
            return self.inner.poll(*args)

    reader._poll = CountingPoll(reader._poll)
    data = pattern(2 << 20, 9).tobytes()
    t, got = _read_in_thread(reader, [len(data)])
    for i in range(0, len(data), 16384):
        a.sendall(data[i:i + 16384])
        time.sleep(0.001)
    t.join(30)
    assert got == [data]
    assert len(polls) <= 3, f"woke {len(polls)} times for 128 writes"


def test_stream_reader_tells_a_clean_end_from_a_cut_record(tcp_pair):
    from redsock.transport.sockets import StreamReader

    a, b = tcp_pair
    reader = StreamReader(b, 1 << 20)
    a.sendall(b"x" * 10)
    a.shutdown(socket.SHUT_WR)
    assert reader.read_exact(memoryview(bytearray(4)))
    with pytest.raises(EOFError, match="after 6 of 100 bytes"):
        reader.read_exact(memoryview(bytearray(100)))
    assert reader.read_exact(memoryview(bytearray(4))) is False


# ------------------------------------------------------------------ same-host profile

class _Ends:
    """Just the two addresses of a connected socket, for same_host()."""

    def __init__(self, local, peer):
        self._local, self._peer = local, peer

    def getsockname(self):
        return (self._local, 1)

    def getpeername(self):
        return (self._peer, 2)


@pytest.mark.parametrize("local, peer, want", [
    ("127.0.0.1", "127.0.0.1", True), ("127.0.0.1", "127.0.0.2", True), ("::1", "::1", True),
    ("10.1.2.3", "10.1.2.3", True),           # this host's own address
    ("::ffff:127.0.0.1", "::ffff:127.0.0.1", True),
    ("198.18.0.1", "198.18.0.2", False),      # another host (or testbed namespace)
])
def test_same_host_is_loopback_or_own_address(local, peer, want):
    from redsock.transport.sockets import same_host

    assert same_host(_Ends(local, peer)) is want


def test_a_peer_on_this_host_gets_one_stream_whole_slices_and_no_lowat():
    cfg = Config(timeout_s=20, nsocks=4, chunk_bytes=256 * 1024, notsent_lowat=32 * 1024)  # local_nsocks=1
    listener = Listener(config=cfg)
    client = connect(listener.address, config=cfg)
    server = listener.accept(timeout=10)
    try:
        for conn in (client, server):
            assert conn.nstreams == 1
            assert conn.config.chunk_bytes == 4 << 20 and conn.config.notsent_lowat == 0
        data = np.arange(3 << 20, dtype=np.uint8)
        assert np.array_equal(roundtrip(client, server, data), data)
        assert np.array_equal(roundtrip(server, client, data[::-1].copy()), data[::-1])
    finally:
        client.close()
        server.close()
        listener.close()


def test_local_nsocks_zero_treats_this_host_like_any_peer(make_pair):
    client, server = make_pair(nsocks=3, local_nsocks=0, notsent_lowat=32 * 1024)
    assert client.nstreams == server.nstreams == 3
    assert client.config.notsent_lowat == 32 * 1024
    assert client._data[0].getsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT) == 32 * 1024


def test_a_single_stream_connection_leaves_unsent_bytes_to_the_kernel(make_pair):
    # Nothing to balance over one stream: no TCP_NOTSENT_LOWAT, on both ends, whoever chose the count.
    client, server = make_pair(nsocks=1, local_nsocks=0, notsent_lowat=32 * 1024)
    assert client.nstreams == server.nstreams == 1
    assert client.config.notsent_lowat == server.config.notsent_lowat == 0
    for conn in (client, server):  # 0: never set, the kernel's own limit applies
        assert conn._data[0].getsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT) == 0
    assert Config(nsocks=4).for_peer(False, nstreams=1).notsent_lowat == 0  # the listener's side


def test_same_host_profile_options_are_checked():
    cfg = Config(local_nsocks=2, chunk_bytes=8 << 20)
    assert cfg.for_peer(False) is cfg
    local = cfg.for_peer(True)
    assert (local.nsocks, local.chunk_bytes, local.notsent_lowat) == (2, 8 << 20, 0)  # larger chunks are kept
    with pytest.raises(ConfigError, match="local_nsocks"):
        Config(local_nsocks=17)
    assert Config.from_env({"REDSOCK_LOCAL_NSOCKS": "0"}).local_nsocks == 0


def test_adaptive_spin_stops_while_answers_are_slow_and_returns_when_they_are_quick():
    """The waiter spins while answers usually come within the spin, and not while they do not
    (more ranks than cores: spinning only delays the processes that are to answer)."""
    from redsock.transport.connection import AdaptiveSpin

    spin = AdaptiveSpin(100e-6)
    assert spin.budget() == 100e-6  # a new connection spins
    for _ in range(8):
        spin.record(600e-6)  # answers come after 600 us
    assert spin.budget() == 0.0
    assert spin.usual_s <= 200e-6  # a long wait counts as twice the spin: quick to come back
    for _ in range(8):
        spin.record(20e-6)
    assert spin.budget() == 100e-6
    spin.record(5.0)  # one long wait (a peer busy elsewhere) does not stop the spinning
    assert spin.budget() == 100e-6
    assert AdaptiveSpin(0.0).budget() == 0.0


class _Sink:
    """Records what a ControlReader hands over, as both real sinks (Connection, Link) do."""

    def __init__(self):
        self.got: list[tuple[str, int, bytes]] = []
        self._rec = self._buf = None

    def ctrl_whole(self, rec, payload):
        self.got.append(("whole", rec.tag, bytes(payload)))

    def ctrl_begin(self, rec):
        self._rec, self._buf = rec, bytearray(rec.length)
        return memoryview(self._buf)

    def ctrl_end(self):
        self.got.append(("abort" if self._rec.type is wire.RecordType.ABORT else "begun", self._rec.tag,
                         bytes(self._buf)))


@pytest.mark.parametrize("chunk", [1, 7, 24, 100, 4096])
def test_control_reader_parses_records_however_the_bytes_arrive(chunk):
    """Small records staged whole, a record larger than the stage, an empty one and an abort,
    written in pieces of ``chunk`` bytes: every record arrives once, in order, with its bytes."""
    rng = np.random.default_rng(chunk)
    msgs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (8, 0, 100, 3000, 5)]
    stream = b"".join(wire.encode_inline(tag, 0, len(m)) + m for tag, m in enumerate(msgs))
    stream += wire.encode_abort("rank 3 gave up")
    a, b = socket.socketpair()
    with a, b:
        reader = ControlReader(b, stage_bytes=256, max_inline=4096)
        sink = _Sink()
        for lo in range(0, len(stream), chunk):
            a.sendall(stream[lo:lo + chunk])
            reader.pump(sink)
        assert not reader.staged and reader.pump(sink) is False  # nothing left, nothing moved
    assert [(t, m) for _, t, m in sink.got[:-1]] == list(enumerate(msgs))
    assert sink.got[-1] == ("abort", 0, b"rank 3 gave up")
    if chunk == 4096:  # in one piece: the records that fit the 256-byte stage skip a second buffer
        assert [k for k, _, _ in sink.got] == ["whole", "whole", "whole", "begun", "whole", "abort"]


class _Awaited:
    """A waiter's receive, as the control reader sees it: done once the sink got a record."""

    def __init__(self, sink: _Sink):
        self.sink = sink

    @property
    def done(self) -> bool:
        return bool(self.sink.got)


def test_control_reader_stops_once_the_waiter_is_done():
    """``until``: the pump returns as soon as it is done and nothing read is left unparsed,
    without another read; what comes later is read by the next pump."""
    a, b = socket.socketpair()
    with a, b:
        reader = ControlReader(b, stage_bytes=4096, max_inline=64)
        sink = _Sink()
        a.sendall(wire.encode_inline(1, 0, 3) + b"abc")
        assert reader.pump(sink, until=_Awaited(sink)) is True and len(sink.got) == 1
        a.sendall(wire.encode_inline(2, 0, 1) + b"z")
        reader.pump(sink)
        assert sink.got == [("whole", 1, b"abc"), ("whole", 2, b"z")]
        with pytest.raises(ProtocolError, match="exceeds"):  # an inline record above max_inline
            a.sendall(wire.encode_inline(3, 0, 65) + bytes(65))
            reader.pump(sink)


def test_control_reader_waits_in_its_read_at_most_the_sockets_receive_timeout():
    """``wait``: on a silent socket the pump returns nothing moved after the socket's receive
    timeout (0.3 s), instead of blocking for good or raising; the first read sleeps until bytes
    come (with a 10 s timeout, a record sent 0.1 s later is parsed by that one pump)."""
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(None)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 300_000))
        reader = ControlReader(b, stage_bytes=4096, max_inline=64)
        sink = _Sink()
        t0 = time.monotonic()
        assert reader.pump(sink, until=_Awaited(sink), wait=True) is False and not sink.got
        assert 0.25 <= time.monotonic() - t0 < 5.0
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 10, 0))
        later = threading.Timer(0.1, a.sendall, [wire.encode_inline(7, 0, 2) + b"hi"])
        later.start()
        try:
            t0 = time.monotonic()
            assert reader.pump(sink, until=_Awaited(sink), wait=True) is True
            assert sink.got == [("whole", 7, b"hi")] and 0.05 <= time.monotonic() - t0 < 9.0
        finally:
            later.join()


def test_the_peers_reason_survives_a_stream_failure_while_a_waiter_reads_the_control_stream(make_pair):
    """The peer aborts with a reason (the ranks it found failed) and closes; a send then meets
    a broken pipe while another thread holds the control stream, as a waiting inline receive
    does.  The failure must still carry the peer's reason: a rank that relays a failure would
    otherwise be named as the failed one (seen once in a test killing a local rank)."""
    client, server = make_pair(nsocks=2)
    client._ctrl_rx_lock.acquire()  # (what a waiter in an inline receive holds while it polls)
    try:
        server.abort("[failed ranks: 5] rank 0 gives up")
        server.close()  # the client's bytes unread there: its sends meet a reset
        h = client.isend(np.zeros(16 << 20, np.uint8))
        time.sleep(0.3)
    finally:
        client._ctrl_rx_lock.release()
    with pytest.raises(TransportError, match=r"\[failed ranks: 5\] rank 0 gives up"):
        h.wait(10)


def test_the_peers_reason_that_comes_after_a_stream_broke_mid_slice_is_still_read(make_pair):
    """The peer cuts a data stream mid-slice and its reason (an ABORT record) reaches the
    control stream a moment later, behind records it was still writing (a reducer aborting a
    job while a worker is behind on its results).  The failure must carry the reason, not the
    cut stream's "closed the connection mid-slice", which names nobody."""
    client, server = make_pair(nsocks=1)
    h = client.irecv(np.empty(1 << 20, np.uint8), tag=3)
    server._data[0].sendall(wire.encode_slice(3, 0, 1 << 20, 0, 1 << 20, 0) + bytes(1000))
    shutdown_quietly(server._data[0])
    later = threading.Timer(0.3, server._ctrl.sendall, [wire.encode_abort("[failed ranks: 5] rank 0 gives up")])
    later.start()
    try:
        with pytest.raises(TransportError, match=r"\[failed ranks: 5\] rank 0 gives up"):
            h.wait(10)
    finally:
        later.join()


class _ControlStreamThatStalls:
    """The control socket, except that its first ``sendmsg`` writes half of what it is given
    and the next ones wait for ``go`` (a peer behind on reading, a message half-written)."""

    def __init__(self, sock):
        self._sock, self.go, self.calls = sock, threading.Event(), 0

    def sendmsg(self, parts, *args):
        self.calls += 1
        if self.calls == 1:
            data = b"".join(bytes(p) for p in parts)
            return self._sock.send(data[:len(data) // 2])
        self.go.wait(10)
        return self._sock.sendmsg(parts, *args)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_a_reason_never_lands_inside_a_message_half_sent_on_the_control_stream(make_pair):
    """A small message is half-written on the control stream (the rest waits in the backlog)
    when this side aborts with a long reason: the ABORT record must not go into the middle of
    that message, where the peer would take its bytes for the message's (a message that
    arrives complete with wrong bytes: a silently wrong sum).  The message is finished, then
    the reason follows it (the peer names whom this side named, not this side)."""
    client, server = make_pair(nsocks=1)
    client._ctrl = stall = _ControlStreamThatStalls(client._ctrl)
    msg = np.full(2000, 7, np.uint8)
    client.isend(msg, tag=1)
    assert client._ctrl_backlog, "the message went out whole"
    client.abort("[failed ranks: 5] " + "x" * 4000)
    stall.go.set()
    got = np.zeros_like(msg)
    server.recv(got, tag=1, timeout=10)  # the message is finished first, whole and right
    assert np.array_equal(got, msg), "the reason's bytes landed in the message"
    with pytest.raises(TransportError, match=r"\[failed ranks: 5\]"):  # then the reason
        server.recv(got, tag=2, timeout=10)


def test_a_reason_queued_for_a_peer_that_never_reads_gives_up_within_the_wait(make_pair):
    """The reason waits behind a half-written message for a peer that reads nothing (stopped):
    this side's close must not wait for it longer than PEER_REASON_WAIT_S (and a bit)."""
    client, server = make_pair(nsocks=1)
    for sock in (client._ctrl, server._ctrl):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    server._ctrl_rx_lock.acquire()  # the server reads no more of its control stream
    try:
        for _ in range(100):  # until both kernels' buffers are full and messages wait here
            for _ in range(50):
                client.isend(np.full(2000, 1, np.uint8))
            time.sleep(0.05)
            if client._ctrl_backlog:
                break
        assert client._ctrl_backlog, "every message went out"
        t0 = time.monotonic()
        client.abort("[failed ranks: 5] rank 0 gives up")
        client.close()
        took = time.monotonic() - t0
    finally:
        server._ctrl_rx_lock.release()
    assert PEER_REASON_WAIT_S - 0.1 < took < PEER_REASON_WAIT_S + 2.0
    assert client._ctrl_tx_thread is not None and not client._ctrl_tx_thread.is_alive()


class _ControlStreamThatBreaks:
    """The control socket, except that every ``sendmsg`` meets ``error`` (as a reset or a
    stopped peer makes it do); everything else goes to the real socket."""

    def __init__(self, sock, error):
        self._sock, self._error = sock, error

    def sendmsg(self, *args, **kwargs):
        raise self._error

    def __getattr__(self, name):
        return getattr(self._sock, name)


@pytest.mark.parametrize("error", [ConnectionResetError(104, "Connection reset by peer"),
                                   BrokenPipeError(32, "Broken pipe"), OSError(113, "No route to host")])
def test_a_small_send_that_meets_a_broken_control_stream_fails_it_and_returns(make_pair, error):
    """The inline path writes from the caller's thread under the control stream's send lock; an
    error there must fail the connection after letting go of that lock (failing takes it to fail
    the backlog: a worker once hung there for good when its reducer stopped)."""
    client, server = make_pair(nsocks=2)
    client._ctrl = _ControlStreamThatBreaks(client._ctrl, error)
    pending = client.irecv(np.zeros(8, np.uint8), tag=1)  # must fail too, with the same cause
    outcome = {}

    def small_send():
        try:
            client.isend(np.ones(8, np.uint8), tag=1)
        except BaseException as e:  # noqa: BLE001 - the test reports whatever came out
            outcome["error"] = e

    t = threading.Thread(target=small_send, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "a small send deadlocked failing its own connection"
    assert isinstance(outcome.get("error"), TransportError), outcome
    with pytest.raises(TransportError):
        pending.wait(5)
    with pytest.raises(TransportError, match="connection is down"):  # and the connection stays failed
        client.isend(np.ones(8, np.uint8), tag=2)
