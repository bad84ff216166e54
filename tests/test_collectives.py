"""Collectives with real processes: every op x dtype x world size against numpy references."""

import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from redsock.bench.procs import start_logged, wait_logged

WORKER = Path(__file__).parent / "collective_worker.py"


def run_world(scenario, world, timeout=240, env=None):
    """Run `scenario` on `world` ranks; returns (returncode, stdout, stderr) per rank.  They meet
    through a FileStore in a temporary directory (test_stopped_rank... uses torch's TCPStore)."""
    with tempfile.TemporaryDirectory(prefix="redsock-store-") as store:
        procs = [start_logged([sys.executable, str(WORKER), scenario, str(r), str(world), store],
                              env={**__import__("os").environ, **(env or {})})
                 for r in range(world)]
        try:
            outs = wait_logged(procs, timeout)
        finally:
            for p in procs:
                p.kill()
                p.wait()
    return outs


def digests(out):
    return [line for line in out.splitlines() if line.startswith("digest")]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_all_reduce_matrix(world):
    outs = run_world("matrix", world)
    for r, (code, out, err) in enumerate(outs):
        assert code == 0 and out.rstrip().endswith("ok"), f"rank {r}:\n{err[-3000:]}"
    first = digests(outs[0][1])
    assert len(first) == 2 * 5 * 8 * 6
    for r, (_, out, _) in enumerate(outs[1:], 1):
        assert digests(out) == first, f"rank {r} differs from rank 0"


@pytest.mark.parametrize("world", [1, 3, 4])
def test_other_collectives(world):
    outs = run_world("others", world)
    for r, (code, out, err) in enumerate(outs):
        assert code == 0 and out.rstrip().endswith("ok"), f"rank {r}:\n{err[-3000:]}"
    assert len({tuple(digests(out)) for _, out, _ in outs}) == 1


@pytest.mark.parametrize("scenario, expect", [("mismatch", "different dtype, size or op"), ("dtype_mismatch", "different dtype, size or op")])
def test_mismatched_calls_raise_clearly(scenario, expect):
    outs = run_world(scenario, 3, timeout=60)
    raised = [out for code, out, _ in outs if "raised" in out]
    assert raised, [err[-2000:] for _, _, err in outs]
    assert any(expect in out for out in raised)
    for code, out, err in outs:
        assert code == 0, err[-2000:]


def _raised_after(out: str) -> float:
    """Seconds from the call to its PeerFailure, as a worker prints them."""
    return float(out.split("raised PeerFailure", 1)[1].split(" after ", 1)[1].split("s:", 1)[0])


def test_dead_rank_makes_the_others_raise_peer_failure():
    world = 4
    t0 = time.monotonic()
    outs = run_world("dies", world, timeout=60, env={"TEST_TIMEOUT_S": "10"})
    assert time.monotonic() - t0 < 40
    assert outs[-1][0] == 9  # it really died
    for r, (code, out, err) in enumerate(outs[:-1]):
        assert code == 0, f"rank {r}:\n{err[-3000:]}"
        assert f"ranks=[{world - 1}]" in out, f"rank {r} did not name the dead rank: {out}"
        # Dead before or after its connections opened (refused, or reset): known at once, not
        # at the timeout (a refused connection was retried until the timeout: 9.7 s of 10).
        assert _raised_after(out) < 5, out


def test_rank_that_exits_before_connecting_is_named_before_the_timeout():
    """Rank 0 opens every connection it has (the lower rank connects): when it exits first,
    the ranks waiting for it find its listener gone (they probe it) instead of waiting 30 s."""
    world = 3
    outs = run_world("first_exits", world, timeout=90, env={"TEST_TIMEOUT_S": "30"})
    assert outs[0][0] == 9
    for r, (code, out, err) in enumerate(outs[1:], 1):
        assert code == 0, f"rank {r}:\n{err[-3000:]}"
        assert "ranks=[0]" in out, f"rank {r} did not name rank 0: {out}"
        assert _raised_after(out) < 10, out


def test_stopped_rank_is_detected_by_the_timeout():
    """SIGSTOP one rank mid-loop: the others raise PeerFailure naming it within timeout + 5 s."""
    import os
    import signal

    from torch.distributed import TCPStore

    world, timeout_s = 3, 5
    store = TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    procs = [subprocess.Popen([sys.executable, str(WORKER), "ring_loop", str(r), str(world), str(store.port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "TEST_TIMEOUT_S": str(timeout_s)}) for r in range(world)]
    try:
        assert procs[2].stdout.readline().strip() == "looping"
        procs[2].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        for r in (0, 1):
            out, err = procs[r].communicate(timeout=timeout_s + 30)
            assert procs[r].returncode == 0, err[-3000:]
            assert "ranks=[2]" in out, out
        assert time.monotonic() - t0 < timeout_s + 5
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_call_timeout_applies_inside_its_block_only():
    from redsock.collectives.context import call_timeout, timeout_for_call

    assert timeout_for_call(60.0) == 60.0
    with call_timeout(2.0):
        assert timeout_for_call(60.0) == 2.0
        with call_timeout(None):  # unset (torch's negative default): the communicator's
            assert timeout_for_call(60.0) == 60.0
        assert timeout_for_call(60.0) == 2.0
    with call_timeout(-0.001):
        assert timeout_for_call(60.0) == 60.0
    assert timeout_for_call(60.0) == 60.0


def test_connections_sharing_a_link_split_its_streams():
    from redsock.config import Config

    four = Config(nsocks=4)
    assert [four.sharing_link(n).nsocks for n in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]


def test_file_store_sets_whole_values_and_times_out_naming_the_key(tmp_path):
    from redsock.bootstrap import FileStore
    from redsock.errors import Timeout

    a, b = FileStore(tmp_path / "s", timeout_s=0.3), FileStore(tmp_path / "s", timeout_s=5)
    a.set("redsock/0/addr/1", "10.0.0.1:4000")
    a.set("blob", bytes(range(256)) * 1000)
    assert b.get("redsock/0/addr/1") == b"10.0.0.1:4000" and b.get("blob") == bytes(range(256)) * 1000
    assert b.check(["blob", "redsock/0/addr/1"]) and not b.check(["blob", "missing"])
    later = threading.Timer(0.2, lambda: a.set("late", b"x"))
    later.start()
    assert b.get("late") == b"x"  # waits for a key set later
    t0 = time.monotonic()
    with pytest.raises(Timeout, match="'missing' not set within 0.3 s"):
        a.get("missing")
    assert 0.3 <= time.monotonic() - t0 < 2
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == sorted(["blob", "late", "redsock%2F0%2Faddr%2F1"])


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 4096, 4097, 8191, 8192, 8193, 100_000, 1 << 20, (1 << 20) + 3])
def test_ramped_pieces_cover_the_range_growing_then_shrinking(n):
    """The hierarchy's pipeline pieces: contiguous, covering [start, end) exactly, none above the
    largest, doubling from the smallest at the start and halving back at the end."""
    from redsock.collectives.context import ramped_chunks

    start, largest, smallest = 5, 4096, 512
    pieces = ramped_chunks(start, start + n, largest, smallest)
    assert pieces[0][0] == start and pieces[-1][1] == start + n
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    sizes = [hi - lo for lo, hi in pieces]
    assert max(sizes) <= largest and (n == 0 or min(sizes) > 0)
    k = 0  # the ramp: smallest, 2 x smallest, ... below largest, as long as it fits at both ends
    while smallest << k < largest and 2 * (smallest * ((1 << (k + 1)) - 1)) <= n:
        k += 1
    head = [smallest << i for i in range(k)]
    assert sizes[:k] == head and sizes[len(sizes) - k:] == head[::-1]
    middle = sizes[k:len(sizes) - k]
    if n - 2 * sum(head):
        assert len(middle) == -(-(n - 2 * sum(head)) // largest) and max(middle) - min(middle) <= 1
    if n >= 2 * (512 + 1024 + 2048):
        assert k == 3


@pytest.mark.parametrize("world", [2, 3])
def test_wire_dtype_ring_and_small(world):
    """16-bit wires through ring and small (loopback, one rank per host): within the bound,
    bitwise identical ranks, refusals and fp16 overflow on every rank."""
    outs = run_world("wire_matrix", world)
    for r, (code, out, err) in enumerate(outs):
        assert code == 0 and out.rstrip().endswith("ok"), f"rank {r}:\n{err[-3000:]}"
    first = digests(outs[0][1])
    assert len(first) == 2 * 3 * 2 * 4
    for r, (_, out, _) in enumerate(outs[1:], 1):
        assert digests(out) == first, f"rank {r} differs from rank 0"
