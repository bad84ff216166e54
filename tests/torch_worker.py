"""One rank of a torch-backend test: ``python torch_worker.py SCENARIO`` under RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT (and TORCHELASTIC_USE_AGENT_STORE: the test process hosts the store).

The default group is redsock; a gloo group over the same ranks computes the reference, so
every check is "redsock gives what gloo gives, in the same processes".  Prints ``ok`` last.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import redsock.torch  # noqa: F401 - registers the backend
from redsock.errors import ConfigError, PeerFailure, RedsockError
from redsock.torch import Options, ProcessGroupRedsock

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int8, torch.uint8, torch.int32, torch.int64]
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "min": dist.ReduceOp.MIN,
       "max": dist.ReduceOp.MAX, "prod": dist.ReduceOp.PRODUCT}
SIZES = [7, 300_001]  # inline/recursive doubling, and ring over the data streams


def values(n: int, dtype: torch.dtype, op: str, seed: int) -> torch.Tensor:
    """Small integers (exact in every dtype, whatever the summation order), per rank."""
    g = torch.Generator().manual_seed(seed * 7919 + dist.get_rank())
    lo = 0 if dtype == torch.uint8 else -3
    hi = 4 if op == "prod" else 5
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor, what: str, *, exact: bool = True) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if exact:
        if not torch.equal(a, b):
            bad = (a != b).nonzero()[:5].flatten().tolist()
            raise AssertionError(f"{what}: differs from gloo at {bad}: {a.flatten()[bad]} vs {b.flatten()[bad]}")
    else:
        torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}")


def expect_error(fn, text: str, what: str) -> None:
    try:
        fn()
    except ConfigError as e:
        assert text in str(e), f"{what}: unexpected message {e}"
        return
    raise AssertionError(f"{what}: no ConfigError")


# -- scenarios ---------------------------------------------------------------------------

def ops(gloo) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    assert isinstance(dist.group.WORLD, ProcessGroupRedsock)
    assert dist.get_backend() == "redsock" and dist.group.WORLD.name() == "redsock"

    # all-reduce: every op x dtype x size, and a non-contiguous tensor
    seed = 0
    for opname, op in OPS.items():
        for dtype in DTYPES:
            for n in SIZES:
                seed += 1
                x = values(n, dtype, opname, seed)
                ref = x.clone()
                dist.all_reduce(x, op=op)
                if opname == "avg" and not dtype.is_floating_point:
                    # gloo has no integer AVG; redsock's truncates toward zero, like C (and NCCL)
                    dist.all_reduce(ref, group=gloo)
                    ref = torch.div(ref, world, rounding_mode="trunc").to(dtype)
                else:
                    dist.all_reduce(ref, op=op, group=gloo)
                # avg of 16-bit floats: redsock divides in float32 and rounds once, gloo in 16 bits
                same(x, ref, f"all_reduce {opname} {dtype} n={n}",
                     exact=not (opname == "avg" and dtype in (torch.float16, torch.bfloat16)))
    base = torch.arange(40, dtype=torch.float32).reshape(4, 10) * (rank + 1)
    x, ref = base.clone(), base[:, ::3].contiguous()
    dist.all_reduce(x[:, ::3])
    dist.all_reduce(ref, group=gloo)  # (gloo given the strided view itself changes the other columns too)
    same(x[:, ::3], ref, "all_reduce non-contiguous")
    keep = torch.ones(10, dtype=torch.bool)
    keep[::3] = False
    same(x[:, keep], base[:, keep], "all_reduce non-contiguous leaves the other columns alone")

    # unsupported ops and dtypes: clear errors, and the group stays usable
    expect_error(lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.BAND),
                 "BAND is not supported", "BAND")
    expect_error(lambda: dist.all_reduce(torch.ones(3), op=dist._make_nccl_premul_sum(2.0)),
                 "PREMUL_SUM is not supported", "PREMUL_SUM")
    expect_error(lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool)), "torch.bool is not supported", "bool")
    expect_error(lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16)), "torch.int16 is not supported", "int16")
    # complex SUM: torch hands the backend a float view (view_as_real)
    x = torch.complex(values(5, torch.float32, "sum", 90), values(5, torch.float32, "sum", 91))
    ref = x.clone()
    dist.all_reduce(x)
    dist.all_reduce(ref, group=gloo)
    same(x, ref, "all_reduce complex64")

    # broadcast from every root
    for root in range(world):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            x = values(1000 + root, dtype, "sum", 100 + root)
            ref = x.clone()
            dist.broadcast(x, root)
            dist.broadcast(ref, root, group=gloo)
            same(x, ref, f"broadcast root={root} {dtype}")

    # all-gather: list form, into one tensor (both names), with a non-contiguous output
    for n in (5, 70_001):
        x = values(n, torch.float32, "sum", 200 + n)
        outs = [torch.empty(n) for _ in range(world)]
        refs = [torch.empty(n) for _ in range(world)]
        dist.all_gather(outs, x)
        dist.all_gather(refs, x, group=gloo)
        for r in range(world):
            same(outs[r], refs[r], f"all_gather list n={n} [{r}]")
        big, ref = torch.empty(world * n), torch.empty(world * n)
        dist.all_gather_single(big, x)
        dist.all_gather_single(ref, x, group=gloo)
        same(big, ref, f"all_gather_single n={n}")
        big.zero_()
        dist.all_gather_into_tensor(big, x)
        same(big, ref, f"all_gather_into_tensor n={n}")
        wide = torch.zeros(world, 2 * n)
        dist.all_gather_into_tensor(wide[:, ::2], x)
        same(wide[:, ::2].reshape(-1), ref, "all_gather_into_tensor non-contiguous output")
        assert not wide[:, 1::2].any()

    # reduce-scatter: list form and tensor form, several ops
    for opname in ("sum", "avg", "max", "prod"):
        n = 1001
        ins = [values(n, torch.float64, opname, 300 + j) for j in range(world)]
        out, ref = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
        dist.reduce_scatter(out, ins, op=OPS[opname])
        dist.reduce_scatter(ref, ins, op=OPS[opname], group=gloo)
        same(out, ref, f"reduce_scatter list {opname}")
        dt = torch.float32 if opname == "avg" else torch.int32  # gloo has no integer AVG
        flat = torch.cat(ins).to(dt)
        out, ref = torch.empty(n, dtype=dt), torch.empty(n, dtype=dt)
        dist.reduce_scatter_tensor(out, flat, op=OPS[opname])
        dist.reduce_scatter_tensor(ref, flat, op=OPS[opname], group=gloo)
        same(out, ref, f"reduce_scatter_tensor {opname}")
        out.zero_()
        dist.reduce_scatter_single(out, flat, op=OPS[opname])
        same(out, ref, f"reduce_scatter_single {opname}")

    # reduce, gather, scatter
    for root in range(world):
        x = values(333, torch.float32, "sum", 400 + root)
        y, ref = x.clone(), x.clone()
        dist.reduce(y, root, op=dist.ReduceOp.MAX)
        dist.reduce(ref, root, op=dist.ReduceOp.MAX, group=gloo)
        if rank == root:
            same(y, ref, f"reduce root={root}")
        else:
            same(y, x, f"reduce leaves non-root tensors alone (root={root})")
        gl = [torch.empty(333) for _ in range(world)] if rank == root else None
        gr = [torch.empty(333) for _ in range(world)] if rank == root else None
        dist.gather(x, gl, root)
        dist.gather(x, gr, root, group=gloo)
        if rank == root:
            for r in range(world):
                same(gl[r], gr[r], f"gather root={root} [{r}]")
        parts = [values(50, torch.int64, "sum", 500 + j) for j in range(world)] if rank == root else None
        s, sr = torch.empty(50, dtype=torch.int64), torch.empty(50, dtype=torch.int64)
        dist.scatter(s, parts, root)
        dist.scatter(sr, parts, root, group=gloo)
        same(s, sr, f"scatter root={root}")

    # point-to-point: receives posted before the matching sends on every rank, two tags,
    # one message large enough for the data streams
    if world > 1:
        point_to_point(gloo)
    all_to_all(gloo)
    dist.barrier()
    print("ok", flush=True)


def point_to_point(gloo) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % world, (rank + 1) % world
    for n in (10, 1 << 20):
        a_out, b_out = torch.full((n,), float(rank)), torch.arange(n, dtype=torch.float32) + rank

        def exchange(group):
            a_in, b_in = torch.empty(n), torch.empty(n)
            reqs = [dist.irecv(a_in, left, group=group, tag=5), dist.irecv(b_in, right, group=group, tag=6),
                    dist.isend(a_out, right, group=group, tag=5), dist.isend(b_out, left, group=group, tag=6)]
            for req in reqs:
                req.wait()
            return a_in, b_in

        for got, ref in zip(exchange(None), exchange(gloo)):
            same(got, ref, f"isend/irecv n={n}")
    ops_list = [dist.P2POp(dist.isend, torch.full((3,), float(rank)), right),
                dist.P2POp(dist.irecv, got := torch.empty(3), left)]
    for req in dist.batch_isend_irecv(ops_list):
        req.wait()
    same(got, torch.full((3,), float(left)), "batch_isend_irecv")
    # recv without src: from whichever rank sends first, matched by tag (a large message too,
    # which arrives over the data streams), on both backends; each sender's message intact.
    others = [r for r in range(world) if r != rank]
    for group in (None, gloo):
        sends = [dist.isend(torch.full((n,), float(rank * 100 + tag)), peer, group=group, tag=tag)
                 for tag, n in ((8, 1 << 19), (3, 10)) for peer in others]
        for tag, n in ((3, 10), (8, 1 << 19)):  # received in the other order than sent
            senders = []
            for _ in others:
                buf = torch.empty(n)
                src = dist.recv(buf, group=group, tag=tag)
                same(buf, torch.full((n,), float(src * 100 + tag)), f"recv from any source (tag {tag})")
                senders.append(src)
            assert sorted(senders) == others, f"tag {tag}: received from {senders}"
        for req in sends:
            req.wait()
    pg = dist.group.WORLD  # (torch.distributed itself refuses sends to self before the backend sees them)
    expect_error(lambda: pg.send([torch.ones(1)], rank, 0), "not another rank", "send to self")
    expect_error(lambda: pg.recv([torch.ones(1)], right, -1), "tag must be", "negative tag")


def all_to_all(gloo) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    # all-to-all: list form with a different size per pair, and single-tensor with split sizes
    ins = [values(6, torch.float32, "sum", 600 + j) for j in range(world)]
    outs = [torch.empty(6) for _ in range(world)]
    refs = [torch.empty(6) for _ in range(world)]
    dist.all_to_all(outs, ins)
    dist.all_to_all(refs, ins, group=gloo)
    for j in range(world):
        same(outs[j], refs[j], f"all_to_all list [{j}]")
    # a different size per pair (gloo refuses that): closed-form expectation
    ins = [torch.arange(rank + 2 * j + 1) + 100 * rank + 10 * j for j in range(world)]
    outs = [torch.empty(j + 2 * rank + 1, dtype=torch.int64) for j in range(world)]
    dist.all_to_all(outs, ins)
    for j in range(world):
        same(outs[j], torch.arange(j + 2 * rank + 1) + 100 * j + 10 * rank, f"all_to_all uneven list [{j}]")
    x = values(world * 4 * 3, torch.int32, "sum", 700).reshape(world * 4, 3)
    out, ref = torch.empty_like(x), torch.empty_like(x)
    dist.all_to_all_single(out, x)
    dist.all_to_all_single(ref, x, group=gloo)
    same(out, ref, "all_to_all_single equal splits")
    in_splits = [rank + j + 1 for j in range(world)]
    out_splits = [j + rank + 1 for j in range(world)]
    x = values(sum(in_splits) * 3, torch.bfloat16, "sum", 800).reshape(-1, 3)
    out = torch.empty(sum(out_splits), 3, dtype=torch.bfloat16)
    ref = torch.empty_like(out)
    dist.all_to_all_single(out, x, out_splits, in_splits)
    dist.all_to_all_single(ref, x, out_splits, in_splits, group=gloo)
    same(out, ref, "all_to_all_single with split sizes")


def async_ops(gloo) -> None:
    """Many operations in flight at once; completion through Work and through futures."""
    rank, world = dist.get_rank(), dist.get_world_size()
    xs = [values(n, torch.float32, "sum", n) for n in (3, 100_000, 1, 2_000_000, 17)]
    refs = [x.clone() for x in xs]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    gathered = [torch.empty(5) for _ in range(world)]
    works.append(dist.all_gather(gathered, torch.full((5,), float(rank)), async_op=True))
    doubled = works[1].get_future().then(lambda f: f.value()[0] * 2)
    for w in reversed(works):  # waiting out of order must be fine
        assert w.wait() is True
        assert w.is_completed()
    for r in refs:
        dist.all_reduce(r, group=gloo)
    for x, r in zip(xs, refs):
        same(x, r, f"async all_reduce n={x.numel()}")
    same(doubled.wait(), refs[1] * 2, "future.then")
    for r in range(world):
        same(gathered[r], torch.full((5,), float(r)), "async all_gather")
    futs = [dist.all_reduce(torch.ones(4) * rank, async_op=True).get_future() for _ in range(3)]
    for f in torch.futures.wait_all(futs):
        same(f[0], torch.full((4,), float(sum(range(world)))), "wait_all on futures")
    result = dist.all_reduce(torch.ones(2), async_op=True).result()
    same(result[0], torch.full((2,), float(world)), "Work.result()")
    # torch's coalescing manager (FSDP-style grouping of collectives)
    ts = [torch.full((3,), float(rank)), torch.ones(70_000)]
    with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    same(ts[0], torch.full((3,), float(sum(range(world)))), "coalesced all_reduce")
    same(ts[1], torch.full((70_000,), float(world)), "coalesced all_reduce (large)")
    print("ok", flush=True)


def nested(gloo) -> None:
    """A future's callback starts another all-reduce of the same group and waits for it (as
    torch's PowerSGD hook does), two levels deep: each must finish with the closed-form result
    instead of waiting on the thread that would run it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = float(sum(range(1, world + 1)))

    def inner_then(fut: torch.futures.Future) -> torch.Tensor:
        y = fut.value()[0] * 2
        dist.all_reduce(y, async_op=True).get_future().wait()  # level 2: waits on another collective
        return y

    def outer_then(fut: torch.futures.Future) -> torch.Tensor:
        z = fut.value()[0] + 1
        work = dist.all_reduce(z, async_op=True)
        return work.get_future().then(inner_then).wait()  # level 1 waits for level 2's chain

    # One chain at a time: the callbacks of chains in flight together run on different threads
    # (torch runs a callback on the caller's thread when its future is already set), so their
    # nested collectives would start in a different order on each rank — as with any backend.
    for n in (5, 70_000, 600_000):  # inline, data streams, large enough for every path
        x = torch.full((n,), float(rank + 1))
        fut = dist.all_reduce(x, async_op=True).get_future().then(outer_then)
        # closed form: s = sum(rank+1); level 1: world * (s + 1); level 2: world * 2 * that
        same(fut.wait(), torch.full((n,), world * 2 * world * (total + 1)), f"nested callbacks n={n}")
    # the group keeps working afterwards, as gloo's does
    x = torch.full((9,), float(rank))
    ref = x.clone()
    dist.all_reduce(x)
    dist.all_reduce(ref, group=gloo)
    same(x, ref, "all_reduce after nested callbacks")
    print("ok", flush=True)


def cuda(gloo) -> None:
    """CUDA tensors through redsock next to gloo in the same processes: every op on float32 /
    bfloat16 / int64 device tensors; DDP on the device (redsock default group against a DDP
    copy on gloo, same data); FSDP2 (fully_shard) on the device against one model trained on
    every rank's batch.  Ranks share the devices round robin."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    on_cuda = os.environ.get("TEST_DEVICE", "cuda") == "cuda"  # (cpu: a dry run of this scenario)
    dev = torch.device("cuda", rank % torch.cuda.device_count()) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(dev)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for op in ("sum", "min", "max"):
            x = values(300_001, dtype, op, 7).to(dev)
            ref = x.cpu()
            dist.all_reduce(x, op=OPS[op])
            dist.all_reduce(ref, op=OPS[op], group=gloo)
            assert x.device == dev
            same(x.cpu(), ref, f"cuda all_reduce {dtype} {op}")
    outs = [torch.empty(5, device=dev) for _ in range(world)]
    dist.all_gather(outs, torch.full((5,), float(rank), device=dev))
    for r in range(world):
        same(outs[r].cpu(), torch.full((5,), float(r)), "cuda all_gather")

    def mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).to(dev)

    def batch(step: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + r)
        return torch.randn(16, 64, generator=g).to(dev), torch.randn(16, 64, generator=g).to(dev)

    ids = [dev] if on_cuda else None
    ours, theirs = DDP(mlp(), device_ids=ids), DDP(mlp(), device_ids=ids, process_group=gloo)
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(5):
            x, y = batch(step, rank)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    for (name, a), b in zip(ours.module.named_parameters(), theirs.module.parameters()):
        # 2 ranks: one rounding per sum whatever the algorithm, so bitwise; more: float rounding
        if world == 2:
            same(a.detach().cpu(), b.detach().cpu(), f"cuda DDP {name}")
        else:
            torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), rtol=1e-5, atol=1e-6)

    sharded, single = mlp(), mlp()
    fully_shard(sharded)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (sharded, single)]
    for step in range(5):
        x, y = batch(step, rank)
        opts[0].zero_grad()
        torch.nn.functional.mse_loss(sharded(x), y).backward()
        opts[0].step()
        xs, ys = zip(*(batch(step, r) for r in range(world)))  # the whole global batch, here
        opts[1].zero_grad()
        torch.nn.functional.mse_loss(single(torch.cat(xs)), torch.cat(ys)).backward()
        opts[1].step()
    for (name, p), q in zip(sharded.named_parameters(), single.parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.testing.assert_close(full.detach().cpu(), q.detach().cpu(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"cuda FSDP2 {name}: {m}")
    if on_cuda:
        torch.cuda.synchronize()
    print("ok", flush=True)


def subgroups(gloo) -> None:
    """new_group over subsets: each group its own Communicator; results equal gloo's groups."""
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 3
    specs = [[0, 1], [1, 2], [0, 2], [0, 1, 2], [2]]
    mine = []
    for ranks in specs:  # every rank creates every group, in the same order
        rs = dist.new_group(ranks, backend="redsock", pg_options=Options(algo="ring") if len(ranks) == 3 else None)
        gl = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            assert isinstance(rs, ProcessGroupRedsock), rs
            mine.append((ranks, rs, gl))
    for round_ in range(2):
        for ranks, rs, gl in mine:
            for n in (9, 200_000):
                x = values(n, torch.float32, "sum", 1000 + round_ * 10 + len(ranks))
                ref = x.clone()
                dist.all_reduce(x, group=rs)
                dist.all_reduce(ref, group=gl)
                same(x, ref, f"subgroup {ranks} all_reduce n={n}")
            outs = [torch.empty(4) for _ in ranks]
            dist.all_gather(outs, torch.full((4,), float(rank)), group=rs)
            for r, o in zip(ranks, outs):
                same(o, torch.full((4,), float(r)), f"subgroup {ranks} all_gather")
            dist.barrier(group=rs)
    # the default group still works after the subgroups
    x = torch.ones(10)
    dist.all_reduce(x)
    same(x, torch.full((10,), float(world)), "default group after subgroups")
    for _, rs, _ in mine:
        dist.destroy_process_group(rs)
    print("ok", flush=True)


def failure(gloo) -> None:
    """A rank dies: the others' operations fail with PeerFailure through Work.wait()."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.ones(1 << 18)
    dist.all_reduce(x)  # every connection is up
    if rank == world - 1:
        os._exit(9)
    t0 = time.monotonic()
    try:
        for _ in range(50):
            dist.all_reduce(x)
    except PeerFailure as e:
        assert world - 1 in e.ranks, e.ranks
        print(f"raised PeerFailure ranks={list(e.ranks)} after {time.monotonic() - t0:.1f}s", flush=True)
    else:
        raise AssertionError("no PeerFailure")
    # the group is unusable afterwards, and says so
    try:
        dist.all_reduce(torch.ones(3))
    except RedsockError as e:
        print(f"then raised {type(e).__name__}", flush=True)
    print("ok", flush=True)
    os._exit(0)  # skip destroy_process_group: the dead rank never joins it


def per_call_timeout(gloo) -> None:
    """torch's per-call timeout (an options object's ``timeout``) bounds a call whose peers
    never come, long before the group's own timeout (TEST_TIMEOUT_S)."""
    rank = dist.get_rank()
    pg = dist.distributed_c10d._get_default_group()
    x = torch.ones(1000)
    dist.all_reduce(x)  # every connection is up
    if rank != 0:
        time.sleep(float(os.environ["TEST_SLEEP_S"]))  # misses rank 0's next call
        print("ok", flush=True)
        os._exit(0)
    timed = [("allreduce", dist.AllreduceOptions, lambda o: pg.allreduce([x], o)),
             ("broadcast", dist.BroadcastOptions, lambda o: pg.broadcast([x], o))]
    name, options, call = timed[int(os.environ["TEST_OP"])]
    opts = options()
    opts.timeout = timedelta(seconds=1)
    if name == "broadcast":
        opts.rootRank = 1  # (a root's send completes into the socket buffers without its peers)
    t0 = time.monotonic()
    try:
        call(opts).wait()
    except RedsockError as e:
        print(f"{name} raised {type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}", flush=True)
    else:
        raise AssertionError("the per-call timeout did not fire")
    print("ok", flush=True)
    os._exit(0)  # skip destroy_process_group: the group failed


def wire_accuracy(gloo) -> None:
    """1M float32 of mixed magnitude (2^-12 .. 2^4) per rank, averaged three ways on the same
    inputs: torch's fp16_compress_hook on gloo (casts, then sums in fp16), redsock's fp16 wire
    and its bf16 wire (each input rounded once, float32 sums, one rounding of the result) through
    TEST_WIRE_ALGO.  redsock's fp16 error must be the smaller one, both per |exact| and per sum
    of |inputs|, and bf16 within ops.wire_error_bound on every element."""
    import numpy as np
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    from redsock import ops as rops

    rank, world, n = dist.get_rank(), dist.get_world_size(), 1 << 20
    rows = []
    for r in range(world):  # every rank's input, so that each computes the float64 reference
        rng = np.random.default_rng(100 + r)
        rows.append((rng.standard_normal(n) * 2.0 ** rng.integers(-12, 5, n)).astype(np.float32))
    wide = np.stack(rows).astype(np.float64)
    exact = wide.sum(axis=0)
    ref, scale = exact / world, np.abs(wide).sum(axis=0) / world
    nz = ref != 0

    def errors(got: np.ndarray) -> tuple[float, float]:
        e = np.abs(got.astype(np.float64) - ref)
        return float((e[nz] / np.abs(ref[nz])).max()), float((e / scale).max())

    hooked = fp16_compress_hook(gloo, (torch.from_numpy(rows[rank].copy()),)).wait().numpy()
    comm = dist.group.WORLD.comm  # the redsock group's Communicator, for algorithm= and wire_dtype=
    algo = os.environ["TEST_WIRE_ALGO"]
    got = {}
    for wire in ("fp16", "bf16"):
        x = rows[rank].copy()
        comm.all_reduce(x, "avg", algorithm=algo, wire_dtype=wire)
        got[wire] = x
    hook_err, fp16_err = errors(hooked), errors(got["fp16"])
    print(f"largest relative error: fp16_compress_hook on gloo {hook_err[0]:.3g} (per |exact|), "
          f"{hook_err[1]:.3g} (per mean |input|); redsock fp16 wire {fp16_err[0]:.3g}, {fp16_err[1]:.3g}; "
          f"bf16 wire {errors(got['bf16'])[0]:.3g}, {errors(got['bf16'])[1]:.3g}", flush=True)
    assert fp16_err[0] < hook_err[0] and fp16_err[1] < hook_err[1], (fp16_err, hook_err)
    for wire, x in got.items():
        bound = rops.wire_error_bound(np.abs(wide).sum(axis=0), exact, world, wire, "avg")
        err = np.abs(x.astype(np.float64) - ref)
        assert (err <= bound).all(), f"{wire}: {(err > bound).sum()} elements beyond the bound"
        assert np.array_equal(x.astype(rops.wire_dtype(wire)).astype(np.float32), x), f"{wire}: not on the wire"
        digest = torch.from_numpy(x.view(np.int32).astype(np.int64)).sum().item()  # same bits everywhere:
        check = torch.tensor([digest, -digest], dtype=torch.int64)
        dist.all_reduce(check, op=dist.ReduceOp.MAX, group=gloo)
        assert check[0].item() == digest and check[1].item() == -digest, f"{wire}: ranks differ"
    print("ok", flush=True)


SCENARIOS = {"ops": ops, "wire_accuracy": wire_accuracy, "async": async_ops, "nested": nested, "cuda": cuda,
             "subgroups": subgroups, "failure": failure, "per_call_timeout": per_call_timeout}


def main() -> None:
    scenario = sys.argv[1]
    timeout = timedelta(seconds=float(os.environ.get("TEST_TIMEOUT_S", "60")))
    dist.init_process_group("redsock", timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    SCENARIOS[scenario](gloo)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
