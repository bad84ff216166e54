"""Latency-optimised algorithms for small messages.

All-reduce by recursive doubling: log2(N) exchange rounds of the whole buffer
(ring needs 2(N-1) steps).  With N not a power of two, the ranks above the
largest power of two P first hand their data to rank r-P and get the result
back at the end.  Partners combine each other's values with commutative
operations, so every rank ends with the same bits.

Broadcast by a binomial tree: log2(N) rounds.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from .context import CallContext, flat


def all_reduce(ctx: CallContext, x: np.ndarray, op: ops.ReduceOp, wire_dtype: np.dtype | None = None) -> None:
    """``wire_dtype`` is ignored: latency-bound, this carries float32 whatever the wire (halving
    its bytes would save nothing)."""
    n, r = ctx.world, ctx.rank
    xf = flat(x)
    acc = xf if ops.accum_dtype(x.dtype) == x.dtype else ops.init_acc(xf)
    p2 = 1 << (n.bit_length() - 1)
    extra = n - p2
    if r >= p2:  # folded in: contribute, then receive the final result
        ctx.wait(ctx.isend(r - p2, acc))
        ctx.wait(ctx.irecv(r - p2, xf))
        return
    tmp = ctx.scratch(acc.size, acc.dtype)
    if r < extra:
        ctx.wait(ctx.irecv(r + p2, tmp))
        ops.combine(acc, tmp, op)
    mask = 1
    while mask < p2:
        partner = r ^ mask
        h_recv = ctx.irecv(partner, tmp)
        h_send = ctx.isend(partner, acc)
        ctx.wait(h_recv)
        ctx.wait(h_send)  # acc is about to change: the send must have left it
        ops.combine(acc, tmp, op)
        mask <<= 1
    ops.finalize(acc, op, n, xf)
    if r < extra:
        ctx.wait(ctx.isend(r + p2, xf))


def broadcast(ctx: CallContext, x: np.ndarray, root: int) -> None:
    """Binomial tree from ``root``: in round k, ranks that have the data send to rank + 2^k."""
    n = ctx.world
    me = (ctx.rank - root) % n  # position relative to the root
    xf = flat(x)
    mask = 1
    while mask < n:  # receive once, from the rank that differs in our lowest set bit
        if me & mask:
            ctx.wait(ctx.irecv((me - mask + root) % n, xf))
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:
        if me + mask < n:
            sends.append(ctx.isend((me + mask + root) % n, xf))
        mask >>= 1
    ctx.wait_all(sends)
