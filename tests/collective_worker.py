"""One rank of a multi-process collective test: ``python collective_worker.py SCENARIO RANK WORLD STORE``.

Asserts its own results against numpy references and prints ``digest <hex>`` lines
so the test can check that every rank ended with the same bits.
"""

import os
import sys
import threading
import time
import zlib
from datetime import timedelta

import numpy as np

import redsock
from redsock import ops
from redsock.bench.allreduce import count_wrong, make_input, reference
from redsock.bootstrap import FileStore
from redsock.collectives.communicator import SERVER_MIN_BYTES
from redsock.errors import ConfigError, PeerFailure, RedsockError, WireOverflow

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]
OPS = ["sum", "avg", "min", "max", "prod"]
SIZES = [0, 1, 7, 1000, 65537, 300_001]


def digest(a):
    print(f"digest {zlib.crc32(a.tobytes()):08x}", flush=True)


def matrix(comm, rank, world):
    for algo in ("small", "ring"):
        for opname in OPS:
            op = ops.ReduceOp.parse(opname)
            for dname in DTYPES:
                dt = ops.dtype_from_name(dname)
                for n in SIZES:
                    x = make_input(n, dt, op, rank, 3)
                    comm.all_reduce(x, opname, algorithm=algo)
                    wrong = count_wrong(x, reference(n, dt, op, world, 3))
                    assert wrong == 0, f"{algo} {opname} {dname} n={n}: {wrong} wrong"
                    digest(x)


def others(comm, rank, world):
    # reduce_scatter: segment `rank` of the elementwise sum
    for dname in ("float32", "bfloat16", "int32"):
        dt = ops.dtype_from_name(dname)
        ins = [(np.arange(world * 1001) % 13 + r).astype(dt) for r in range(world)]
        out = np.empty(1001, dt)
        comm.reduce_scatter(ins[rank], out, "sum")
        ref = np.sum([a.astype(np.float64) for a in ins], axis=0)[rank * 1001:(rank + 1) * 1001]
        assert count_wrong(out, ref) == 0, dname
        digest(out)
    # all_gather: every rank's input in rank order
    for n in (0, 3, 70001):
        x = (np.arange(n) + 1000 * rank).astype(np.int64)
        out = np.empty(n * world, np.int64)
        comm.all_gather(x, out)
        assert np.array_equal(out, np.concatenate([np.arange(n) + 1000 * r for r in range(world)]))
    # broadcast from every root, small and large
    for root in range(world):
        for n in (5, 1 << 20):
            x = np.full(n, rank, np.float64)
            comm.broadcast(x, root)
            assert np.all(x == root)
    # point to point: a ring of messages with two tags
    right, left = (rank + 1) % world, (rank - 1) % world
    if world > 1:
        out_a, out_b = np.empty(10, np.int32), np.empty(1 << 18, np.float32)
        if rank % 2 == 0:
            comm.send(np.full(10, rank, np.int32), right, tag=1)
            comm.send(np.full(1 << 18, rank, np.float32), right, tag=2)
            comm.recv(out_b, left, tag=2)
            comm.recv(out_a, left, tag=1)
        else:
            comm.recv(out_b, left, tag=2)
            comm.recv(out_a, left, tag=1)
            comm.send(np.full(10, rank, np.int32), right, tag=1)
            comm.send(np.full(1 << 18, rank, np.float32), right, tag=2)
        assert np.all(out_a == left) and np.all(out_b == left)
    # several async all-reduces in flight, then a sync one
    xs = [np.full(n, rank + i, np.float32) for i, n in enumerate((3, 1 << 16, 1 << 20, 17))]
    works = [comm.all_reduce(x, async_op=True) for x in xs]
    y = np.ones(5, np.int64)
    comm.all_reduce(y)
    for w in works:
        w.wait(30)
    for i, x in enumerate(xs):
        assert np.all(x == sum(r + i for r in range(world))), i
    assert np.all(y == world)
    comm.barrier()
    digest(np.concatenate(xs))


def mismatch(comm, rank, world):
    x = np.ones(1000 if rank != 1 else 1001, np.float32)
    try:
        comm.all_reduce(x, algorithm="ring")
    except RedsockError as e:
        print(f"raised {type(e).__name__}: {e}", flush=True)
        return
    raise AssertionError("a size mismatch went unnoticed")


def dtype_mismatch(comm, rank, world):
    x = np.ones(1000, np.float32 if rank != 0 else np.int32)
    try:
        comm.all_reduce(x, algorithm="small")
    except RedsockError as e:
        print(f"raised {type(e).__name__}: {e}", flush=True)
        return
    raise AssertionError("a dtype mismatch went unnoticed")


def dies(comm, rank, world):
    comm.barrier()
    if rank == world - 1:
        threading.Timer(0.05, lambda: os._exit(9)).start()  # die mid-collective
    x = np.ones(8 << 20, np.float32)
    t0 = time.monotonic()
    try:
        for _ in range(100):
            comm.all_reduce(x, algorithm="ring")
    except PeerFailure as e:
        print(f"raised PeerFailure ranks={list(e.ranks)} after {time.monotonic() - t0:.1f}s: {e}", flush=True)
        return
    raise AssertionError("a dead rank went unnoticed")


def first_exits(comm, rank, world):
    """Rank 0 exits before it opens any connection: the ranks waiting for it to connect (the
    lower rank always connects) must hear of it well before the timeout."""
    comm.barrier()
    if rank == 0:
        os._exit(9)
    t0 = time.monotonic()
    try:
        comm.all_reduce(np.ones(1 << 20, np.float32), algorithm="ring")
    except PeerFailure as e:
        print(f"raised PeerFailure ranks={list(e.ranks)} after {time.monotonic() - t0:.1f}s: {e}", flush=True)
        return
    raise AssertionError("an exited rank went unnoticed")


def server_matrix(comm, rank, world):
    """Every op x dtype through the reduction servers (REDSOCK_SERVERS from the test)."""
    for opname in OPS:
        op = ops.ReduceOp.parse(opname)
        for dname in DTYPES:
            dt = ops.dtype_from_name(dname)
            for n in (1, 7, 65537, 300_001):
                x = make_input(n, dt, op, rank, 5)
                comm.all_reduce(x, opname, algorithm="server")
                wrong = count_wrong(x, reference(n, dt, op, world, 5))
                assert wrong == 0, f"server {opname} {dname} n={n}: {wrong} wrong"
                digest(x)


def server_async(comm, rank, world):
    """Several all-reduces in flight at once through the servers, then repeated for a while."""
    for rep in range(int(os.environ.get("TEST_REPS", "3"))):
        xs = [np.full(n, rank + i + rep, np.float32) for i, n in enumerate((5, 1 << 18, 3 << 20, 1000))]
        works = [comm.all_reduce(x, algorithm="server", async_op=True) for x in xs]
        for w in works:
            w.wait(60)
        for i, x in enumerate(xs):
            assert np.all(x == sum(r + i + rep for r in range(world))), (rep, i)
    digest(xs[2])


def server_sync_among_async(comm, rank, world):
    """Small synchronous all-reduces while asynchronous ones are in flight on the same reducer
    connections (their results arrive on the control stream the synchronous caller reads), and
    calls that some ranks make synchronously and the others asynchronously."""
    for rep in range(4):
        xs = [np.full(n, rank + i + rep, np.int64) for i, n in enumerate((3, 1000, 70_000))]
        works = [comm.all_reduce(x, algorithm="server", async_op=True) for x in xs]
        for i, n in enumerate((1, 125, 1000)):  # 8 B, 1000 B, 8000 B
            y = np.full(n, (rank + 1) * (i + 2) + rep, np.int64)
            comm.all_reduce(y, algorithm="server")
            assert np.all(y == sum((r + 1) * (i + 2) + rep for r in range(world))), (rep, n)
        z = np.full(500, 2 * rank - rep, np.float64)
        w = comm.all_reduce(z, algorithm="server", async_op=rank % 2 == 0)
        if w is not None:
            w.wait(60)
        assert np.all(z == sum(2 * r - rep for r in range(world))), rep
        for w in works:
            w.wait(60)
        for i, x in enumerate(xs):
            assert np.all(x == sum(r + i + rep for r in range(world))), (rep, i)
    digest(z)


def server_overlap(comm, rank, world):
    """Rank 0 starts two async all-reduces at once; the last rank joins only when the test has
    seen the second call reach the reducer (TEST_GO_FILE), i.e. before the first one's results."""
    if rank == world - 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.environ["TEST_GO_FILE"]) and time.monotonic() < deadline:
            time.sleep(0.01)
    xs = [np.full(1000, rank + 10 * i, np.int64) for i in range(2)]
    works = [comm.all_reduce(x, algorithm="server", async_op=True) for x in xs]
    for w in works:
        w.wait(60)
    for i, x in enumerate(xs):
        assert np.all(x == sum(r + 10 * i for r in range(world))), i


def server_deterministic(comm, rank, world):
    """Random float32 data: with REDSOCK_DETERMINISTIC=1 the bits repeat across runs."""
    x = np.random.default_rng(rank).standard_normal(1 << 18).astype(np.float32)
    comm.all_reduce(x, algorithm="server")
    digest(x)


def server_worker_dies(comm, rank, world):
    x = np.ones(4 << 20, np.float32)
    comm.all_reduce(x, algorithm="server")
    if rank == world - 1:
        threading.Timer(0.05, lambda: os._exit(9)).start()
    t0 = time.monotonic()
    try:
        for _ in range(200):
            comm.all_reduce(x, algorithm="server")
    except PeerFailure as e:
        print(f"raised PeerFailure ranks={list(e.ranks)} after {time.monotonic() - t0:.1f}s: {e}", flush=True)
        return
    raise AssertionError("a dead worker went unnoticed")


def server_loop(comm, rank, world):
    """All-reduce until the test kills a reducer: must raise, naming it, not hang."""
    x = np.ones(1 << 20, np.float32)
    print("looping", flush=True)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 60:
            comm.all_reduce(x, algorithm="server")
    except PeerFailure as e:
        # (wall-clock time too: the test compares it with when it stopped the reducer)
        print(f"raised PeerFailure after {time.monotonic() - t0:.1f}s at {time.time():.3f}: {e}", flush=True)
        return
    raise AssertionError("a dead reducer went unnoticed")


def server_fallback(comm, rank, world):
    """Keep all-reducing while the test kills a reducer (and restarts it): every result correct.
    Says it is looping with TEST_STOP_FILE.looping; stops once the test creates TEST_STOP_FILE
    (or after TEST_SECONDS)."""
    n = 1 << 20
    print("looping", flush=True)
    t0 = time.monotonic()
    i = 0
    stop = np.zeros(1, np.uint8)
    while not stop[0]:
        x = np.full(n, rank + i, np.float32)
        comm.all_reduce(x, algorithm="server")
        assert np.all(x == sum(r + i for r in range(world))), i
        if i == 0 and rank == 0 and "TEST_STOP_FILE" in os.environ:
            open(os.environ["TEST_STOP_FILE"] + ".looping", "w").close()  # the test may kill a reducer now
        i += 1
        # Rank 0 decides when to stop, so every rank runs the same number of calls.
        stop[0] = rank == 0 and (os.path.exists(os.environ.get("TEST_STOP_FILE", "/nonexistent"))
                                 or time.monotonic() - t0 > float(os.environ.get("TEST_SECONDS", "12")))
        comm.all_reduce(stop, "max")
    print(f"done {i} all-reduces", flush=True)


def server_unreachable_loop(comm, rank, world):
    """TEST_CALLS all-reduces through a reducer that never answers, with the ring fallback:
    every result right; prints how long they took."""
    t0 = time.monotonic()
    for i in range(int(os.environ["TEST_CALLS"])):
        x = np.full(1 << 16, rank + i, np.float32)
        comm.all_reduce(x, algorithm="server")
        assert np.all(x == sum(r + i for r in range(world))), i
    print(f"calls took {time.monotonic() - t0:.2f}s", flush=True)


def ring_loop(comm, rank, world):
    """All-reduce until the test stops (SIGSTOP) a rank: the others must raise, naming it."""
    x = np.ones(1 << 20, np.float32)
    comm.all_reduce(x, algorithm="ring")
    print("looping", flush=True)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 120:
            comm.all_reduce(x, algorithm="ring")
    except PeerFailure as e:
        print(f"raised PeerFailure ranks={list(e.ranks)} after {time.monotonic() - t0:.1f}s: {e}", flush=True)
        return
    raise AssertionError("a stalled rank went unnoticed")


def auto_matrix(comm, rank, world):
    """Every op x dtype through the default choice (shared memory / hierarchy when a host runs
    several ranks; TEST_EXPECT_HIER says whether it must), sizes that span several pieces."""
    expect = os.environ.get("TEST_EXPECT_HIER")
    if expect is not None:
        assert (comm.hier is not None) == (expect == "1"), f"hierarchy {comm.hier} but expected {expect}"
    path = os.environ.get("TEST_EXPECT_PATH")  # how a large all-reduce moves data inside the host
    if path is not None:
        assert comm.hier.local_path(4 << 20) == path, f"{comm.hier.local_path(4 << 20)} but expected {path}"
    for opname in OPS:
        op = ops.ReduceOp.parse(opname)
        for dname in DTYPES:
            dt = ops.dtype_from_name(dname)
            for n in (0, 1, 7, 1000, 65537, 300_001, 1_100_000 if dt.itemsize >= 4 else 2_200_001):
                x = make_input(n, dt, op, rank, 3)
                comm.all_reduce(x, opname)
                wrong = count_wrong(x, reference(n, dt, op, world, 3))
                assert wrong == 0, f"auto {opname} {dname} n={n}: {wrong} wrong"
                digest(x)
    shm_files = [f for f in os.listdir("/dev/shm") if f.startswith("redsock-")
                 and f.split("-")[1] in {str(p) for p in comm.peers.topology.pids}]
    assert not shm_files, f"arena still linked after every rank attached: {shm_files}"
    others(comm, rank, world)


def dies_auto(comm, rank, world):
    """A rank killed mid-collective (kill -9 of itself) with the default choice."""
    comm.barrier()
    if rank == world - 1:
        threading.Timer(0.05, lambda: os.kill(os.getpid(), 9)).start()
    x = np.ones(int(os.environ.get("TEST_COUNT", str(8 << 20))), np.float32)
    t0 = time.monotonic()
    try:
        for _ in range(100_000):
            comm.all_reduce(x)
    except PeerFailure as e:
        print(f"raised PeerFailure ranks={list(e.ranks)} after {time.monotonic() - t0:.1f}s: {e}", flush=True)
        return
    raise AssertionError("a dead rank went unnoticed")


def shm_mismatch(comm, rank, world):
    differs = os.environ["TEST_DIFFERS"] if rank == 1 else ""
    x = np.ones(1001 if differs == "size" else 1000, np.float64 if differs == "dtype" else np.float32)
    try:
        comm.all_reduce(x, "max" if differs == "op" else "sum")
    except RedsockError as e:
        print(f"raised {type(e).__name__}: {e}", flush=True)
        return
    raise AssertionError("a size mismatch went unnoticed")


def shm_checks_after_a_plan(comm, rank, world):
    """Once a shape has run (its plan is made and kept), arrays of that dtype and size that
    are not fit to reduce in place still raise ConfigError, every call's checks are kept,
    and a good call of the same shape, flat or not, still sums right."""
    assert comm.hier is not None and comm.hier.nhosts == 1
    x = make_input(1000, np.dtype(np.float32), ops.ReduceOp.SUM, rank, 5)
    ref = reference(1000, np.dtype(np.float32), ops.ReduceOp.SUM, world, 5)
    comm.all_reduce(x.copy())
    readonly = x.copy()
    readonly.flags.writeable = False
    bad = {"strided": np.repeat(x, 2)[::2], "fortran": np.asfortranarray(x.reshape(20, 50)),
           "read-only": readonly, "a list": list(x), "an unknown op": x.copy()}
    for what, arr in bad.items():
        try:
            comm.all_reduce(arr, "bogus" if what == "an unknown op" else "sum")
        except ConfigError as e:
            print(f"{what}: ConfigError: {e}", flush=True)
        else:
            raise AssertionError(f"{what}: no ConfigError once the shape has a plan")
    for shape in ((1000,), (20, 50)):
        y = x.copy().reshape(shape)
        comm.all_reduce(y)
        assert count_wrong(y.reshape(-1), ref) == 0 and y.shape == shape
        digest(y)
    comm.close()
    try:
        comm.all_reduce(x.copy())
    except ConfigError as e:
        assert "closed" in str(e), e
    else:
        raise AssertionError("a closed communicator reduced")


def late_ranks_copy_the_result(comm, rank, world):
    """Small all-reduces on one host, each with fresh data, one rank late in turn (it then
    reduces, and the others, woken, copy the result it left in the arena) or none: integers
    exact, floats the same bits on every rank, at sizes up to the largest that shares its
    result, and above it, up to the largest the whole path takes."""
    from redsock.collectives.hierarchy import SHARED_RESULT_MAX_BYTES

    assert comm.hier is not None and comm.hier.nhosts == 1
    sizes = (1, 100, SHARED_RESULT_MAX_BYTES // 8, SHARED_RESULT_MAX_BYTES // 8 + 1, comm.hier.whole_max_bytes // 8)
    assert comm.hier.local_path(sizes[-1] * 8) == "whole"
    rng = np.random.default_rng(rank)
    for i in range(100):
        n = sizes[i % len(sizes)]
        if i % (world + 1) == rank:
            time.sleep(0.003)
        x = np.arange(n, dtype=np.int64) * (i + 1) + 1000 * rank + i
        comm.all_reduce(x)
        want = np.arange(n, dtype=np.int64) * (i + 1) * world + 1000 * sum(range(world)) + i * world
        assert np.array_equal(x, want), (i, n, x[:4], want[:4])
        y = rng.standard_normal(n).astype(np.float32)
        comm.all_reduce(y)
        digest(y)
    print("ok", flush=True)


def arena_halves_under_a_late_rank(comm, rank, world):
    """All-reduces through the arena in one piece (the same half again where the same plan
    follows itself), between whole-buffer calls, calls in several pieces and another
    one-piece shape, with rank 1 slow
    in every copy and in the whole buffer's reduction, so the others run ahead into the next
    call while it still reads the last one's: integers exact on every rank."""
    from redsock import ops

    hier = comm.hier
    assert hier is not None and hier.nhosts == 1 and hier.local_path(1 << 20) == "arena", "needs REDSOCK_SHM_CMA=off"
    one_piece, other_piece, whole = 1 << 17, (1 << 17) + 24, 1000  # (int64: 1 MiB, 1 MiB + 192 B, 8000 B)
    pieces = (1 << 19) + 1000  # (4 MiB + 8000 B: five pieces, through either half in turn)
    assert hier.local_path(whole * 8) == "whole" and hier.local_path(pieces * 8) == "arena"
    if rank == 1:
        copy = ops.copy

        def slow_copy(dst, src):
            time.sleep(0.002)
            copy(dst, src)

        ops.copy = slow_copy  # (the hierarchy copies through the module)
    order = [one_piece, one_piece, one_piece, whole, one_piece, other_piece, one_piece, one_piece, whole, whole,
             other_piece, other_piece, one_piece, pieces, pieces, one_piece, pieces, whole, pieces]
    for i in range(3 * len(order)):
        n = order[i % len(order)]
        x = np.arange(n, dtype=np.int64) * (i + 1) + 1000 * rank + i
        comm.all_reduce(x)
        want = np.arange(n, dtype=np.int64) * (i + 1) * world + 1000 * sum(range(world)) + i * world
        assert np.array_equal(x, want), (i, n, np.flatnonzero(x != want)[:4])
        key = (x.dtype, n, ops.ReduceOp.SUM)
        plan = hier.plans[key]
        if rank == 1 and n == whole and plan.reduce.__name__ != "slow_reduce":
            reduce = plan.reduce

            def slow_reduce(rows, out, reduce=reduce):
                time.sleep(0.002)
                return reduce(rows, out)

            hier.plans[key] = plan._replace(reduce=slow_reduce)
    print("ok", flush=True)


def raises(comm, rank, world):
    comm.all_reduce(np.ones(10, np.float32))
    raise RuntimeError("the training script fails")


def closes(comm, rank, world):
    """close(): the arena's mapping is gone from this process."""
    comm.all_reduce(np.ones(10, np.float32))
    maps = open("/proc/self/maps").read()
    assert "/dev/shm/redsock-" in maps, "no shared arena mapped"
    comm.close()
    import gc
    gc.collect()
    assert "/dev/shm/redsock-" not in open("/proc/self/maps").read(), "arena still mapped after close()"


def wire_inputs(n, world, seed, scale):
    """Every rank's float32 input of mixed magnitude (2^-20 .. 2^8 times ``scale``), the same
    on every rank, so each can compute the float64 reference itself."""
    rows = []
    for r in range(world):
        rng = np.random.default_rng(seed * 1000 + r)
        rows.append((rng.standard_normal(n) * 2.0 ** rng.integers(-20, 8, n) * scale).astype(np.float32))
    return rows


def wire_matrix(comm, rank, world):
    """float32 sum/avg on the bf16 and fp16 wires through every algorithm this job has: within
    the bound of ops.wire_error_bound on every element against float64; where the result
    crossed a 16-bit stage, every element representable in the wire type; same bits on every
    rank (digests).  Then what must be refused, and fp16 overflow raising on every rank."""
    algos = [None, "ring", "small"] + (["server"] if comm.servers is not None else [])

    def crosses_wire(algo, nbytes):  # whether the whole result went through a 16-bit stage
        chosen = comm.choose_algorithm(nbytes, algo)
        if chosen != "hier":
            return chosen in ("ring", "server")
        # Between hosts each shard of each piece picks its own algorithm (the smallest piece
        # here is above the reducers' threshold when its shard is): "small" carries float32.
        shard = min(nbytes, comm.hier.local.region_bytes) // comm.hier.topology.shards
        return comm.hier.nhosts > 1 and comm.servers is not None and shard >= SERVER_MIN_BYTES
    for wire in ("bf16", "fp16"):
        wdt = ops.wire_dtype(wire)
        for algo in algos:
            for opname in ("sum", "avg"):
                for n in (1, 1000, 65537, 300_001):
                    rows = wire_inputs(n, world, n % 97, 1.0 / world)
                    wide = np.stack(rows).astype(np.float64)
                    exact = wide.sum(axis=0)
                    x = rows[rank].copy()
                    comm.all_reduce(x, opname, algorithm=algo, wire_dtype=wire)
                    ref = exact / world if opname == "avg" else exact
                    bound = ops.wire_error_bound(np.abs(wide).sum(axis=0), exact, world, wire, opname)
                    err = np.abs(x.astype(np.float64) - ref)
                    assert (err <= bound).all(), f"{wire} {algo} {opname} n={n}: {(err / bound).max():.3f} x bound"
                    if opname == "sum" and crosses_wire(algo, x.nbytes):
                        assert np.array_equal(x.astype(wdt).astype(np.float32), x), f"{wire} {algo}: not on the wire"
                    digest(x)
    # The environment's wire (REDSOCK_WIRE_DTYPE) leaves other dtypes alone; asked per call, they are refused.
    for dt in (np.int32, np.float64, np.int64):
        x = np.ones(1000, dt)
        try:
            comm.all_reduce(x, wire_dtype="bf16")
        except ConfigError as e:
            assert "float32 sum/avg" in str(e)
        else:
            raise AssertionError(f"{dt} all-reduce accepted a bf16 wire")
        comm.all_reduce(x)  # and the communicator is still usable
        assert (x == world).all()
    # fp16 overflow: 70000 on every rank's element 5 (finite in float32) -> every rank raises.
    for algo in [a for a in algos if crosses_wire(a, 300_001 * 4)]:
        x = np.ones(300_001, np.float32)
        x[5] = 70000.0 / world
        try:
            comm.all_reduce(x, algorithm=algo, wire_dtype="fp16")
        except WireOverflow as e:
            assert e.count == 1 and "index 5" in str(e), str(e)
        else:
            raise AssertionError(f"fp16 overflow through {algo} went unnoticed: {x[:8]}")
        assert x[4] == world and x[6] == world
    comm.barrier()


def wire_mismatch(comm, rank, world):
    """Rank 1 asks for the bf16 wire, rank 0 for none (through TEST_ALGO, default the
    reducers): both must raise."""
    x = np.ones(1 << 18, np.float32)
    try:
        comm.all_reduce(x, algorithm=os.environ.get("TEST_ALGO", "server"), wire_dtype="bf16" if rank == 1 else "off")
    except RedsockError as e:
        print(f"raised {type(e).__name__}: {e}", flush=True)
        return
    raise AssertionError(f"a wire mismatch went unnoticed: {x[:4]}")


def either_way(comm, rank, world):
    """Shapes that may go through the arena or by cross-memory attach, interleaved as DDP's
    buckets are, with local rank 0 trying the other way every 3 calls (so the ways change
    all the time, by probe and by timing): every call right against numpy on every rank
    (the digests compare the ranks' bits), and both ways taken by every shape."""
    from redsock.collectives import hierarchy

    hierarchy.PROBE_EVERY = 3
    shapes = [(300_001, "float32", "sum"), (1_100_000, "float32", "avg"), (70_000, "int32", "max"),
              (2_200_001, "bfloat16", "sum"), (300_001, "int64", "prod")]
    for call in range(60):
        for n, dname, opname in shapes[call % 2:] if call % 3 else shapes:  # (not always the same order)
            dt, op = ops.dtype_from_name(dname), ops.ReduceOp.parse(opname)
            x = make_input(n, dt, op, rank, call)
            comm.all_reduce(x, opname)
            wrong = count_wrong(x, reference(n, dt, op, world, call))
            assert wrong == 0, f"call {call} {dname} {opname} n={n}: {wrong} wrong"
            digest(x)
    for n, dname, opname in shapes:
        dt = ops.dtype_from_name(dname)
        taken = comm.hier.path_taken(dt, n, ops.ReduceOp.parse(opname))
        assert "arena" in taken and "cma" in taken, f"{dname} n={n}: {taken}"
        print(f"taken {dname} {n}: {taken}", flush=True)


def ways_told_late(comm, rank, world):
    """Local rank 0 is slow to write its word (as when the scheduler pauses it just after a
    sync): the others wait for it at the call's last sync, and every rank takes the way it
    told from the next call on.  A shape that goes through the arena or by cross-memory
    attach, the other way tried every 3 calls: every call right, the same bits everywhere,
    both ways taken."""
    from redsock.collectives import hierarchy

    hierarchy.PROBE_EVERY = 3
    if rank == 0:
        tell = comm.hier.local.tell

        def late_tell(slot, word):
            time.sleep(0.03)
            tell(slot, word)
        comm.hier.local.tell = late_tell
    n, dt, op = 100_000, np.dtype(np.float32), ops.ReduceOp.SUM  # 400 KB: either way for 4 ranks
    for call in range(40):
        x = make_input(n, dt, op, rank, call)
        comm.all_reduce(x)
        assert count_wrong(x, reference(n, dt, op, world, call)) == 0, f"call {call}"
        digest(x)
    taken = comm.hier.path_taken(dt, n, op)
    assert "arena" in taken and "cma" in taken, taken
    print(f"taken {taken}", flush=True)


def ways_differ(comm, rank, world):
    """Rank 1 takes the other way than the rest for one call (as a bug in how the ways are
    agreed would): every rank raises at the call's first sync, none mixes the ways' data."""
    x = np.ones(1 << 20, np.float32)
    comm.all_reduce(x)  # (prepares the shape)
    if rank == 1:
        plan = comm.hier.plans[x.dtype, x.size, ops.ReduceOp.SUM]
        plan.ways.way ^= 1
        plan.ways.ident = -1  # (the word local rank 0 said for this shape would set it back)
    try:
        comm.all_reduce(x)
    except RedsockError as e:
        print(f"raised {type(e).__name__}: {e}", flush=True)
        return
    raise AssertionError(f"ranks took different ways unnoticed: {x[:4]}")


def _refuse_cross_memory_attach() -> None:
    """This rank's kernel refuses process_vm_readv, as ptrace scope or a container may."""
    import ctypes
    import errno

    from redsock.transport import shm

    def refused(*_):
        ctypes.set_errno(errno.EPERM)
        return -1

    shm._vm_readv = refused


def main():
    """``STORE`` is a directory (redsock's FileStore: no torch import, so ranks start in well
    under a second) or the port of a torch TCPStore."""
    scenario, rank, world, store_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if store_at.isdigit():
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", int(store_at), world, is_master=False, timeout=timedelta(seconds=60))
    else:
        store = FileStore(store_at)
    if os.environ.get("TEST_REFUSE_CMA") == str(rank):
        _refuse_cross_memory_attach()
    with redsock.init(rank, world, store, timeout_s=float(os.environ.get("TEST_TIMEOUT_S", "30"))) as comm:
        globals()[scenario](comm, rank, world)
    print("ok", flush=True)


if __name__ == "__main__":
    main()
