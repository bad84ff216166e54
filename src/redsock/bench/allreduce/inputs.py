"""The all-reduce benchmark's inputs and their float64 references (``--check``, the soak, the tests).

Values whose exact reduction is representable in every dtype, so that a result is judged
element by element against a closed-form reference rather than against another implementation.
"""

from __future__ import annotations

import numpy as np

from ... import ops

#: Every input repeats with this period (``i * 7 % 11`` and ``i % 2`` below), so an input, and
#: its reference, is one period tiled: building them costs a copy, not integer arithmetic per element.
INPUT_PERIOD = 22


def make_input(count: int, dtype: np.dtype, op: ops.ReduceOp, rank: int, seed: int, start: int = 0) -> np.ndarray:
    """Elements ``start .. start+count`` of a rank's input: values whose exact reduction is
    representable in every dtype (small integers; for prod, ones and twos), so a float64
    reference is exact too."""
    return _tiled(_input_period(dtype, op, rank, seed, start), count)


def _tiled(period: np.ndarray, count: int) -> np.ndarray:
    """``count`` elements of ``period`` repeated (np.resize concatenates one array per period: slow)."""
    return np.tile(period, -(-count // period.size))[:count]


def _input_period(dtype: np.dtype, op: ops.ReduceOp, rank: int, seed: int, start: int) -> np.ndarray:
    """Elements ``start .. start+INPUT_PERIOD`` of a rank's input."""
    i = np.arange(start % INPUT_PERIOD, start % INPUT_PERIOD + INPUT_PERIOD, dtype=np.int64)
    if op is ops.ReduceOp.PROD:
        vals = 1 + ((i + rank + seed) % 2)
    else:
        vals = (i * 7 + rank * 3 + seed) % 11 - 5
        if dtype == np.uint8:
            vals = np.abs(vals)
    return vals.astype(dtype)


def timing_input(count: int, dtype: np.dtype, op: ops.ReduceOp, rank: int) -> np.ndarray:
    """A rank's input for the timed calls, which reduce the same buffer in place again and
    again: values the op leaves as they are (0 for sum and avg, 1 for prod; min and max settle
    after one call), so no call computes with overflowed values (the check's inputs grow
    N-fold per sum: float32 reaches inf after ~60 calls on 4 ranks, and numpy warns)."""
    if op in (ops.ReduceOp.SUM, ops.ReduceOp.AVG):
        return np.zeros(count, dtype)
    if op is ops.ReduceOp.PROD:
        return np.ones(count, dtype)
    return make_input(count, dtype, op, rank, 0)


def reference(count: int, dtype: np.dtype, op: ops.ReduceOp, world: int, seed: int, start: int = 0) -> np.ndarray:
    """The float64 result for elements ``start .. start+count``."""
    period = reference_of([_input_period(dtype, op, r, seed, start).astype(np.float64) for r in range(world)],
                          op, dtype)
    return _tiled(period, count)


def reference_of(xs: list[np.ndarray], op: ops.ReduceOp, dtype: np.dtype) -> np.ndarray:
    """The float64 reduction of the ranks' inputs ``xs`` (float64 arrays) for a ``dtype`` all-reduce."""
    if op in (ops.ReduceOp.SUM, ops.ReduceOp.AVG):
        ref = np.sum(xs, axis=0)
        if op is ops.ReduceOp.AVG:
            ref = np.trunc(ref / len(xs)) if dtype.kind in "iu" else ref / len(xs)
    elif op is ops.ReduceOp.PROD:
        ref = np.prod(xs, axis=0)
    elif op is ops.ReduceOp.MIN:
        ref = np.min(xs, axis=0)
    else:
        ref = np.max(xs, axis=0)
    return ref


def count_wrong(result: np.ndarray, ref64: np.ndarray) -> int:
    """Elements further than one rounding (1 ulp of the dtype) from the float64 reference."""
    if result.dtype.kind in "iu":
        return int(np.count_nonzero(result.astype(np.float64) != ref64))
    want = ref64.astype(result.dtype)
    # An element with the bits of the rounded reference is within half an ulp: only the others
    # need the float64 arithmetic (most results are exact, so this is one compare per element).
    bits = np.dtype(f"u{result.itemsize}")
    suspects = np.flatnonzero(result.view(bits) != want.view(bits))
    got = result[suspects].astype(np.float64)
    ulp = np.spacing(np.abs(want[suspects])).astype(np.float64)
    return int(np.count_nonzero(np.abs(got - ref64[suspects]) > ulp))
