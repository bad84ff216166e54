"""The 16-bit wire of float32 all-reduces, without sockets: rounding, widening, the bound,
the overflow error and the option's parsing.  References are computed here in float64
and with plain bit arithmetic, not with the helpers under test."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from redsock import ops
from redsock.config import Config
from redsock.errors import ConfigError, ProtocolError, WireOverflow
from redsock.ops import ReduceOp

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)


def rne_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits by round to nearest even on the integer bits (finite inputs)."""
    b = x.view(np.uint32).astype(np.uint64)
    lsb = (b >> 16) & 1
    return ((b + 0x7FFF + lsb) >> 16).astype(np.uint16)


def mixed(n: int, seed: int) -> np.ndarray:
    """Random float32 of mixed magnitude (2^-20 .. 2^12) and sign."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * 2.0 ** rng.integers(-20, 12, n)).astype(np.float32)


@pytest.mark.parametrize("name, want", [("bf16", BF16), ("fp16", F16), ("BF16", BF16), ("bfloat16", BF16),
                                        ("float16", F16), ("off", None), (None, None)])
def test_wire_dtype_names(name, want) -> None:
    assert ops.wire_dtype(name) == want


@pytest.mark.parametrize("bad", ["fp32", "float32", "int8", "e4m3", ""])
def test_wire_dtype_refuses_what_is_not_16_bit(bad) -> None:
    with pytest.raises(ConfigError, match="off, bf16 or fp16"):
        ops.wire_dtype(bad)


def test_config_field_default_off_and_checked() -> None:
    assert Config().wire_dtype == "off"
    assert Config.from_env({"REDSOCK_WIRE_DTYPE": "bf16"}).wire_dtype == "bf16"
    assert Config.from_env({}, wire_dtype="fp16").wire_dtype == "fp16"
    with pytest.raises(ConfigError, match="wire_dtype"):
        Config.from_env({"REDSOCK_WIRE_DTYPE": "int4"})


def test_to_wire_rounds_to_nearest_even_bf16() -> None:
    x = np.concatenate([mixed(1 << 16, 1),
                        # exact ties: bit 15 set, low bits clear, both parities of bit 16
                        np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x00018000], np.uint32).view(np.float32)])
    got = ops.to_wire(x, np.empty(x.size, BF16))
    assert np.array_equal(got.view(np.uint16), rne_bf16_bits(x))


def test_to_wire_rounds_to_nearest_fp16_against_float64() -> None:
    x = mixed(1 << 16, 2)
    x = x[np.abs(x) < 60000]
    got = ops.to_wire(x, np.empty(x.size, F16)).astype(np.float64)
    err = np.abs(got - x.astype(np.float64))
    spacing = np.spacing(np.abs(got).astype(F16)).astype(np.float64)  # ulp of the result
    assert (err <= spacing / 2).all()


@pytest.mark.parametrize("wire", [BF16, F16])
def test_from_wire_widens_every_bit_pattern_exactly(wire) -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    w = bits.view(wire)
    got = ops.from_wire(w, np.empty(w.size, np.float32))
    want = w.astype(np.float64)
    same = (got.astype(np.float64) == want) | (np.isnan(got) & np.isnan(want))
    assert same.all()


def test_wire_for_applies_to_float32_sum_avg_only() -> None:
    f32 = np.dtype(np.float32)
    assert ops.wire_for(f32, ReduceOp.SUM, BF16, explicit=True) == BF16
    assert ops.wire_for(f32, ReduceOp.AVG, F16, explicit=False) == F16
    assert ops.wire_for(f32, ReduceOp.SUM, None, explicit=True) is None
    for dtype, op in [(np.dtype(np.int32), ReduceOp.SUM), (np.dtype(np.float64), ReduceOp.SUM),
                      (np.dtype(np.int64), ReduceOp.AVG), (BF16, ReduceOp.SUM), (f32, ReduceOp.MAX)]:
        assert ops.wire_for(dtype, op, BF16, explicit=False) is None  # the environment's: silently off
        with pytest.raises(ConfigError, match="float32 sum/avg"):
            ops.wire_for(dtype, op, BF16, explicit=True)


def test_check_wire_code() -> None:
    f32, f64 = ops.dtype_code(np.float32), ops.dtype_code(np.float64)
    assert ops.check_wire_code(f32, 0) == np.float32
    assert ops.check_wire_code(f64, 0) == np.float64
    assert ops.check_wire_code(f32, ops.dtype_code(BF16)) == BF16
    assert ops.check_wire_code(f32, ops.dtype_code(F16)) == F16
    for d, w in [(f64, ops.dtype_code(BF16)), (f32, ops.dtype_code(np.int8)), (f32, f32), (f32, 99)]:
        with pytest.raises(ProtocolError):
            ops.check_wire_code(d, w)


def test_check_wire_result_raises_on_fp16_only() -> None:
    x = np.ones(10, np.float32)
    ops.check_wire_result(x, F16)
    x[3] = np.inf
    x[7] = np.nan
    ops.check_wire_result(x, BF16)  # bf16 has float32's range: inf is data there, as in float32
    ops.check_wire_result(x, None)
    with pytest.raises(WireOverflow, match="2 of 10 elements.*index 3") as e:
        ops.check_wire_result(x, F16)
    assert e.value.count == 2


def emulate(rows: list[np.ndarray], wire: np.dtype, op: ReduceOp = ReduceOp.SUM) -> np.ndarray:
    """What the reducers compute: each row rounded, summed in float32 in order, rounded once."""
    acc = rows[0].astype(wire).astype(np.float32)
    for r in rows[1:]:
        acc += r.astype(wire).astype(np.float32)
    if op is ReduceOp.AVG:
        acc /= np.float32(len(rows))
    with np.errstate(over="ignore"):
        return acc.astype(wire).astype(np.float32)


@pytest.mark.parametrize("wire", [BF16, F16])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG])
@pytest.mark.parametrize("world", [2, 8, 64])
def test_bound_holds_for_the_reducers_arithmetic(wire, op, world) -> None:
    rows = [mixed(1 << 15, 10 + r) for r in range(world)]
    if wire == F16:
        rows = [r / np.float32(4 * world) for r in rows]  # stay under 65504
    wide = np.stack(rows).astype(np.float64)
    exact = wide.sum(axis=0)
    got = emulate(rows, wire, op).astype(np.float64)
    ref = exact / world if op is ReduceOp.AVG else exact
    bound = ops.wire_error_bound(np.abs(wide).sum(axis=0), exact, world, wire, op)
    err = np.abs(got - ref)
    assert (err <= bound).all(), float((err / bound).max())
    assert (err > bound / 64).any()  # and not vacuous: some elements come near it


def test_bound_is_tight_enough_to_catch_a_16_bit_sum() -> None:
    """Summing in bf16 (N-1 roundings, as a cast-before-all-reduce does) breaks the bound
    where partial sums cancel; the float32 accumulation stays inside it."""
    world = 8
    rows = [mixed(1 << 15, 40 + r) for r in range(world)]
    wide = np.stack(rows).astype(np.float64)
    exact = wide.sum(axis=0)
    acc = rows[0].astype(BF16)
    for r in rows[1:]:
        acc = (acc.astype(np.float32) + r.astype(BF16).astype(np.float32)).astype(BF16)
    bound = ops.wire_error_bound(np.abs(wide).sum(axis=0), exact, world, "bf16")
    assert (np.abs(acc.astype(np.float64) - exact) > bound).any()
