"""Pipelined ring algorithms: reduce-scatter, all-gather, and all-reduce as the two in a row.

Rank r sends to r+1 and receives from r-1.  Each segment is cut into chunks,
and every chunk moves on as soon as it is ready: a chunk reduced in step s is
sent for step s+1 while the rest of step s is still arriving, so sending,
receiving and reducing overlap (the transport's threads do the I/O while this
thread runs the numpy kernels).

Segment ownership: after the reduce-scatter, rank r holds the reduced segment r.
Every segment is reduced along one chain and then copied, so all ranks end
with bitwise-identical results.  16-bit floats travel as float32 partial sums
during the reduce-scatter and are rounded once, by their owner.

On a 16-bit wire (float32 data) only the all-gather carries 16 bits: the reduce-scatter's
partial sums stay float32, since rounding them at each of the N-1 steps would add N-1
roundings of growing partial sums (the error of a cast-before-all-reduce, which the wire's
bound of one rounding per input and one of the result does not allow).  So the ring saves a
quarter of its bytes, not half; the reducers and the hierarchy's inter-host stage save half.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import ops
from ..transport import Handle
from .context import CallContext, chunks, flat, partition

CHUNK_BYTES = 4194304  # pipeline granularity (measured: see README "Tuning")


Chunks = list[list[tuple[int, int]]]  # per segment: [lo, hi) element ranges


def post_reduce_scatter(ctx: CallContext, acc: np.ndarray, seg_chunks: Chunks) -> list[tuple]:
    """Post every receive of the reduce-scatter now, each into its own scratch space,
    so no chunk ever arrives before its receive (that would cost a copy)."""
    n, r, left = ctx.world, ctx.rank, (ctx.rank - 1) % ctx.world
    steps = [(step, seg_chunks[(r - step - 2) % n]) for step in range(n - 1)]
    scratch = ctx.scratch(sum(hi - lo for _, cs in steps for lo, hi in cs), acc.dtype)
    posted, off = [], 0
    for step, cs in steps:
        for lo, hi in cs:
            buf = scratch[off:off + hi - lo]
            off += hi - lo
            posted.append((step, lo, hi, buf, ctx.irecv(left, buf)))
    return posted


def run_reduce_scatter(ctx: CallContext, acc: np.ndarray, seg_chunks: Chunks, posted: list[tuple],
                       op: ops.ReduceOp, on_owned_chunk: Callable[[int, int], None]) -> list[Handle]:
    """Ring reduce-scatter over ``acc`` (flat, accumulation dtype); rank r ends owning segment r.

    Calls ``on_owned_chunk(lo, hi)`` for each chunk of this rank's own segment as soon
    as it is fully reduced.  Returns the send handles still in flight.
    """
    n, r, right = ctx.world, ctx.rank, (ctx.rank + 1) % ctx.world
    sends = [ctx.isend(right, acc[lo:hi]) for lo, hi in seg_chunks[(r - 1) % n]]
    for step, lo, hi, buf, h in posted:
        ctx.wait(h)
        ops.combine(acc[lo:hi], buf, op)
        if step < n - 2:
            sends.append(ctx.isend(right, acc[lo:hi]))  # reduced here: on to the next rank
        else:
            on_owned_chunk(lo, hi)
    return sends


def post_all_gather(ctx: CallContext, out: np.ndarray, seg_chunks: Chunks) -> list[tuple]:
    """Post every receive of the all-gather now, straight into ``out``."""
    n, r, left = ctx.world, ctx.rank, (ctx.rank - 1) % ctx.world
    return [(step, lo, hi, ctx.irecv(left, out[lo:hi]))
            for step in range(n - 1) for lo, hi in seg_chunks[(r - step - 1) % n]]


def run_all_gather(ctx: CallContext, out: np.ndarray, posted: list[tuple], sends: list[Handle]) -> None:
    """Forward each received chunk to the right as it lands; segment r started this rank's sends."""
    right = (ctx.rank + 1) % ctx.world
    for step, lo, hi, h in posted:
        ctx.wait(h)
        if step < ctx.world - 2:
            sends.append(ctx.isend(right, out[lo:hi]))
    ctx.wait_all(sends)


def segment_chunks(bounds: list[tuple[int, int]], per: int) -> Chunks:
    return [chunks(lo, hi, per) for lo, hi in bounds]


def all_reduce(ctx: CallContext, x: np.ndarray, op: ops.ReduceOp, wire_dtype: np.dtype | None = None) -> None:
    """In-place ring all-reduce of ``x`` (C-contiguous); ``wire_dtype``: the 16-bit type the
    all-gather carries (float32 ``x`` only)."""
    xf = flat(x)
    wide = ops.accum_dtype(x.dtype)
    acc = xf if wide == x.dtype else ops.init_acc(xf, ctx.scratch(xf.size, wide))
    # One chunking for both phases: the owned chunks of the reduce-scatter start the all-gather.
    seg_chunks = segment_chunks(partition(xf.size, ctx.world), chunk_elements(acc))
    rs_posted = post_reduce_scatter(ctx, acc, seg_chunks)
    # Receiving into x while reduce-scatter sends from it are in flight is safe: a segment's
    # final value only comes back after our contribution to it has been delivered.
    out = xf if wire_dtype is None else ctx.scratch(xf.size, wire_dtype)
    ag_posted = post_all_gather(ctx, out, seg_chunks)
    right = (ctx.rank + 1) % ctx.world
    ag_sends: list[Handle] = []

    def owned(lo: int, hi: int) -> None:  # final for every rank: round once, start the all-gather
        ops.finalize(acc[lo:hi], op, ctx.world, out[lo:hi])
        ag_sends.append(ctx.isend(right, out[lo:hi]))

    rs_sends = run_reduce_scatter(ctx, acc, seg_chunks, rs_posted, op, owned)
    run_all_gather(ctx, out, ag_posted, ag_sends + rs_sends)
    if out is not xf:  # the owner too takes the rounded bits: every rank ends with the same
        ops.from_wire(out, xf)


def reduce_scatter(ctx: CallContext, x: np.ndarray, out: np.ndarray, op: ops.ReduceOp) -> None:
    """``out`` (count elements) = reduced segment ``rank`` of ``x`` (world * count elements)."""
    xf = flat(x)
    acc = ops.init_acc(xf, ctx.scratch(xf.size, ops.accum_dtype(x.dtype)))  # the input is not modified
    count = out.size
    seg_chunks = segment_chunks([(i * count, (i + 1) * count) for i in range(ctx.world)], chunk_elements(acc))
    of = flat(out)
    base = ctx.rank * count

    def owned(lo: int, hi: int) -> None:
        ops.finalize(acc[lo:hi], op, ctx.world, of[lo - base:hi - base])

    posted = post_reduce_scatter(ctx, acc, seg_chunks)
    ctx.wait_all(run_reduce_scatter(ctx, acc, seg_chunks, posted, op, owned))


def all_gather(ctx: CallContext, x: np.ndarray, out: np.ndarray) -> None:
    """``out`` (world * count) = every rank's ``x`` (count), in rank order."""
    of = flat(out)
    count = x.size
    seg_chunks = segment_chunks([(i * count, (i + 1) * count) for i in range(ctx.world)], chunk_elements(of))
    posted = post_all_gather(ctx, of, seg_chunks)
    lo, hi = ctx.rank * count, (ctx.rank + 1) * count
    of[lo:hi] = flat(x)
    right = (ctx.rank + 1) % ctx.world
    run_all_gather(ctx, of, posted, [ctx.isend(right, of[a:b]) for a, b in seg_chunks[ctx.rank]])


def chunk_elements(a: np.ndarray) -> int:
    return max(1, CHUNK_BYTES // a.itemsize)
