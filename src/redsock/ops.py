"""Dtypes and reduction kernels: the arithmetic of every all-reduce, with no I/O.

Everything that combines contributions (ring steps, the small-message algorithm,
the reduction server) goes through three calls, so that every path rounds the
same way:

    acc = init_acc(first)              # accumulator in accum_dtype(first.dtype)
    combine(acc, x, op)                # acc = acc (op) x, in place, once per contribution
    finalize(acc, op, n, out)          # avg divides by n; rounds once into the user's dtype

:func:`accumulate` and :func:`reduce_rows` are those calls over several contributions at
once (the latter straight into ``out`` where nothing needs widening or dividing).

Semantics:

* float16 and bfloat16 accumulate in float32 and are rounded to their own dtype
  once, in :func:`finalize` (round to nearest even).  Every other dtype
  accumulates in itself; integers wrap in two's complement like numpy (and NCCL).
* ``avg`` sums, then divides by ``n`` at the end: floats in the accumulation
  dtype, integers with truncation toward zero (C/NCCL integer division, exact
  for int64; the sum itself wraps first).
* ``min``/``max`` propagate NaN (``np.minimum``/``np.maximum``).
* The result depends only on the order of :func:`combine` calls; callers that
  promise bitwise reproducibility combine in rank order.
* Overflow to inf and NaN are data, not errors. :func:`finalize` silences numpy's
  warnings (a 16-bit sum overflowing to inf is routine with loss scaling);
  :func:`combine` is left to the caller's ``np.errstate`` because entering one costs
  more than a small-message combine itself (wrap the whole loop once if needed).

A float32 sum/avg may travel on a 16-bit *wire* (:func:`wire_dtype`): each contribution is
rounded to bfloat16 or float16 once (:func:`to_wire`), contributions are still summed in
float32, and the result is rounded once for the way back and widened once (:func:`from_wire`).
:func:`wire_error_bound` is the resulting bound against exact arithmetic.

Wire codes (one byte each) are part of the wire format: never renumber them.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike

from .errors import ConfigError, ProtocolError, WireOverflow

__all__ = [
    "SUPPORTED_DTYPES", "ReduceOp", "accum_dtype", "accumulate", "bfloat16", "check_dtype", "combine", "copy",
    "dtype_code", "dtype_from_code", "dtype_from_name", "finalize", "init_acc", "reduce_arrays", "reduce_rows",
    "row_reducer", "WIRE_DTYPES", "WIRE_NAMES", "check_wire_code", "check_wire_result", "from_wire", "to_wire",
    "wire_dtype", "wire_error_bound", "wire_for",
]

bfloat16: np.dtype = np.dtype(ml_dtypes.bfloat16)
_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)

# (canonical name, dtype, wire code).  Code 0 is reserved so that a zeroed header never decodes.
_DTYPE_TABLE: tuple[tuple[str, np.dtype, int], ...] = (
    ("float32", _F32, 1),
    ("float64", np.dtype(np.float64), 2),
    ("float16", _F16, 3),
    ("bfloat16", bfloat16, 4),
    ("int8", np.dtype(np.int8), 5),
    ("uint8", np.dtype(np.uint8), 6),
    ("int32", np.dtype(np.int32), 7),
    ("int64", np.dtype(np.int64), 8),
)
SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(dt for _, dt, _ in _DTYPE_TABLE)
_CODE_OF: dict[np.dtype, int] = {dt: code for _, dt, code in _DTYPE_TABLE}
_DTYPE_OF_CODE: dict[int, np.dtype] = {code: dt for _, dt, code in _DTYPE_TABLE}
# "float" and "int" are left out on purpose: numpy and C/NCCL disagree on their width.
_DTYPE_OF_NAME: dict[str, np.dtype] = {
    **{name: dt for name, dt, _ in _DTYPE_TABLE},
    "bf16": bfloat16, "fp16": _F16, "half": _F16, "fp32": _F32,
    "fp64": np.dtype(np.float64), "double": np.dtype(np.float64),
}
_SUPPORTED_NAMES = ", ".join(name for name, _, _ in _DTYPE_TABLE)
_ACCUM: dict[np.dtype, np.dtype] = {dt: (_F32 if dt in (_F16, bfloat16) else dt) for dt in SUPPORTED_DTYPES}


def dtype_from_name(name: str) -> np.dtype:
    """``"bfloat16"`` (or an alias: bf16, fp16, half, fp32, fp64, double) -> dtype.

    Raises :class:`ConfigError` for any other name.
    """
    try:
        return _DTYPE_OF_NAME[name.strip().lower()]
    except (KeyError, AttributeError):
        raise ConfigError(f"unsupported dtype {name!r}; supported: {_SUPPORTED_NAMES}") from None


def check_dtype(dtype: DTypeLike) -> np.dtype:
    """Normalise ``dtype`` (a dtype, scalar type or name) and check it is supported.

    Raises :class:`ConfigError` naming the supported dtypes otherwise (including
    byte-swapped dtypes: the wire is little-endian, native order).
    """
    if isinstance(dtype, np.dtype) and dtype in _CODE_OF:  # the common case, first: it is on every call's path
        return dtype
    if isinstance(dtype, str):
        return dtype_from_name(dtype)
    if dtype is None:  # np.dtype(None) would silently mean float64
        raise ConfigError(f"dtype is required; supported: {_SUPPORTED_NAMES}")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ConfigError(f"unsupported dtype {dtype!r}; supported: {_SUPPORTED_NAMES}") from None
    if dt not in _CODE_OF:
        raise ConfigError(f"unsupported dtype {dt}; supported: {_SUPPORTED_NAMES}")
    return dt


def dtype_code(dtype: DTypeLike) -> int:
    """The one-byte wire code of ``dtype``; :class:`ConfigError` if unsupported."""
    return _CODE_OF[check_dtype(dtype)]


def dtype_from_code(code: int) -> np.dtype:
    """Inverse of :func:`dtype_code`; :class:`ProtocolError` for an unknown code (bad peer bytes)."""
    try:
        return _DTYPE_OF_CODE[code]
    except (KeyError, TypeError):
        raise ProtocolError(f"unknown dtype code {code!r} on the wire") from None


def accum_dtype(dtype: DTypeLike) -> np.dtype:
    """The dtype contributions of ``dtype`` are accumulated in (float32 for 16-bit floats)."""
    return _ACCUM[check_dtype(dtype)]


class ReduceOp(enum.Enum):
    """Reduction operators; the value is the one-byte wire code (0 reserved)."""

    SUM = 1
    AVG = 2
    MIN = 3
    MAX = 4
    PROD = 5

    # Members are singletons: the identity hash (in C) instead of Enum's, a Python call on
    # every dict lookup keyed by an op (a small collective makes a few).
    __hash__ = object.__hash__

    def __init__(self, code: int) -> None:
        # The wire code as a plain attribute: Enum's ``value`` is a Python-level property,
        # read on every call's way out.
        self.code = code

    @classmethod
    def from_code(cls, code: int) -> ReduceOp:
        """Decode a wire code; :class:`ProtocolError` for an unknown one."""
        try:
            return _OP_OF_CODE[code]  # a dict lookup: the reducer decodes one per record
        except (KeyError, TypeError):
            raise ProtocolError(f"unknown reduction op code {code!r} on the wire") from None

    @classmethod
    def parse(cls, op: Any) -> ReduceOp:
        """A ReduceOp, a name (case-insensitive; also "mean", "product"), or any
        enum-like object with a matching ``.name`` such as ``torch.distributed.ReduceOp.SUM``.

        Raises :class:`ConfigError` for anything else.
        """
        if isinstance(op, cls):
            return op
        found = OP_OF_NAME.get(op) if isinstance(op, str) else None  # ("sum": no strip, no lower)
        if found is not None:
            return found
        name = op if isinstance(op, str) else getattr(op, "name", None)
        if isinstance(name, str):
            found = OP_OF_NAME.get(name.strip().lower())
            if found is not None:
                return found
        raise ConfigError(f"unsupported reduction op {op!r}; supported: sum, avg, min, max, prod")


#: The ops by their names as :meth:`ReduceOp.parse` takes them first (exact, lower case).
OP_OF_NAME: dict[str, ReduceOp] = {
    **{op.name.lower(): op for op in ReduceOp}, "mean": ReduceOp.AVG, "product": ReduceOp.PROD,
}
_OP_OF_CODE: dict[int, ReduceOp] = {op.value: op for op in ReduceOp}
# avg accumulates a sum and divides in finalize().
_UFUNC: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum, ReduceOp.PROD: np.multiply,
}

# Large 16-bit contributions are widened to float32 in blocks through a scratch buffer that
# stays in L2 (1 MiB), then combined from there. For float16 this replaces numpy's cast, which
# converts one element at a time (~2 ns/element); for bfloat16 (whose ml_dtypes cast is already
# vectorised) it only pays once the arrays no longer fit in cache. Below the thresholds the
# extra ufunc calls per block cost more than they save. Measured on the 2-core lab machine,
# 4 Mi elements into float32: float16 9.5 -> 2.4 ms, bfloat16 1.8 -> 1.2 ms.
_BLOCK = 1 << 18
_BLOCKED_MIN: dict[np.dtype, int] = {_F16: 1 << 13, bfloat16: 1 << 21}

# float16 -> float32 by bit manipulation (see _widen_f16): keep the sign (bit 31) and the
# exponent+mantissa that land in bits 13..27, then rebias the exponent by 2**(127-15).
_F16_KEEP = np.int32(-0x70000000 - 1)  # 0x8FFFFFFF as int32
_F16_REBIAS = np.float32(2.0**112)
_F16_EXP_MASK = np.uint16(0x7FFF)
_F16_INF = 0x7C00
_DENORMAL_PROBE = np.array([2.0**-140], dtype=np.float32)


def _denormals_work() -> bool:
    # The float16 fast path multiplies float32 denormals (from float16 subnormals); with
    # DAZ set in this thread (e.g. torch.set_flush_denormal(True)) they would read as zero.
    return bool(np.multiply(_DENORMAL_PROBE, _F16_REBIAS)[0] != 0)


def _widen_f16(h: np.ndarray, out: np.ndarray, tmp: np.ndarray) -> None:
    """``out[:] = h`` exactly, for a 1-D float16 block ``h`` into float32 ``out``.

    About 4x faster than numpy's cast, which converts element by element. ``tmp`` is a
    uint16 scratch block of the same length.
    """
    bits = out.view(np.int32)
    np.copyto(bits, h.view(np.int16))  # sign-extend: the sign fills bits 15..31
    np.left_shift(bits, 13, out=bits)  # exponent -> bits 23..27, mantissa -> 13..22
    np.bitwise_and(bits, _F16_KEEP, out=bits)  # drop the sign copies in bits 28..30
    # Exact: subnormal halves become float32 denormals here and come out normalised.
    np.multiply(out, _F16_REBIAS, out=out)
    np.bitwise_and(h.view(np.uint16), _F16_EXP_MASK, out=tmp)
    if tmp.max() >= _F16_INF:  # inf/NaN need exponent 255, not 31+112: rare, let numpy do it
        np.copyto(out, h)


def _blocked(acc: np.ndarray, x: np.ndarray) -> bool:
    """Whether ``x`` (16-bit) should be widened block by block into float32 ``acc``."""
    return (
        x.size >= _BLOCKED_MIN[x.dtype]
        and acc.flags.c_contiguous
        and x.flags.c_contiguous
        and (x.dtype == bfloat16 or _denormals_work())
    )


def _widen_blocks(x: np.ndarray, dst: np.ndarray | None, apply: Callable[[int, int, np.ndarray], object]) -> None:
    """Widen 16-bit ``x`` block by block to float32 and hand each block to ``apply(lo, hi, block)``.

    The block is written into ``dst[lo:hi]`` when ``dst`` is given (no scratch), else into a
    scratch buffer reused across blocks.
    """
    v = x.reshape(-1)
    n = v.size
    reuse = dst is None
    into = np.empty(min(_BLOCK, n), _F32) if dst is None else dst
    tmp = np.empty(min(_BLOCK, n), np.uint16) if x.dtype == _F16 else None
    for lo in range(0, n, _BLOCK):
        hi = min(lo + _BLOCK, n)
        block = into[: hi - lo] if reuse else into[lo:hi]
        if tmp is None:
            np.copyto(block, v[lo:hi])  # ml_dtypes' bfloat16 cast is a vectorised shift
        else:
            _widen_f16(v[lo:hi], block, tmp[: hi - lo])
        apply(lo, hi, block)


def _check_pair(acc: np.ndarray, x: np.ndarray, what: str) -> None:
    dt = x.dtype
    if dt not in _ACCUM:  # a dict lookup: this runs on every small-message step
        check_dtype(dt)
    if acc.dtype != dt and acc.dtype != _ACCUM[dt]:
        raise ConfigError(f"{what}: accumulator dtype {acc.dtype} does not match {dt} "
                          f"(expected {_ACCUM[dt]} or {dt})")
    if acc.shape != x.shape:
        raise ConfigError(f"{what}: shape {acc.shape} does not match {x.shape}")


#: glibc (2.36 here) copies from a few KiB to about 3/4 MiB with ``rep movsb``, which AMD Zen runs
#: about 10x slower when the destination lies 1-31 bytes past the source modulo a 4 KiB page
#: (measured here, 256 KiB alone: 13 us against 150 us; 4 ranks copying 4 x 256 KiB out of
#: shared memory: 850 us against 230 us).  numpy's large buffers start 16 bytes into a page.
#: Below 128 KiB, with the source in another core's cache, memcpy's penalty was smaller than
#: the ufunc's cost (4 x 64 KiB: 29-37 us against 65 us).
_PAGE = 4096
_ALIASED_BELOW = 64
#: Below this many bytes :func:`copy` is a plain copy.
ALIAS_MIN_BYTES = 128 * 1024


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src``, bit for bit, without memcpy's page-aliased slow case: an aliased
    pair of contiguous same-dtype arrays is copied by a ufunc loop over their bytes."""
    if (dst.nbytes >= ALIAS_MIN_BYTES and dst.dtype == src.dtype and dst.shape == src.shape
            and dst.flags.c_contiguous and src.flags.c_contiguous
            and 0 < (dst.ctypes.data - src.ctypes.data) % _PAGE < _ALIASED_BELOW):
        np.positive(src.reshape(-1).view(np.uint8), out=dst.reshape(-1).view(np.uint8))
    else:
        dst[...] = src


def init_acc(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """A new accumulator holding ``x`` alone, in ``accum_dtype(x.dtype)``.

    Pass ``out`` (that dtype and shape) to reuse a buffer instead of allocating.
    Raises :class:`ConfigError` for an unsupported dtype or a mismatched ``out``.
    """
    dt = _ACCUM[check_dtype(x.dtype)]
    if out is None:
        out = np.empty(x.shape, dt)
    elif out.dtype != dt or out.shape != x.shape:
        raise ConfigError(f"init_acc: out must be {dt}{x.shape}, got {out.dtype}{out.shape}")
    if dt != x.dtype and _blocked(out, x):
        _widen_blocks(x, out.reshape(-1), lambda lo, hi, block: None)
    elif dt == x.dtype:
        copy(out, x)
    else:
        np.copyto(out, x)
    return out


def ufunc_of(op: ReduceOp | str) -> np.ufunc:
    """The ufunc that combines two contributions under ``op`` (``avg`` adds)."""
    return _UFUNC[ReduceOp.parse(op)]


def combine(acc: np.ndarray, x: np.ndarray, op: ReduceOp | str) -> None:
    """``acc = acc (op) x`` in place (``avg`` adds).

    ``acc`` has ``accum_dtype(x.dtype)`` (or ``x.dtype`` itself, which for 16-bit floats
    rounds at every step) and the same shape as ``x``. One ufunc call over the arrays
    for same-dtype operands (float32 sum: a single ``np.add(acc, x, out=acc)``); 16-bit
    contributions are widened in L2-sized blocks. Raises :class:`ConfigError` on a
    dtype/shape mismatch or an unknown op.
    """
    ufunc = ufunc_of(op)
    _check_pair(acc, x, "combine")
    if acc.dtype == x.dtype or not _blocked(acc, x):
        ufunc(acc, x, out=acc)  # for a 16-bit x numpy widens it exactly on the fly
        return
    a = acc.reshape(-1)  # a view: _blocked() checked contiguity
    _widen_blocks(x, None, lambda lo, hi, block: ufunc(a[lo:hi], block, out=a[lo:hi]))


def _trunc_div(acc: np.ndarray, n: int, out: np.ndarray) -> None:
    """``out = acc / n`` truncated toward zero, exactly, for integer ``acc``."""
    # n must be representable in the dtype for numpy's scalar rules; int64 always holds it.
    work = acc if n <= np.iinfo(acc.dtype).max else acc.astype(np.int64)
    rem = np.empty_like(work)  # explicit out: a 0-d input would otherwise give a scalar
    np.fmod(work, n, out=rem)  # C remainder: takes the sign of the dividend
    np.subtract(work, rem, out=rem)  # an exact multiple of n, no larger in magnitude: no overflow
    # Exact division, so floor == trunc; |quotient| <= |acc| always fits back into out's dtype.
    np.floor_divide(rem, n, out=out, casting="unsafe")


def finalize(acc: np.ndarray, op: ReduceOp | str, n: int, out: np.ndarray) -> np.ndarray:
    """Write the result of ``n`` combined contributions into ``out`` (the user's dtype) and return it.

    ``avg`` divides by ``n`` (floats in the accumulation dtype, integers truncating toward
    zero); 16-bit results are rounded once, here. ``out`` may be ``acc`` itself when the
    dtypes agree; ``acc`` is not modified otherwise. Raises :class:`ConfigError` on a
    dtype/shape mismatch, an unknown op or ``n < 1``.
    """
    op = ReduceOp.parse(op)
    _check_pair(acc, out, "finalize")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ConfigError(f"finalize: n must be a positive integer, got {n!r}")
    n = int(n)
    if op is ReduceOp.AVG:
        if acc.dtype.kind in "iu":
            _trunc_div(acc, n, out)
        else:
            with np.errstate(over="ignore", invalid="ignore", under="ignore"):
                np.divide(acc, n, out=out)  # divided in float32/64, then rounded once into out
    elif out.dtype == acc.dtype:
        if not _same_memory(out, acc):  # views of the same memory (the ring's in-place sum): nothing to copy
            copy(out, acc)
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # float32 sums beyond 65504 become inf
            np.copyto(out, acc, casting="same_kind")
    return out


def accumulate(rows: Sequence[np.ndarray], op: ReduceOp | str, out: np.ndarray | None = None) -> np.ndarray:
    """``rows`` (contributions, in order) combined into an accumulator, ``out`` if given
    (``accum_dtype``, their shape): :func:`init_acc` and one :func:`combine` per further row."""
    acc = init_acc(rows[0], out)
    for x in rows[1:]:
        combine(acc, x, op)
    return acc


def reduce_rows(rows: np.ndarray | Sequence[np.ndarray], op: ReduceOp | str, n: int, out: np.ndarray,
                scratch: Callable[[int, np.dtype], np.ndarray] | None = None) -> np.ndarray:
    """The result of ``rows`` (contributions in order, ``n`` in all across callers) written
    into ``out`` (their dtype and shape), and returned: the same bits as
    init_acc/combine/finalize over them.

    ``rows`` is a 2-D array (one ufunc call over it, 16-bit floats widened by numpy's cast:
    for small buffers, where per-call overhead dominates) or a sequence of arrays (one ufunc
    call per row, straight into ``out`` when there is nothing to widen or divide; else
    through an accumulator from ``scratch(count, dtype)``, or a new one).
    """
    op = ReduceOp.parse(op)
    wide = _ACCUM[check_dtype(out.dtype)]
    ufunc = _UFUNC[op]
    direct = wide == out.dtype and op is not ReduceOp.AVG  # nothing to finish: reduce straight into out
    if isinstance(rows, np.ndarray):
        if direct:
            return ufunc.reduce(rows, axis=0, out=out)
        return finalize(ufunc.reduce(rows, axis=0, dtype=wide), op, n, out)
    if not direct:
        acc = None if scratch is None else scratch(out.size, wide).reshape(out.shape)
        return finalize(accumulate(rows, op, acc), op, n, out)
    return _combine_into(ufunc, rows, out)


def row_reducer(dtype: np.dtype, op: ReduceOp, n: int,
                own: int | None = None) -> Callable[[Sequence[np.ndarray], np.ndarray], np.ndarray]:
    """:func:`reduce_rows` for small rows of ``dtype`` (``n`` contributions in all), with its
    checks and lookups done once: ``reducer(rows, out)`` writes the result into ``out`` and
    returns it, the same bits as ``reduce_rows(rows, op, n, out)``.  A call that moves a few
    bytes repeats a few shapes, and its every line counts (each runs cache-cold after the
    process switch of an oversubscribed host).  Rows are combined in order, one ufunc call
    per row; 16-bit floats through a float32 accumulator.

    With ``own`` (a row's index), ``reducer(rows, scratch)`` writes the result over
    ``rows[own]`` instead, the same bits: the caller's own contribution becomes the result
    where it lies, with no copy out.  The rows before it are combined in ``scratch`` (a
    row's shape and dtype), as the ufuncs would otherwise overwrite ``rows[own]`` before
    reading it."""
    if own is not None and (isinstance(own, bool) or not isinstance(own, int) or not 0 <= own < n):
        raise ConfigError(f"row_reducer: own must be a row index below {n}, got {own!r}")
    return _row_reducer(check_dtype(dtype), ReduceOp.parse(op), int(n), own)


@functools.lru_cache(maxsize=None)
def _row_reducer(dtype: np.dtype, op: ReduceOp, n: int,
                 own: int | None) -> Callable[[Sequence[np.ndarray], np.ndarray], np.ndarray]:
    if n < 1:
        raise ConfigError(f"row_reducer: n must be a positive integer, got {n!r}")
    ufunc, wide = _UFUNC[op], _ACCUM[dtype]
    if wide != dtype:  # widen, combine, round once (the accumulator is a row of its own)
        def reduce(rows: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
            acc = rows[0].astype(wide)
            for x in rows[1:]:
                ufunc(acc, x, out=acc)
            return finalize(acc, op, n, out if own is None else rows[own])
    elif op is ReduceOp.AVG:  # the sum in place, divided there
        def reduce(rows: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
            result = _combine_into(ufunc, rows, out, own)
            return finalize(result, op, n, result)
    elif own is not None:
        def reduce(rows: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
            return _combine_into(ufunc, rows, out, own)
    else:  # _combine_into's steps, with nothing left to decide per row (out positional: cheaper)
        def reduce(rows: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
            if len(rows) == 1:
                return _combine_into(ufunc, rows, out)
            ufunc(rows[0], rows[1], out)
            for row in rows[2:]:
                ufunc(out, row, out)
            return out
    return reduce


def _combine_into(ufunc: np.ufunc, rows: Sequence[np.ndarray], out: np.ndarray, own: int | None = None) -> np.ndarray:
    """Rows combined in order into ``out``; with ``own``, over ``rows[own]`` instead, ``out``
    holding the partial result until the step that reads ``rows[own]``, which writes over it
    element by element (a ufunc may write over an operand it reads at the same place)."""
    dest = out if own is None else rows[own]
    if len(rows) == 1:
        if own is None:
            copy(out, rows[0])
        return dest
    acc = dest if own is None or own <= 1 else out
    ufunc(rows[0], rows[1], out=acc)
    for i in range(2, len(rows)):
        if i == own:
            ufunc(acc, dest, out=dest)
            acc = dest
        else:
            ufunc(acc, rows[i], out=acc)
    return dest


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """True if ``a`` and ``b`` are the very same elements (not merely overlapping)."""
    return a is b or (a.dtype == b.dtype and a.shape == b.shape and a.strides == b.strides
                      and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def reduce_arrays(arrays: Sequence[np.ndarray], op: ReduceOp | str = ReduceOp.SUM) -> np.ndarray:
    """Reduce equal-shape, equal-dtype arrays in list order, as a collective would.

    The single-process path and the reference the tests use: the same
    init_acc/combine/finalize sequence as every algorithm. Returns a new array.
    Raises :class:`ConfigError` for an empty list, mixed dtypes/shapes or an unknown op.
    """
    op = ReduceOp.parse(op)
    if len(arrays) == 0:
        raise ConfigError("reduce_arrays needs at least one array")
    rows = [np.asarray(x) for x in arrays]
    first = rows[0]
    for x in rows[1:]:
        if x.dtype != first.dtype:
            raise ConfigError(f"reduce_arrays: mixed dtypes {first.dtype} and {x.dtype}")
    acc = accumulate(rows, op)
    out = acc if acc.dtype == first.dtype else np.empty(first.shape, first.dtype)
    return finalize(acc, op, len(arrays), out)


# --- the 16-bit wire for float32 ------------------------------------------------------------

#: The wire types of a float32 sum, by the names REDSOCK_WIRE_DTYPE takes.
WIRE_DTYPES: dict[str, np.dtype] = {"bf16": bfloat16, "fp16": _F16}
WIRE_NAMES: dict[np.dtype, str] = {dt: name for name, dt in WIRE_DTYPES.items()}
#: Ops whose result the wire's bound covers (a sum, or a sum divided once).
_WIRE_OPS = (ReduceOp.SUM, ReduceOp.AVG)
#: Unit roundoff (half the spacing at 1.0) and half the smallest subnormal of each wire type.
_UNIT_ROUNDOFF = {bfloat16: 2.0**-8, _F16: 2.0**-11}
_TINY_HALF = {bfloat16: 2.0**-134, _F16: 2.0**-25}
_F32_UNIT = 2.0**-24


def wire_dtype(name: str | np.dtype | None) -> np.dtype | None:
    """``"bf16"``/``"fp16"`` (or bfloat16/float16 by any name :func:`check_dtype` takes) -> the
    wire dtype; ``None``/``"off"`` -> None.  :class:`ConfigError` for anything else."""
    if name is None or (isinstance(name, str) and name.strip().lower() == "off"):
        return None
    dt = WIRE_DTYPES.get(name.strip().lower()) if isinstance(name, str) else None
    if dt is None:
        try:
            dt = check_dtype(name)
        except ConfigError:
            dt = None
        if dt not in _UNIT_ROUNDOFF:
            raise ConfigError(f"unsupported wire dtype {name!r}; choose off, bf16 or fp16")
    return dt


def wire_for(dtype: np.dtype, op: ReduceOp, wire: np.dtype | None, explicit: bool) -> np.dtype | None:
    """The wire type a call of ``dtype`` and ``op`` uses: ``wire`` for a float32 sum or avg,
    else None.  ``explicit`` (asked for by the call itself rather than the environment): any
    other dtype or op is a :class:`ConfigError` instead of a silent full-width call."""
    if wire is None:
        return None
    if dtype == _F32 and op in _WIRE_OPS:
        return wire
    if explicit:
        what = f"{dtype} buffers" if dtype != _F32 else f"op {op.name.lower()}"
        raise ConfigError(f"wire_dtype={WIRE_NAMES[wire]} applies to float32 sum/avg all-reduces only, "
                          f"not {what} (integers and float64 always travel as they are)")
    return None


def check_wire_code(dtype_code: int, wire_code: int) -> np.dtype:
    """The dtype a reducer sums pieces of: an announce's wire type (a 16-bit float, for float32
    data only) or, with wire code 0, the data's own.  :class:`ProtocolError` otherwise."""
    dt = dtype_from_code(dtype_code)
    if wire_code == 0:
        return dt
    wire = dtype_from_code(wire_code)
    if dt != _F32 or wire not in _UNIT_ROUNDOFF:
        raise ProtocolError(f"wire type {wire} for {dt} data: only float32 travels as bfloat16 or float16")
    return wire


def to_wire(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``x`` (float32) rounded once to nearest even into ``out`` (the 16-bit wire dtype).
    float16 overflow gives inf here, which :func:`check_wire_result` reports after the call."""
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(out, x, casting="same_kind")
    return out


def from_wire(w: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``w`` (16-bit) widened exactly into float32 ``out``."""
    return init_acc(w, out)


def check_wire_result(x: np.ndarray, wire: np.dtype | None) -> None:
    """After a call on the float16 wire: :class:`WireOverflow` if its float32 result holds an
    element that is not finite (its sum, or an input, passed 65504, or an input was inf/NaN).
    Every rank holds the same bits, so every rank raises alike."""
    if wire != _F16:
        return
    finite = np.isfinite(x)
    if finite.all():
        return
    bad = int(x.size - np.count_nonzero(finite))
    first = int(np.argmin(finite.reshape(-1)))
    raise WireOverflow(f"all-reduce on the fp16 wire: {bad} of {x.size} elements are not finite "
                       f"(first at index {first}): a sum or an input beyond fp16's 65504, or an input "
                       f"that was inf/NaN; use the bf16 wire (float32's range) or scale the values",
                       count=bad)


def wire_error_bound(abs_sum: np.ndarray, exact: np.ndarray, world: int, wire: np.dtype | str,
                     op: ReduceOp | str = ReduceOp.SUM) -> np.ndarray:
    """Per element, the largest error of a float32 all-reduce on ``wire`` against exact
    arithmetic: one rounding of each rank's input (or of each host's partial sum, whose
    magnitudes add up to no more), float32 accumulation, one rounding of the result.

    ``abs_sum``: sum over ranks of |input|, ``exact``: the exact sum (both float64, from the
    float32 inputs); ``op`` avg divides the bound by ``world`` as the result is divided.
    """
    on = wire_dtype(wire) if isinstance(wire, str) else wire
    if on is None:
        raise ConfigError("wire_error_bound needs a 16-bit wire (bf16 or fp16), got 'off'")
    u, tiny = _UNIT_ROUNDOFF[on], _TINY_HALF[on]
    a = np.asarray(abs_sum, np.float64)
    inputs = u * a + world * tiny + world * _F32_UNIT * (1 + u) * a  # + world: avg's division too
    bound = inputs + u * (np.abs(np.asarray(exact, np.float64)) + inputs)
    if ReduceOp.parse(op) is ReduceOp.AVG:  # divided before its rounding: all but the subnormal step
        bound /= world
    return bound + tiny
