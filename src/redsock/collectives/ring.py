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
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import ops
from ..transport import Handle
from .context import CallContext, chunks, flat, partition

CHUNK_BYTES = 1 << 20  # pipeline granularity (measured: see README "Tuning")


def reduce_scatter_steps(ctx: CallContext, acc: np.ndarray, bounds: list[tuple[int, int]], op: ops.ReduceOp,
                         on_owned_chunk: Callable[[int, int], None], per: int) -> list[Handle]:
    """Ring reduce-scatter over ``acc`` (flat, accumulation dtype) cut at ``bounds``.

    Calls ``on_owned_chunk(lo, hi)`` for each chunk (``per`` elements) of this rank's own
    segment as soon as it is fully reduced.  Returns the send handles still in flight.
    """
    n, r = ctx.world, ctx.rank
    right, left = (r + 1) % n, (r - 1) % n
    seg_chunks = [chunks(lo, hi, per) for lo, hi in bounds]
    sends = [ctx.isend(right, acc[lo:hi]) for lo, hi in seg_chunks[(r - 1) % n]]
    tmp = np.empty(max(hi - lo for lo, hi in bounds), acc.dtype)
    for step in range(n - 1):
        seg = (r - step - 2) % n
        base = bounds[seg][0]
        recvs = [ctx.irecv(left, tmp[lo - base:hi - base]) for lo, hi in seg_chunks[seg]]
        for (lo, hi), h in zip(seg_chunks[seg], recvs):
            ctx.wait(h)
            ops.combine(acc[lo:hi], tmp[lo - base:hi - base], op)
            if step < n - 2:
                sends.append(ctx.isend(right, acc[lo:hi]))
            else:
                on_owned_chunk(lo, hi)
    return sends


def all_gather_steps(ctx: CallContext, out: np.ndarray, bounds: list[tuple[int, int]], sends: list[Handle],
                     per: int) -> None:
    """Ring all-gather into ``out`` (flat) in chunks of ``per`` elements: segment r is
    already in place at rank r (and usually already being sent: its handles are in ``sends``)."""
    n, r = ctx.world, ctx.rank
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        seg = (r - step - 1) % n
        pieces = chunks(*bounds[seg], per)
        recvs = [ctx.irecv(left, out[lo:hi]) for lo, hi in pieces]
        for (lo, hi), h in zip(pieces, recvs):
            ctx.wait(h)
            if step < n - 2:
                sends.append(ctx.isend(right, out[lo:hi]))
    ctx.wait_all(sends)


def all_reduce(ctx: CallContext, x: np.ndarray, op: ops.ReduceOp) -> None:
    """In-place ring all-reduce of ``x`` (C-contiguous)."""
    xf = flat(x)
    acc = xf if ops.accum_dtype(x.dtype) == x.dtype else ops.init_acc(xf)
    bounds = partition(xf.size, ctx.world)
    right = (ctx.rank + 1) % ctx.world
    ag_sends: list[Handle] = []

    def owned(lo: int, hi: int) -> None:
        # Final for every rank: round once and start the all-gather with it right away.
        # (Receiving into x while reduce-scatter sends from it are in flight is safe: a
        # segment's final value only comes back after our contribution to it was delivered.)
        ops.finalize(acc[lo:hi], op, ctx.world, xf[lo:hi])
        ag_sends.append(ctx.isend(right, xf[lo:hi]))

    per = chunk_elements(acc)  # one chunking for both phases: owned chunks start the all-gather
    rs_sends = reduce_scatter_steps(ctx, acc, bounds, op, owned, per)
    all_gather_steps(ctx, xf, bounds, ag_sends + rs_sends, per)


def reduce_scatter(ctx: CallContext, x: np.ndarray, out: np.ndarray, op: ops.ReduceOp) -> None:
    """``out`` (count elements) = reduced segment ``rank`` of ``x`` (world * count elements)."""
    xf = flat(x)
    acc = ops.init_acc(xf)  # the input is not modified
    count = out.size
    bounds = [(i * count, (i + 1) * count) for i in range(ctx.world)]
    of = flat(out)
    base = ctx.rank * count

    def owned(lo: int, hi: int) -> None:
        ops.finalize(acc[lo:hi], op, ctx.world, of[lo - base:hi - base])

    ctx.wait_all(reduce_scatter_steps(ctx, acc, bounds, op, owned, chunk_elements(acc)))


def all_gather(ctx: CallContext, x: np.ndarray, out: np.ndarray) -> None:
    """``out`` (world * count) = every rank's ``x`` (count), in rank order."""
    of = flat(out)
    count = x.size
    bounds = [(i * count, (i + 1) * count) for i in range(ctx.world)]
    lo, hi = bounds[ctx.rank]
    of[lo:hi] = flat(x)
    right = (ctx.rank + 1) % ctx.world
    per = chunk_elements(of)
    sends = [ctx.isend(right, of[a:b]) for a, b in chunks(lo, hi, per)]
    all_gather_steps(ctx, of, bounds, sends, per)


def chunk_elements(a: np.ndarray) -> int:
    return max(1, CHUNK_BYTES // a.itemsize)
