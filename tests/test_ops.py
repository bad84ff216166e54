"""Reduction kernels against references computed independently here.

Floats are checked against float64 (16-bit results within one ulp of the float64
result rounded to the dtype), integers against Python integers wrapped to the
dtype's width, so nothing below reuses the code under test.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redsock import ops
from redsock.errors import ConfigError, ProtocolError
from redsock.ops import ReduceOp

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = ["float16", "bfloat16", "float32", "float64"]
INTS = ["int8", "uint8", "int32", "int64"]
ALL = FLOATS + INTS
OPS = list(ReduceOp)


def dt(name: str) -> np.dtype:
    return BF16 if name == "bfloat16" else np.dtype(name)


# ---------------------------------------------------------------- reference helpers

def wrap(v: int, dtype: np.dtype) -> int:
    """Python int -> the value two's-complement arithmetic in ``dtype`` produces."""
    bits = dtype.itemsize * 8
    v &= (1 << bits) - 1
    if dtype.kind == "i" and v >= 1 << (bits - 1):
        v -= 1 << bits
    return v


def trunc_div(a: int, n: int) -> int:
    q = abs(a) // n
    return q if a >= 0 else -q


def int_reference(rows: list[list[int]], op: ReduceOp, dtype: np.dtype) -> list[int]:
    out = []
    for col in zip(*rows, strict=True):
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            v = wrap(sum(col), dtype)
            v = trunc_div(v, len(col)) if op is ReduceOp.AVG else v
        elif op is ReduceOp.MIN:
            v = min(col)
        elif op is ReduceOp.MAX:
            v = max(col)
        else:
            v = wrap(math.prod(col), dtype)
        out.append(v)
    return out


def f64_reference(stack: np.ndarray, op: ReduceOp) -> np.ndarray:
    s = stack.astype(np.float64)
    with np.errstate(all="ignore"):
        return {
            ReduceOp.SUM: lambda: s.sum(axis=0),
            ReduceOp.AVG: lambda: s.sum(axis=0) / len(s),
            ReduceOp.MIN: lambda: s.min(axis=0),
            ReduceOp.MAX: lambda: s.max(axis=0),
            ReduceOp.PROD: lambda: s.prod(axis=0),
        }[op]()


def ordered(a: np.ndarray) -> np.ndarray:
    """Float bit patterns mapped to integers in value order, so |difference| counts ulps."""
    w = a.dtype.itemsize
    v = a.view(f"i{w}").astype(np.int64)
    mag = v & ((1 << (8 * w - 1)) - 1)
    return np.where(v < 0, -mag, mag)


def assert_within_ulps(got: np.ndarray, want: np.ndarray, ulps: int = 1) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    nan_g, nan_w = np.isnan(got), np.isnan(want)
    np.testing.assert_array_equal(nan_g, nan_w)
    diff = np.abs(ordered(got[~nan_g]) - ordered(want[~nan_w]))
    assert diff.size == 0 or diff.max() <= ulps, f"off by {diff.max()} ulps"


def stack_of(rows: list[np.ndarray]) -> np.ndarray:
    return np.stack(rows) if rows[0].ndim else np.array(rows)


# ---------------------------------------------------------------- dtypes and wire codes

def test_dtype_wire_codes_are_pinned_and_round_trip() -> None:
    # Wire format: these numbers must never change.
    want = {"float32": 1, "float64": 2, "float16": 3, "bfloat16": 4,
            "int8": 5, "uint8": 6, "int32": 7, "int64": 8}
    assert {name: ops.dtype_code(dt(name)) for name in ALL} == want
    for name, code in want.items():
        assert ops.dtype_from_code(code) == dt(name)
        assert ops.dtype_code(name) == code
    assert set(ops.SUPPORTED_DTYPES) == {dt(n) for n in ALL}


@pytest.mark.parametrize("code", [0, 9, 255, -1, "1", None])
def test_unknown_dtype_code_is_a_protocol_error(code: object) -> None:
    with pytest.raises(ProtocolError, match="dtype code"):
        ops.dtype_from_code(code)  # type: ignore[arg-type]


@pytest.mark.parametrize("name,want", [
    ("bfloat16", BF16), ("BF16", BF16), ("fp16", np.float16), ("half", np.float16),
    ("float32", np.float32), ("fp32", np.float32), (" float64 ", np.float64), ("double", np.float64),
    ("int8", np.int8), ("uint8", np.uint8), ("int32", np.int32), ("int64", np.int64),
])
def test_dtype_from_name(name: str, want: object) -> None:
    assert ops.dtype_from_name(name) == np.dtype(want)
    assert ops.check_dtype(name) == np.dtype(want)


@pytest.mark.parametrize("bad", [
    "float", "int", "complex64", "bool", "uint16", "", np.complex64, np.bool_, np.uint32,
    np.dtype(">f4"), None, object, ml_dtypes.float8_e4m3fn,
])
def test_bad_dtype_names_what_is_supported(bad: object) -> None:
    with pytest.raises(ConfigError, match="supported: float32, float64, float16, bfloat16, int8"):
        ops.check_dtype(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        ops.dtype_code(bad)  # type: ignore[arg-type]


def test_check_dtype_accepts_scalar_types_and_dtypes() -> None:
    assert ops.check_dtype(np.float32) == np.float32
    assert ops.check_dtype(ml_dtypes.bfloat16) == BF16
    assert ops.check_dtype(np.dtype("<i8")) == np.int64


def test_accum_dtype() -> None:
    assert {n: ops.accum_dtype(dt(n)) for n in ALL} == {
        "float16": np.float32, "bfloat16": np.float32, "float32": np.float32, "float64": np.float64,
        "int8": np.int8, "uint8": np.uint8, "int32": np.int32, "int64": np.int64,
    }


# ---------------------------------------------------------------- ReduceOp

def test_reduce_op_codes_are_pinned_and_round_trip() -> None:
    assert {op.name: op.code for op in ReduceOp} == {"SUM": 1, "AVG": 2, "MIN": 3, "MAX": 4, "PROD": 5}
    for op in ReduceOp:
        assert ReduceOp.from_code(op.code) is op


@pytest.mark.parametrize("code", [0, 6, 255, "1"])
def test_unknown_op_code_is_a_protocol_error(code: object) -> None:
    with pytest.raises(ProtocolError, match="op code"):
        ReduceOp.from_code(code)  # type: ignore[arg-type]


@pytest.mark.parametrize("text,want", [
    ("sum", ReduceOp.SUM), ("SUM", ReduceOp.SUM), (" Avg ", ReduceOp.AVG), ("mean", ReduceOp.AVG),
    ("min", ReduceOp.MIN), ("max", ReduceOp.MAX), ("prod", ReduceOp.PROD), ("product", ReduceOp.PROD),
    (ReduceOp.MAX, ReduceOp.MAX),
])
def test_reduce_op_parse(text: object, want: ReduceOp) -> None:
    assert ReduceOp.parse(text) is want


def test_reduce_op_parse_accepts_torch_ops() -> None:
    dist = pytest.importorskip("torch.distributed")
    assert ReduceOp.parse(dist.ReduceOp.SUM) is ReduceOp.SUM
    assert ReduceOp.parse(dist.ReduceOp.AVG) is ReduceOp.AVG
    assert ReduceOp.parse(dist.ReduceOp.PRODUCT) is ReduceOp.PROD


@pytest.mark.parametrize("bad", ["xor", "", "band", 1, None, ["sum"]])
def test_unknown_op_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="supported: sum, avg, min, max, prod"):
        ReduceOp.parse(bad)
    with pytest.raises(ConfigError):
        ops.reduce_arrays([np.zeros(2, np.float32)], bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- closed forms

def closed_form(op: ReduceOp, b: int, n: int) -> int | float:
    """Rank r contributes (r+1)*b: the result of reducing n ranks, exactly."""
    return {
        ReduceOp.SUM: b * n * (n + 1) // 2,
        ReduceOp.AVG: b * n * (n + 1) / 2 / n,
        ReduceOp.MIN: b if b >= 0 else b * n,
        ReduceOp.MAX: b * n if b >= 0 else b,
        ReduceOp.PROD: b**n * math.factorial(n),
    }[op]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", ALL)
def test_closed_form_per_rank_tables(name: str, op: ReduceOp, n: int) -> None:
    dtype = dt(name)
    base = [0, 1, 2, 3, 4] if name == "uint8" else [0, 1, 2, -1, -2]
    rows = [np.array([(r + 1) * b for b in base], dtype=dtype) for r in range(n)]
    got = ops.reduce_arrays(rows, op)
    assert got.dtype == dtype and got.shape == (5,)
    if dtype.kind in "iu":
        # The closed form on exact integers, then two's-complement wrap (avg: of the wrapped sum).
        if op is ReduceOp.AVG:
            want = [trunc_div(wrap(b * n * (n + 1) // 2, dtype), n) for b in base]
        else:
            want = [wrap(int(closed_form(op, b, n)), dtype) for b in base]
        assert got.tolist() == want
    else:
        with np.errstate(over="ignore"):
            want = np.array([closed_form(op, b, n) for b in base], dtype=np.float64).astype(dtype)
        assert_within_ulps(got, want)


# ---------------------------------------------------------------- random data

def random_float_rows(name: str, op: ReduceOp, n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if op is ReduceOp.PROD:  # magnitudes near 1 so the product stays in range
        vals = rng.uniform(0.5, 2.0, (n, size)) * rng.choice([-1.0, 1.0], (n, size))
    else:
        vals = rng.standard_normal((n, size)) * 3.0
    return [v.astype(dt(name)) for v in vals]


@pytest.mark.parametrize("size", [1, 3, 1001])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_16bit_within_one_ulp_of_float64(name: str, op: ReduceOp, size: int) -> None:
    rows = random_float_rows(name, op, 4, size, seed=size)
    got = ops.reduce_arrays(rows, op)
    want = f64_reference(stack_of(rows), op).astype(dt(name))
    assert_within_ulps(got, want, ulps=1)
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))


@pytest.mark.parametrize("size", [1, 3, 1001])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", ["float32", "float64"])
def test_wide_floats_against_float64_error_bound(name: str, op: ReduceOp, size: int) -> None:
    n = 5
    rows = random_float_rows(name, op, n, size, seed=size + 7)
    got = ops.reduce_arrays(rows, op).astype(np.float64)
    s = stack_of(rows).astype(np.float64)
    want = f64_reference(s, op)
    eps = float(np.finfo(dt(name)).eps)
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        np.testing.assert_array_equal(got, want)
        return
    # Sequential accumulation: each of the n-1 steps errs by at most eps/2 of the running
    # magnitude, bounded by sum|x| (prod: by |result|), plus the final division/rounding.
    if op is ReduceOp.PROD:
        bound = n * eps * np.abs(want)
    else:
        bound = (n - 1) * eps * np.abs(s).sum(axis=0) / (n if op is ReduceOp.AVG else 1)
        bound += eps * np.abs(want)
    assert np.all(np.abs(got - want) <= bound)


@pytest.mark.parametrize("size", [1, 3, 257])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", INTS)
def test_integers_exact_with_wraparound(name: str, op: ReduceOp, size: int) -> None:
    dtype = dt(name)
    info = np.iinfo(dtype)
    rng = np.random.default_rng(size)
    n = 4
    # Full-range values: sums and products overflow and must wrap exactly like C.
    rows = [rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True) for _ in range(n)]
    got = ops.reduce_arrays(rows, op)
    assert got.dtype == dtype
    assert got.tolist() == int_reference([r.tolist() for r in rows], op, dtype)


def test_int64_extremes_wrap_exactly() -> None:
    big = np.iinfo(np.int64).max
    rows = [np.array([big, -big - 1, big], np.int64) for _ in range(3)]
    got = ops.reduce_arrays(rows, "sum")
    assert got.tolist() == [wrap(3 * v, np.dtype(np.int64)) for v in (big, -big - 1, big)]


# ---------------------------------------------------------------- avg on integers

@pytest.mark.parametrize("name,values,want", [
    ("int32", [-7, 0], -3),  # floor division would give -4
    ("int32", [7, 0], 3),
    ("int32", [-5, -5, -6], -5),  # -16/3 = -5.33
    ("int8", [-128, 127], 0),  # -1/2
    ("int8", [100, 100], -28),  # the sum wraps to -56 first, like NCCL
    ("uint8", [250, 3], 126),
    ("uint8", [200, 100], 22),  # 300 wraps to 44
    ("int64", [2**61 + 1] * 3, 2**61 + 1),  # not representable in float64
    ("int64", [-(2**62) + 1, -(2**62)], -(2**62) + 1),  # a float64 round trip gives -2**62
])
def test_integer_avg_truncates_toward_zero(name: str, values: list[int], want: int) -> None:
    dtype = np.dtype(name)
    assert trunc_div(wrap(sum(values), dtype), len(values)) == want  # the hand value is right
    rows = [np.array([v], dtype) for v in values]
    assert ops.reduce_arrays(rows, "avg").tolist() == [want]


def test_integer_avg_with_world_larger_than_dtype_max() -> None:
    # n = 200 is not representable in int8; the division must still be exact.
    rows = [np.array([-128, 127, -1], np.int8)] + [np.zeros(3, np.int8)] * 199
    assert ops.reduce_arrays(rows, "avg").tolist() == [0, 0, 0]
    rows = [np.array([-128], np.int8)] + [np.zeros(1, np.int8)] * 127
    assert ops.reduce_arrays(rows, "avg").tolist() == [-1]  # -128 / 128
    rows = [np.array([255], np.uint8)] * 1 + [np.zeros(1, np.uint8)] * 299
    assert ops.reduce_arrays(rows, "avg").tolist() == [0]


@pytest.mark.parametrize("n", [3, 7, 10])
@pytest.mark.parametrize("name", FLOATS)
def test_float_avg_is_a_correctly_rounded_division(name: str, n: int) -> None:
    # A true division in the accumulation dtype (multiplying by 1/n would be off by an
    # ulp for some inputs), then one rounding into the user's dtype.
    acc_t = np.float64 if name == "float64" else np.float32
    acc = np.random.default_rng(n).standard_normal(4096).astype(acc_t) * 100
    out = np.empty(acc.shape, dt(name))
    ops.finalize(acc, "avg", n, out)
    want = (acc.astype(np.float64) / n).astype(acc_t) if acc_t == np.float32 else acc / n
    np.testing.assert_array_equal(out.astype(np.float64), want.astype(dt(name)).astype(np.float64))


def test_float_avg_divides_in_float32_and_rounds_once() -> None:
    # 3 * 1.0009765625 = 3.0029296875 (exact in float32) / 3 -> 1.0009765625 exactly;
    # rounding the sum to float16 first would lose the last bit (3.0029296875 needs 12 bits).
    x = np.array([1.0009765625], np.float16)
    assert ops.reduce_arrays([x, x, x], "avg").tolist() == [1.0009765625]


# ---------------------------------------------------------------- 16-bit: fp32 accumulation

@pytest.mark.parametrize("name,ulp_at_one", [("bfloat16", 2.0**-7), ("float16", 2.0**-10)])
def test_16bit_accumulates_in_float32_and_rounds_once(name: str, ulp_at_one: float) -> None:
    dtype = dt(name)
    tiny = ulp_at_one / 4  # below half an ulp of 1: each 16-bit step alone would drop it
    rows = [np.array([1.0], dtype)] + [np.array([tiny], dtype)] * 4
    got = ops.reduce_arrays(rows, "sum")
    assert got.astype(np.float64).tolist() == [1.0 + ulp_at_one]
    # The same contributions combined into a 16-bit accumulator round at every step.
    acc = rows[0].copy()
    for r in rows[1:]:
        ops.combine(acc, r, "sum")
    assert acc.astype(np.float64).tolist() == [1.0]


def test_16bit_overflow_rounds_to_inf_only_at_the_end() -> None:
    big = np.array([60000.0], np.float16)
    assert np.isinf(ops.reduce_arrays([big, big], "sum")).all()
    # The float32 accumulator keeps 120000, so the average comes back finite.
    assert ops.reduce_arrays([big, big], "avg").tolist() == [60000.0]


# ---------------------------------------------------------------- widening fast paths

def test_float16_widening_is_exact_for_every_bit_pattern() -> None:
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16)  # incl. subnormals, inf, NaN
    want = h.astype(np.float32)
    acc = ops.init_acc(h)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(acc), nan)
    np.testing.assert_array_equal(acc.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    # combine: 0 + x is exact too, and a block without inf/NaN takes the bit-trick path.
    finite = h[:0x7C00]
    zero = np.zeros(finite.size, np.float32)
    ops.combine(zero, finite, "sum")
    np.testing.assert_array_equal(zero.view(np.uint32), finite.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_blocked_widening_matches_plain_ufunc(monkeypatch: pytest.MonkeyPatch, name: str, op: ReduceOp) -> None:
    dtype = dt(name)
    rng = np.random.default_rng(1)
    size = 2 * 1000 + 7  # an odd remainder block
    rows = [(rng.standard_normal(size) * 10).astype(dtype) for _ in range(3)]
    rows[1][5] = np.inf  # one block goes through the inf/NaN fallback
    rows[2][1500] = np.nan
    plain = ops.reduce_arrays(rows, op)
    monkeypatch.setattr(ops, "_BLOCK", 1000)
    monkeypatch.setattr(ops, "_BLOCKED_MIN", {k: 0 for k in ops._BLOCKED_MIN})
    blocked = ops.reduce_arrays(rows, op)
    np.testing.assert_array_equal(plain.view(np.uint16), blocked.view(np.uint16))


def test_float16_without_working_denormals_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "_denormals_work", lambda: False)
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16)[:0x7C00]
    np.testing.assert_array_equal(ops.init_acc(h), h.astype(np.float32))


def test_denormal_probe_is_true_by_default() -> None:
    assert ops._denormals_work()


# ---------------------------------------------------------------- shapes and layouts

@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 5), (0, 4)])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", ALL)
def test_shapes_including_empty(name: str, op: ReduceOp, shape: tuple[int, ...]) -> None:
    dtype = dt(name)
    rows = [np.full(shape, r + 1, dtype=dtype) for r in range(3)]
    got = ops.reduce_arrays(rows, op)
    assert got.shape == shape and got.dtype == dtype
    want = {ReduceOp.SUM: 6, ReduceOp.AVG: 2, ReduceOp.MIN: 1, ReduceOp.MAX: 3, ReduceOp.PROD: 6}[op]
    assert np.all(got.astype(np.float64) == want)


def test_non_contiguous_inputs() -> None:
    rng = np.random.default_rng(3)
    for dtype in (np.float16, BF16, np.float32):
        big = [(rng.standard_normal(40000)).astype(dtype) for _ in range(2)]
        strided = [b[::2] for b in big]
        assert not strided[0].flags.c_contiguous
        got = ops.reduce_arrays(strided, "sum")
        want = ops.reduce_arrays([np.ascontiguousarray(s) for s in strided], "sum")
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_combine_into_a_strided_accumulator_writes_through() -> None:
    backing = np.zeros((100, 2), np.float32)
    acc = backing[:, 0]
    x = np.arange(100, dtype=np.float16)
    ops.combine(acc, x, "sum")
    np.testing.assert_array_equal(backing[:, 0], np.arange(100, dtype=np.float32))
    np.testing.assert_array_equal(backing[:, 1], 0)


# ---------------------------------------------------------------- API contracts

def test_float32_sum_is_in_place_without_copies() -> None:
    acc = np.ones(10, np.float32)
    before = acc.__array_interface__["data"][0]
    ops.combine(acc, np.ones(10, np.float32), ReduceOp.SUM)
    assert acc.__array_interface__["data"][0] == before and acc.tolist() == [2.0] * 10
    out = ops.finalize(acc, "sum", 2, acc)
    assert out is acc


def test_finalize_leaves_the_accumulator_alone() -> None:
    acc = np.array([3.0, -3.0], np.float32)
    out = np.empty(2, np.float16)
    assert ops.finalize(acc, "avg", 2, out).tolist() == [1.5, -1.5]
    assert acc.tolist() == [3.0, -3.0]
    iacc = np.array([-7, 7], np.int64)
    iout = np.empty(2, np.int64)
    assert ops.finalize(iacc, "avg", 2, iout).tolist() == [-3, 3]
    assert iacc.tolist() == [-7, 7]


def test_init_acc_reuses_out() -> None:
    x = np.arange(5, dtype=BF16)
    buf = np.empty(5, np.float32)
    assert ops.init_acc(x, out=buf) is buf
    assert buf.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ConfigError, match="init_acc"):
        ops.init_acc(x, out=np.empty(5, np.float64))
    with pytest.raises(ConfigError, match="init_acc"):
        ops.init_acc(x, out=np.empty(4, np.float32))


@pytest.mark.parametrize("acc,x", [
    (np.zeros(3, np.float64), np.zeros(3, np.float32)),
    (np.zeros(3, np.int32), np.zeros(3, np.int8)),
    (np.zeros(3, np.float16), np.zeros(3, np.float32)),
    (np.zeros(3, np.float32), np.zeros(4, np.float32)),
    (np.zeros(3, np.float32), np.zeros((3, 1), np.float32)),
    (np.zeros(3, np.complex64), np.zeros(3, np.complex64)),
])
def test_combine_rejects_mismatches(acc: np.ndarray, x: np.ndarray) -> None:
    with pytest.raises(ConfigError):
        ops.combine(acc, x, "sum")


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2"])
def test_finalize_rejects_bad_n(n: object) -> None:
    with pytest.raises(ConfigError, match="positive integer"):
        ops.finalize(np.zeros(2, np.float32), "avg", n, np.zeros(2, np.float32))  # type: ignore[arg-type]


def test_finalize_rejects_mismatched_out() -> None:
    with pytest.raises(ConfigError):
        ops.finalize(np.zeros(2, np.float32), "sum", 2, np.zeros(2, np.float64))
    with pytest.raises(ConfigError):
        ops.finalize(np.zeros(2, np.float32), "sum", 2, np.zeros(3, np.float16))


def test_reduce_arrays_argument_errors_and_inputs_untouched() -> None:
    with pytest.raises(ConfigError, match="at least one"):
        ops.reduce_arrays([], "sum")
    with pytest.raises(ConfigError, match="mixed dtypes"):
        ops.reduce_arrays([np.zeros(2, np.float32), np.zeros(2, np.float16)], "sum")
    with pytest.raises(ConfigError, match="shape"):
        ops.reduce_arrays([np.zeros(2, np.float32), np.zeros(3, np.float32)], "sum")
    rows = [np.array([1.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32)]
    out = ops.reduce_arrays(rows, "avg")
    assert out.tolist() == [2.0, 3.0]
    assert rows[0].tolist() == [1.0, 2.0] and rows[1].tolist() == [3.0, 4.0]
    assert not np.shares_memory(out, rows[0])


def test_min_max_propagate_nan() -> None:
    rows = [np.array([1.0, np.nan], np.float32), np.array([np.nan, 2.0], np.float32)]
    assert np.isnan(ops.reduce_arrays(rows, "min")).all()
    assert np.isnan(ops.reduce_arrays(rows, "max")).all()


def test_order_of_calls_fixes_the_bits() -> None:
    rng = np.random.default_rng(5)
    rows = [(rng.standard_normal(4096) * 10.0**rng.integers(-8, 8, 4096)).astype(np.float32) for _ in range(6)]
    first = ops.reduce_arrays(rows, "sum")
    for _ in range(3):
        np.testing.assert_array_equal(ops.reduce_arrays(rows, "sum").view(np.uint32), first.view(np.uint32))


# ---------------------------------------------------------------- property test

def rows_strategy() -> st.SearchStrategy:
    @st.composite
    def build(draw: st.DrawFn) -> tuple[np.dtype, list[np.ndarray]]:
        dtype = dt(draw(st.sampled_from(ALL)))
        n = draw(st.integers(1, 5))
        size = draw(st.integers(0, 40))
        # Draw raw bit patterns: every value of the dtype, incl. NaN, inf, subnormals, -0.
        bits = f"u{dtype.itemsize}"
        limit = (1 << (8 * dtype.itemsize)) - 1
        rows = [
            np.array(draw(st.lists(st.integers(0, limit), min_size=size, max_size=size)), dtype=bits).view(dtype)
            for _ in range(n)
        ]
        return dtype, rows
    return build()


@settings(max_examples=300, deadline=None)
@given(case=rows_strategy(), op=st.sampled_from(OPS))
def test_property_matches_sequential_reference(case: tuple[np.dtype, list[np.ndarray]], op: ReduceOp) -> None:
    dtype, rows = case
    with np.errstate(all="ignore"):  # random bit patterns overflow; that is data here
        got = ops.reduce_arrays(rows, op)
    assert got.dtype == dtype and got.shape == rows[0].shape
    if dtype.kind in "iu":
        assert got.tolist() == int_reference([r.tolist() for r in rows], op, dtype)
        return
    # Floats: widen with numpy's own cast, combine in list order in the accumulation dtype,
    # divide there, round once.
    acc_t = np.float64 if dtype == np.float64 else np.float32
    fn = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MIN: np.minimum,
          ReduceOp.MAX: np.maximum, ReduceOp.PROD: np.multiply}[op]
    with np.errstate(all="ignore"):
        ref = rows[0].astype(acc_t)
        for r in rows[1:]:
            ref = fn(ref, r.astype(acc_t))
        if op is ReduceOp.AVG:
            ref = ref / acc_t(len(rows))
        want = ref.astype(dtype)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    w = f"u{dtype.itemsize}"
    np.testing.assert_array_equal(got.view(w)[~nan], want.view(w)[~nan])


def test_finalize_into_a_view_of_the_same_memory_skips_the_copy_but_not_a_shifted_one():
    from redsock.ops import _same_memory

    buf = np.arange(10, dtype=np.float32)
    a, b = buf[2:8], buf[2:8]
    assert a is not b and _same_memory(a, b)
    assert np.array_equal(ops.finalize(a, "sum", 4, b), np.arange(2, 8, dtype=np.float32))
    shifted = buf[3:9]  # overlapping, not the same elements: must still copy
    assert not _same_memory(a, shifted) and not _same_memory(a, buf[2:8].view(np.int32))
    ops.finalize(a, "sum", 4, shifted)
    assert np.array_equal(buf, np.array([0, 1, 2, 2, 3, 4, 5, 6, 7, 9], np.float32))


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("skew", [0, 8, 16, 48, 2048, 4080])
def test_copy_is_bitwise_at_every_page_offset(name: str, skew: int) -> None:
    """ops.copy takes another loop when the destination is a few bytes past the source modulo a
    page (memcpy's slow case on AMD): every bit pattern (NaN payloads, -0.0) arrives unchanged,
    whichever loop ran, and the bytes around the destination are untouched."""
    d = dt(name)
    count = (256 * 1024) // d.itemsize
    src_mem = np.zeros(count * d.itemsize + 2 * 4096, np.uint8)
    dst_mem = np.full(count * d.itemsize + 3 * 4096, 0xA5, np.uint8)
    s0 = (-src_mem.ctypes.data) % 4096  # a page boundary inside each buffer
    d0 = (-dst_mem.ctypes.data) % 4096 + skew
    src = src_mem[s0:s0 + count * d.itemsize].view(d)
    src.view(np.uint8)[:] = np.random.default_rng(skew).integers(0, 256, src.nbytes, dtype=np.uint8)
    dst = dst_mem[d0:d0 + count * d.itemsize].view(d)
    ops.copy(dst, src)
    assert dst.tobytes() == src.tobytes()
    assert (dst_mem[:d0] == 0xA5).all() and (dst_mem[d0 + dst.nbytes:] == 0xA5).all()


def test_copy_of_strided_or_converting_arrays_is_an_assignment() -> None:
    x = np.arange(2 * 65536, dtype=np.float32)
    out = np.empty(65536, np.float32)
    ops.copy(out, x[::2])
    np.testing.assert_array_equal(out, x[::2])
    wide = np.empty(65536, np.float64)
    ops.copy(wide, x[1::2])
    np.testing.assert_array_equal(wide, x[1::2])


@pytest.mark.parametrize("count", [5, 1 << 14])  # (16-bit rows of 16 Ki elements are widened in blocks)
@pytest.mark.parametrize("nrows", [1, 2, 4])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", ALL)
def test_reduce_rows_has_the_bits_of_reduce_arrays(name: str, op: ReduceOp, nrows: int, count: int) -> None:
    """A 2-D array of rows, a list of rows, a list with a scratch accumulator, and a
    prepared row_reducer all give reduce_arrays' bits (the collectives use whichever fits
    their buffers)."""
    d = dt(name)
    rng = np.random.default_rng(nrows * 31 + count)
    if name in FLOATS:
        rows = (rng.standard_normal((nrows, count)) * 100).astype(d)
    else:
        info = np.iinfo(d)
        rows = rng.integers(info.min, info.max, (nrows, count), dtype=d, endpoint=True)
    want = ops.reduce_arrays(list(rows), op).tobytes()
    scratched: list[int] = []

    def scratch(n: int, dtype: np.dtype) -> np.ndarray:
        scratched.append(n)
        return np.full(n, 7, dtype)  # (stale contents must not leak into the result)

    for given_rows, kwargs in ((rows, {}), (list(rows), {}), (list(rows), {"scratch": scratch})):
        out = np.full(count, 3, d)
        assert ops.reduce_rows(given_rows, op, nrows, out, **kwargs) is out
        assert out.tobytes() == want, (type(given_rows), kwargs)
    needs_acc = ops.accum_dtype(d) != d or op is ReduceOp.AVG
    assert scratched == ([count] if needs_acc else [])
    out = np.full(count, 3, d)
    assert ops.row_reducer(d, op, nrows)(tuple(rows), out) is out
    assert out.tobytes() == want
    for own in range(nrows):  # the result over row own: the same bits, and no other row touched
        given = [r.copy() for r in rows]
        assert ops.row_reducer(d, op, nrows, own=own)(given, np.full(count, 7, d)) is given[own]
        assert given[own].tobytes() == want, own
        assert all(given[i].tobytes() == rows[i].tobytes() for i in range(nrows) if i != own), own


def test_row_reducer_refuses_what_reduce_rows_refuses() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        ops.row_reducer(np.dtype(np.int16), "sum", 2)
    with pytest.raises(ConfigError, match="op"):
        ops.row_reducer(np.dtype(np.float32), "xor", 2)
    with pytest.raises(ConfigError, match="positive"):
        ops.row_reducer(np.dtype(np.float32), "sum", 0)
    for own in (-1, 2, True, 1.0):
        with pytest.raises(ConfigError, match="own"):
            ops.row_reducer(np.dtype(np.float32), "sum", 2, own=own)
