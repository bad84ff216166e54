"""Slice schedules, without sockets."""

from redsock.transport.schedule import DynamicSchedule, SendJob, StaticSchedule


def job(n, tag=0):
    return SendJob(tag, 0, memoryview(bytearray(n)))


def drain(sched, order):
    """Pull slices with streams asking in `order` (repeated); returns {stream: [(off, len)]}."""
    got = {i: [] for i in set(order)}
    while True:
        progressed = False
        for s in order:
            sl = sched.next_slice(s)
            if sl:
                got[s].append((sl.offset, sl.length))
                progressed = True
        if not progressed:
            return got


def test_dynamic_covers_message_exactly_once_and_follows_demand():
    sched = DynamicSchedule(4, chunk=100)
    sched.add(job(70050))
    # Stream 3 asks 4x as often as the others: it must get 4x the slices.
    got = drain(sched, [0, 1, 2, 3, 3, 3, 3])
    pieces = sorted(p for v in got.values() for p in v)
    assert pieces == [(i * 100, 100) for i in range(700)] + [(70000, 50)]
    assert len(got[0]) == 101 and len(got[3]) == 400


def test_dynamic_is_fifo_across_messages():
    sched = DynamicSchedule(2, chunk=100)
    a, b = job(150, tag=1), job(100, tag=2)
    sched.add(a)
    sched.add(b)
    seen = [sched.next_slice(0).job.tag for _ in range(3)]
    assert seen == [1, 1, 2] and sched.next_slice(1) is None


def test_static_even_split_one_piece_per_stream():
    sched = StaticSchedule(4, chunk=64 * 1024)
    n = 1 << 20
    sched.add(job(n))
    got = drain(sched, [0, 1, 2, 3])
    for s in range(4):
        assert sum(length for _, length in got[s]) == n // 4
        assert got[s][0][0] == s * n // 4  # stream s owns piece s, whatever its speed
    # A stream that never asks leaves its piece unsent: the straggler effect.
    sched.add(job(n))
    got = drain(sched, [0, 1, 2])
    assert sum(length for v in got.values() for _, length in v) == 3 * n // 4


def test_static_small_message_uses_fewer_pieces():
    sched = StaticSchedule(4, chunk=64 * 1024)
    sched.add(job(100 * 1024))  # < 2 * 64 KiB: one piece
    got = drain(sched, [0, 1, 2, 3])
    assert sum(len(v) for v in got.values()) == 2 and sum(1 for v in got.values() if v) == 1


def test_drain_returns_pending_jobs():
    for cls in (DynamicSchedule, StaticSchedule):
        sched = cls(2, 100)
        j = job(1000)
        sched.add(j)
        assert sched.drain() == [j]
        assert sched.next_slice(0) is None


def test_dynamic_cuts_a_message_into_several_slices_per_stream():
    """A 1 MiB message over 4 streams in 512 KiB chunks would be 2 slices: 2 streams idle and
    no room to balance.  It becomes 16 slices of 64 KiB; large messages keep the chunk size."""
    sched = DynamicSchedule(4, chunk=512 << 10)
    for total, size in ((1 << 20, 64 << 10), (64 << 20, 512 << 10), (4 << 20, 256 << 10), (10_000, 10_000)):
        sched.add(job(total))
        got = drain(sched, [0, 1, 2, 3])
        pieces = sorted(p for v in got.values() for p in v)
        assert pieces == [(off, min(size, total - off)) for off in range(0, total, size)]
        assert len(got[0]) == (len(pieces) + 3) // 4  # streams asking equally share equally


def test_one_stream_keeps_whole_chunks():
    """With a single stream there is nothing to balance: chunk-sized slices (fewer system calls)."""
    sched = DynamicSchedule(1, chunk=512 << 10)
    sched.add(job(1 << 20))
    assert drain(sched, [0]) == {0: [(0, 512 << 10), (512 << 10, 512 << 10)]}
