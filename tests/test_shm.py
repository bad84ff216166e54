"""Several ranks on one host: topology, the shared-memory transport and the collectives over it."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from redsock.bootstrap import FileStore, Topology, host_identity
from redsock.collectives import hierarchy
from redsock.errors import PeerFailure, Timeout, TransportError
from redsock.transport.connection import RELAY_GRACE_S
from redsock.transport.shm import LocalGroup
from test_collectives import digests, run_world


def _arenas() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("redsock-")}


def test_topology_groups_uneven_non_consecutive_hosts():
    idents = ["a", "b", "a", "c", "b", "a"]
    topo = [Topology.from_identities(r, idents, list(range(100, 106))) for r in range(6)]
    assert topo[0].hosts == ((0, 2, 5), (1, 4), (3,))
    assert [t.host for t in topo] == [0, 1, 0, 2, 1, 0]
    assert [t.local_rank for t in topo] == [0, 0, 1, 0, 1, 2]
    assert [t.local_size for t in topo] == [3, 2, 3, 1, 2, 3]
    assert topo[5].local_ranks == (0, 2, 5) and topo[5].pids[5] == 105
    assert topo[0].shards == 1 and topo[0].inter_host_group(0) == (0, 1, 3)
    two = Topology.from_identities(0, ["a", "b", "a", "b"], [0] * 4)
    assert two.shards == 2 and two.inter_host_group(1) == (2, 3)


def test_host_identity_is_boot_id_network_and_pid_namespaces():
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    assert host_identity() == f"{boot}/{os.stat('/proc/self/ns/net').st_ino}/{os.stat('/proc/self/ns/pid').st_ino}"


def _check_world(outs, world, least_digests=5 * 8 * 7 + 1):
    for r, (code, out, err) in enumerate(outs):
        assert code == 0 and out.rstrip().endswith("ok"), f"rank {r}:\n{err[-3000:]}"
    first = digests(outs[0][1])
    assert len(first) >= least_digests
    for r, (_, out, _) in enumerate(outs[1:], 1):
        assert digests(out) == first, f"rank {r} differs from rank 0"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_op_and_dtype_through_shared_memory(world):
    """1, 2 and 3 peers on one host: every op x dtype x size (several pieces) against numpy,
    bitwise identical on every rank, then reduce-scatter, all-gather, broadcast, barrier,
    async calls; nothing left in /dev/shm.  Large all-reduces go by cross-memory attach."""
    before = _arenas()
    outs = run_world("auto_matrix", world,
                     env={"TEST_EXPECT_HIER": "1", "TEST_EXPECT_PATH": "cma", "REDSOCK_SHM_CMA": "auto"})
    _check_world(outs, world)
    assert _arenas() <= before


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_that_pass_a_small_sync_late_copy_the_result_left_for_them(world):
    """The whole-buffer path: the first ranks past the sync reduce and leave the result in
    the arena, the later ones copy it; with a rank late in turn and fresh data every call, every
    result is exact and the same bits everywhere (a stale or torn result would show)."""
    outs = run_world("late_ranks_copy_the_result", world, timeout=120)
    for r, (code, out, err) in enumerate(outs):
        assert code == 0 and out.rstrip().endswith("ok"), f"rank {r}:\n{err[-3000:]}"
    assert all(digests(out) == digests(outs[0][1]) for _, out, _ in outs)
    assert len(digests(outs[0][1])) == 100


def test_one_piece_arena_calls_reuse_their_half_only_after_themselves():
    """A one-piece all-reduce through the arena that follows one of the same plan goes
    through the same half (one half stays in the caches): with a late rank still reading the
    last call, the others' next call must write nothing it reads; any other piece between
    (another shape, a call in several pieces, the whole-buffer path) moves the next one to
    the other half."""
    outs = run_world("arena_halves_under_a_late_rank", 3, env={"REDSOCK_SHM_CMA": "off"}, timeout=120)
    for r, (code, out, err) in enumerate(outs):
        assert code == 0 and out.rstrip().endswith("ok"), f"rank {r}:\n{err[-3000:]}"


@pytest.mark.parametrize("env", [{"REDSOCK_SHM_CMA": "off"}, {"TEST_REFUSE_CMA": "2", "REDSOCK_SHM_CMA": "auto"}], ids=["off", "refused"])
def test_large_all_reduces_go_through_the_arena_without_cross_memory_attach(env):
    """Switched off, or refused by one rank's kernel (every rank then agrees on the arena):
    the same matrix, right and bitwise identical, through the arena."""
    before = _arenas()
    outs = run_world("auto_matrix", 3, env={"TEST_EXPECT_HIER": "1", "TEST_EXPECT_PATH": "arena", **env})
    _check_world(outs, 3)
    assert _arenas() <= before


def test_either_way_all_ranks_take_the_same_way_every_call():
    """Local rank 0 moves each shape between the arena and cross-memory attach (here every
    few calls) and the others follow its word: every call right, the same bits on every rank,
    both ways taken; ranks that took different ways would raise, never mix data."""
    before = _arenas()
    outs = run_world("either_way", 4, timeout=120)
    _check_world(outs, 4, least_digests=200)
    assert _arenas() <= before
    outs = run_world("ways_told_late", 4, timeout=120)
    _check_world(outs, 4, least_digests=40)
    outs = run_world("ways_differ", 3, timeout=60)
    for code, out, err in outs:
        assert code == 0 and out.rstrip().endswith("ok"), err[-2000:]
        assert "different dtype, size or op" in out, out


def test_shm_off_passes_everything_over_fast_socket():
    outs = run_world("auto_matrix", 3, env={"REDSOCK_SHM": "off", "TEST_EXPECT_HIER": "0"})
    _check_world(outs, 3)


@pytest.mark.parametrize("differs", ["size", "op", "dtype"])
def test_mismatched_calls_on_one_host_raise_clearly(differs):
    """Rank 1 calls a small all-reduce of another size, op or dtype: every rank raises."""
    outs = run_world("shm_mismatch", 3, timeout=60, env={"TEST_DIFFERS": differs})
    for code, out, err in outs:
        assert code == 0, err[-2000:]
        assert "different dtype, size or op" in out, out


def test_a_prepared_shape_keeps_every_check():
    """Calls of a shape that ran before take a short way (its plan is kept): bad arrays of that
    shape still raise ConfigError on every rank, and good ones still sum right, alike everywhere."""
    outs = run_world("shm_checks_after_a_plan", 3, timeout=60)
    for r, (code, out, err) in enumerate(outs):
        assert code == 0 and out.rstrip().endswith("ok"), f"rank {r}:\n{err[-3000:]}"
        for what in ("strided", "fortran", "read-only", "a list", "an unknown op"):
            assert f"{what}: ConfigError" in out, out
        assert "not C-contiguous" in out and "read-only" in out and "unsupported reduction op" in out
    assert digests(outs[1][1]) == digests(outs[0][1]) == digests(outs[2][1])


@pytest.mark.parametrize("count, cma", [(2, "auto"), (8 << 20, "auto"), (8 << 20, "off")])
def test_killed_local_rank_makes_the_others_raise_peer_failure(count, cma):
    """kill -9 of a rank mid-collective (small and large all-reduces, by cross-memory attach
    and through the arena): the others raise PeerFailure naming it, quickly (its pidfd wakes
    them, or the kernel says it is gone), and no arena is left behind."""
    world = 4
    before = _arenas()
    t0 = time.monotonic()
    outs = run_world("dies_auto", world, timeout=60,
                     env={"TEST_TIMEOUT_S": "20", "TEST_COUNT": str(count), "REDSOCK_SHM_CMA": cma})
    assert time.monotonic() - t0 < 30
    assert outs[-1][0] == -9  # it really died
    for r, (code, out, err) in enumerate(outs[:-1]):
        assert code == 0, f"rank {r}:\n{err[-3000:]}"
        assert f"ranks=[{world - 1}]" in out, f"rank {r} did not name the dead rank: {out}"
        assert float(out.split(" after ")[1].split("s")[0]) < 5, out
    assert _arenas() <= before


@pytest.mark.parametrize("me", [0, 1])
def test_local_rank_that_dies_before_attaching_is_named_at_once(tmp_path, me):
    """Local rank 0 waits for the others to attach, and they wait for its arena's name: a
    peer that exits first is named within a second, not at the store's timeout (60 s here),
    and the arena it would have used is gone."""
    before = _arenas()
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])  # never attaches
    pids = (os.getpid(), peer.pid) if me == 0 else (peer.pid, os.getpid())
    t0 = time.monotonic()
    try:
        with pytest.raises(PeerFailure, match="died .* before the ranks of this host attached") as e:
            LocalGroup(FileStore(tmp_path, timeout_s=60), "shm/0", (10, 11), me, pids,
                       region_bytes=4096, timeout_s=60, spin_us=0)
    finally:
        peer.wait()
    assert e.value.ranks == (11 - me,)
    assert time.monotonic() - t0 < 5
    assert _arenas() <= before


def _pair(tmp_path, timeout_s):
    """Two local ranks (world ranks 10 and 11) of one host, in this process."""
    store, made = FileStore(tmp_path, timeout_s=30), {}

    def make(me):
        made[me] = LocalGroup(store, "shm/0", (10, 11), me, (os.getpid(), os.getpid()), region_bytes=4096,
                              timeout_s=timeout_s, spin_us=0)

    t = threading.Thread(target=make, args=(1,))
    t.start()
    make(0)
    t.join(30)
    return made[0], made[1]


def test_the_result_region_is_shared_and_apart_from_every_ranks_regions(tmp_path):
    """LocalGroup.result: what one rank leaves there (and the step it wrote), the other reads,
    and no rank's regions (either half, filled to the end) overlap it."""
    a, b = _pair(tmp_path, timeout_s=30)
    try:
        n = a.region_bytes // 8
        for g in (a, b):
            for half in (0, 1):
                g.rows(half, np.dtype(np.int64), n)[g.me] = 100 * g.me + half
        a.result(np.dtype(np.int64), n)[:] = np.arange(n)
        a.result_step[0] = a.step
        assert b.result_step[0] == b.step == a.step
        assert np.array_equal(b.result(np.dtype(np.int64), n), np.arange(n))
        for g in (a, b):
            for half in (0, 1):
                assert (g.rows(half, np.dtype(np.int64), n) == np.array([[half], [100 + half]])).all()
    finally:
        a.close()
        b.close()


def test_a_local_rank_busy_elsewhere_is_given_the_relay_grace_before_it_is_blamed(tmp_path):
    """Rank 11 is alive but held up in its inter-host step by a remote rank that stopped: rank
    10's wait in shared memory times out first, and must wait the relay grace for 11's word
    (whom it found failed) rather than blame 11 (the fault matrix's hier-reducers / worker
    SIGSTOP: a local rank named its host-mate).  A peer that says nothing is blamed after it."""
    limit = 2.0
    grace = min(limit, RELAY_GRACE_S)  # one more period, at most the relay grace (no stacked timeouts)
    a, b = _pair(tmp_path, timeout_s=limit)
    try:
        timer = threading.Timer(limit + grace / 2, b.abort, args=("[failed ranks: 7] rank 11 gives up: rank 7 stopped",))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=r"\[failed ranks: 7\]") as e:
            a.sync(timeout_s=limit)
        assert not isinstance(e.value, Timeout) and time.monotonic() - t0 < limit + grace
        timer.join()
    finally:
        a.close()
        b.close()
    a, b = _pair(tmp_path / "quiet", timeout_s=limit)
    try:
        t0 = time.monotonic()
        with pytest.raises(Timeout, match=r"local rank\(s\) \[11\] did not arrive"):
            a.sync(timeout_s=limit)
        assert limit + grace - 0.1 < time.monotonic() - t0 < limit + grace + 1.0
    finally:
        a.close()
        b.close()


def test_a_stopped_local_rank_is_named_at_the_timeout(tmp_path):
    """A host-mate stopped by SIGSTOP is held up by nobody: named at the timeout, no grace."""
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(peer.pid, signal.SIGSTOP)
        store, made = FileStore(tmp_path, timeout_s=30), {}
        pids = (os.getpid(), peer.pid)
        t = threading.Thread(target=lambda: made.setdefault(1, LocalGroup(
            store, "shm/0", (10, 11), 1, (os.getpid(), os.getpid()), region_bytes=4096, timeout_s=1.0, spin_us=0)))
        t.start()
        a = LocalGroup(store, "shm/0", (10, 11), 0, pids, region_bytes=4096, timeout_s=1.0, spin_us=0)
        t.join(30)
        try:
            t0 = time.monotonic()
            with pytest.raises(Timeout, match=r"local rank\(s\) \[11\] did not arrive"):
                a.sync(timeout_s=1.0)
            assert time.monotonic() - t0 < 1.0 + RELAY_GRACE_S / 2
        finally:
            a.close()
            made[1].close()
    finally:
        peer.kill()
        peer.wait()


_GIVES_UP = """
import sys
import numpy as np
from redsock.bootstrap import FileStore
from redsock.transport.shm import LocalGroup
g = LocalGroup(FileStore(sys.argv[1], timeout_s=30), "shm/0", (10, 11), 1, (int(sys.argv[2]), __import__("os").getpid()),
               region_bytes=4096, timeout_s=30, spin_us=0)
buf = np.ones(1024, np.uint8)
g.publish(buf)
g.sync()
sys.stdin.readline()  # rank 10 is past the sync: now rank 11 learns of rank 7's failure, says so, exits
g.abort("[failed ranks: 7] rank 11 gives up: rank 7 died")
g.close()
"""


def test_a_host_mate_that_gave_up_and_exited_is_not_blamed(tmp_path):
    """Rank 11 found rank 7 dead, left that word in the arena and exited (its process is gone)
    while rank 10 still copies its memory: rank 10 passes on rank 11's word (rank 7), not
    "rank 11 died" (the CI's 8 MiB kill test: a host-mate that had diagnosed the dead rank
    was named instead of it).  The word is written before the exit, so it is read first."""
    peer = subprocess.Popen([sys.executable, "-c", _GIVES_UP, str(tmp_path), str(os.getpid())],
                            stdin=subprocess.PIPE, text=True)
    a = None
    try:
        a = LocalGroup(FileStore(tmp_path, timeout_s=30), "shm/0", (10, 11), 0, (os.getpid(), peer.pid),
                       region_bytes=4096, timeout_s=30, spin_us=0)
        assert a.cma  # (this machine allows cross-memory attach: the CI runs as root)
        mine = np.zeros(1024, np.uint8)
        a.publish(mine)
        a.sync()
        peer.communicate("go\n", timeout=30)
        assert peer.returncode == 0
        for attempt in (lambda: a.read_from(1, 0, mine), lambda: a.write_to(1, 0, mine), a.sync):
            with pytest.raises(TransportError, match=r"\[failed ranks: 7\] rank 11 gives up") as e:
                attempt()
            assert not isinstance(e.value, PeerFailure), e.value
    finally:
        if a is not None:
            a.close()
        peer.kill()
        peer.wait()


def test_no_arena_left_after_an_exception_or_close():
    before = _arenas()
    outs = run_world("raises", 3, timeout=60)
    assert all(code == 1 and "the training script fails" in err for code, _, err in outs)
    assert _arenas() <= before
    outs = run_world("closes", 3, timeout=60)
    for code, out, err in outs:
        assert code == 0 and out.rstrip().endswith("ok"), err[-2000:]
    assert _arenas() <= before


class _Told:
    """The arena's table of told words, as local rank 0 and its peers see it (one process)."""

    def __init__(self):
        self.words: dict[int, int] = {}

    def tell(self, slot, word):
        self.words[slot] = word

    def told(self, slot):
        return self.words.get(slot, 0)


class _Rank0:
    """Local rank 0's choice of way, on the table above."""
    _choose_way = hierarchy.Hierarchy._choose_way
    _tell = hierarchy.Hierarchy._tell

    def __init__(self):
        self.local = _Told()


def _calls(per_way_s, n, start_way=1, warm_cost_s=(0.0, 0.0)):
    """``n`` calls of one shape as :meth:`Hierarchy._reduce_either` makes them, each way
    costing ``per_way_s`` (seconds; or a function of the call's number that says them), and
    the first calls after a change of way more: the k-th ``warm_cost_s / k**2`` more (each
    way warms up over calls): the ways taken and the calls timed."""
    rank0, w = _Rank0(), hierarchy._Ways(7, way=start_way)
    ways, timed, previous, run = [], [], start_way, 0
    costs = per_way_s if callable(per_way_s) else lambda call: per_way_s
    for call in range(n):
        per_way_s = costs(call)
        said = rank0.local.told(w.ident % hierarchy.TOLD_SLOTS)
        if said >> 1 == w.ident:
            w.way = said & 1
        run = run + 1 if w.way == previous else 1
        rank0._choose_way(w)  # (between the call's syncs)
        cost = per_way_s[w.way] + warm_cost_s[w.way] / run**2
        if w.timed:
            w.times[w.way].append(cost)
            timed.append(len(ways))
        ways.append(w.way)
        previous = w.way
    return ways, timed


def test_a_trial_takes_the_ways_in_runs_and_times_the_warm_calls_of_each():
    """Every PROBE_EVERY calls (first at the FIRST_TRIAL_AFTER-th) local rank 0 tries the
    other way: the two ways in turn, runs of TRIAL_RUN_CALLS calls, only the calls after each
    run's first TRIAL_WARM_CALLS timed (they pay what the previous way left over); the calls
    move only if the other way's best beat this one's by SWITCH_MARGIN."""
    run, warm, runs = hierarchy.TRIAL_RUN_CALLS, hierarchy.TRIAL_WARM_CALLS, hierarchy.TRIAL_RUNS
    start = hierarchy.FIRST_TRIAL_AFTER - 1  # (the trial's first call, on the way in use)
    judged = start + runs * run + 1  # (the call after the trial, back on the way in use)
    # cross-memory attach (1) in use; the arena (0) 20% faster once warm, but slow to warm
    # after the other way's calls (1.6, 1.0, 0.89, 0.85: as measured, the arena's halves cold),
    # cross-memory attach quick (1.1, 1.025, ...): a second call timed would keep cross-memory attach
    ways, timed = _calls((0.8, 1.0), judged + 5, warm_cost_s=(0.8, 0.1))
    assert ways[:start + 1] == [1] * (start + 1)
    assert ways[start + 1:judged] == ([0] * run + [1] * run) * (runs // 2)
    assert timed == [c for c in range(start + 1, judged) if (c - start - 1) % run >= warm]
    assert ways[judged:] == [1, 0, 0, 0, 0]  # the arena from the call after the judging one
    # 5% faster is within the margin: the calls stay; 15% slower: they stay too
    for other in (0.95, 1.15):
        ways, _ = _calls((other, 1.0), judged + 5)
        assert ways[judged:] == [1] * 5
    # and the next trial PROBE_EVERY calls later
    again = judged + hierarchy.PROBE_EVERY
    ways, _ = _calls((1.2, 1.0), again + 3)
    assert set(ways[judged:again + 1]) == {1} and ways[again + 1:] == [0, 0]


def _trial_starts(timed):
    """The first timed call of each trial (every trial times the same number of calls)."""
    per_trial = hierarchy.TRIAL_RUNS * (hierarchy.TRIAL_RUN_CALLS - hierarchy.TRIAL_WARM_CALLS)
    return timed[::per_trial]


def test_trials_grow_apart_while_the_other_way_loses_clearly():
    """A trial whose challenger's best took CLEAR_LOSS x the incumbent's or more doubles the
    calls until the next one, up to PROBE_EVERY_MAX: a way that keeps losing clearly costs
    ever fewer calls.  A closer outcome brings them back to PROBE_EVERY, and a switch too."""
    every, most = hierarchy.PROBE_EVERY, hierarchy.PROBE_EVERY_MAX
    assert hierarchy.CLEAR_LOSS > 1 / hierarchy.SWITCH_MARGIN and most > 4 * every
    doublings = (most // every).bit_length() - 1
    n = sum(every << k for k in range(doublings + 1)) + 3 * most

    def gaps(per_way_s, calls=n):
        """The calls from each trial to the next, by the call the first starts at, and the
        way the last call took."""
        ways, timed = _calls(per_way_s, calls)
        starts = _trial_starts(timed)
        return {a: b - a for a, b in zip(starts, starts[1:])}, ways[-1]

    close = list(gaps((hierarchy.CLEAR_LOSS * 0.99, 1.0))[0].values())  # (a loss, not a clear one: trials stay PROBE_EVERY apart)
    assert len(set(close)) == 1
    trial = close[0] - every  # (a trial's own calls)
    clear = list(gaps((hierarchy.CLEAR_LOSS, 1.0))[0].values())  # (the arena, 0, clearly slower than cross-memory attach)
    grown = [every << k for k in range(1, doublings + 1)] + [most] * 3
    assert clear == [trial + e for e in grown][:len(clear)] and len(clear) >= doublings + 2
    # clearly slower until call 2000, then only a little: the next trial comes PROBE_EVERY later again
    turn = 2000

    def costs(call):
        return (2.0 if call < turn else 1.2, 1.0)

    apart, _ = gaps(costs, 4000)
    after = [g for a, g in apart.items() if a > turn]
    assert max(apart.values()) > close[0] and after and set(after) == {close[0]}

    # and a switch after clear losses (the arena clearly slower until call 2000, then 20% faster:
    # cross-memory attach then loses, not clearly)
    def flip(call):
        return (2.0 if call < turn else 0.8, 1.0)

    apart, last_way = gaps(flip, 4000)
    after = [g for a, g in apart.items() if a > turn]
    assert last_way == 0 and max(apart.values()) > close[0] and after and set(after) == {close[0]}
