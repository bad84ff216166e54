"""Benchmark reporting: bandwidth arithmetic (closed form), tables, JSON Lines, plot."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from redsock import results as R
from redsock.config import parse_size
from redsock.errors import ConfigError
from redsock.ops import ReduceOp
from redsock.results import Row

MiB = 1 << 20


def row(impl: str = "redsock", algo: str = "ring", world: int = 4, nbytes: int = 8 * MiB,
        t: float = 2e-3, wrong: int = 0, **kw: object) -> Row:
    return Row.from_times(impl, algo, world, nbytes, nbytes // 4, "float32", "sum", [t], wrong, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- bandwidth arithmetic

def test_from_times_statistics_and_bandwidths() -> None:
    r = Row.from_times("redsock", "ring", 4, 8 * MiB, 2 * MiB, np.float32, ReduceOp.SUM,
                       [3e-3, 1e-3, 2e-3, 5e-3, 2e-3], wrong=0)
    assert (r.median_s, r.min_s, r.max_s) == (2e-3, 1e-3, 5e-3)
    assert r.algbw_GBps == pytest.approx(8 * MiB / 1e9 / 2e-3, rel=1e-12)  # 4.194304
    assert r.algbw_GBps == pytest.approx(4.194304, rel=1e-12)
    assert r.busbw_GBps == pytest.approx(4.194304 * 2 * 3 / 4, rel=1e-12)  # 2(n-1)/n = 1.5
    assert (r.dtype, r.op, r.coll, r.wrong, r.count) == ("float32", "sum", "allreduce", 0, 2 * MiB)


def test_even_number_of_times_takes_the_middle_mean() -> None:
    r = Row.from_times("gloo", "gloo", 2, 1000, 250, "float32", "sum", [4.0, 1.0, 2.0, 3.0])
    assert r.median_s == 2.5 and r.wrong == -1
    assert r.busbw_GBps == r.algbw_GBps == pytest.approx(1000 / 1e9 / 2.5)  # factor 1 at n=2


@pytest.mark.parametrize("world,factor", [(1, 0.0), (2, 1.0), (3, 4 / 3), (4, 1.5), (8, 1.75), (16, 1.875)])
def test_allreduce_bus_factor_follows_nccl_tests(world: int, factor: float) -> None:
    r = row(world=world)
    assert r.busbw_GBps == pytest.approx(r.algbw_GBps * factor, rel=1e-12, abs=0)
    assert R.bus_factor("allreduce", world) == pytest.approx(factor)


@pytest.mark.parametrize("coll,world,factor", [
    ("reducescatter", 4, 0.75), ("allgather", 8, 0.875), ("broadcast", 4, 1.0), ("sendrecv", 2, 1.0),
])
def test_other_collectives(coll: str, world: int, factor: float) -> None:
    r = row(world=world, coll=coll)
    assert r.busbw_GBps == pytest.approx(r.algbw_GBps * factor, rel=1e-12)
    assert r.coll == coll


def test_dtype_and_op_normalised_to_names() -> None:
    r = Row.from_times("redsock", "server", 4, 16, 8, ml_dtypes.bfloat16, ReduceOp.AVG, [1e-5])
    assert (r.dtype, r.op) == ("bfloat16", "avg")
    assert r.label == "redsock/server" and row(impl="gloo", algo="gloo").label == "gloo"


@pytest.mark.parametrize("times", [[], [0.0], [-1e-3], [float("nan")], [1e-3, float("inf")]])
def test_bad_times(times: list[float]) -> None:
    with pytest.raises(ConfigError):
        Row.from_times("redsock", "ring", 4, 8, 2, "float32", "sum", times)


def test_bad_row_fields_and_collective() -> None:
    with pytest.raises(ConfigError):
        row(world=0)
    with pytest.raises(ConfigError):
        row(nbytes=-1)
    with pytest.raises(ConfigError, match="unknown collective"):
        row(coll="allreduc")


def test_rows_are_frozen_and_hashable() -> None:
    r = row(extra={"nsocks": 4})
    with pytest.raises(AttributeError):
        r.world = 8  # type: ignore[misc]
    assert len({r, row(extra={"nsocks": 4})}) == 1


# ---------------------------------------------------------------- sizes

@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (8, "8 B"), (1000, "1000 B"), (1024, "1 KiB"), (1536, "1.5 KiB"),
    (64 * MiB, "64 MiB"), (3 << 30, "3 GiB"), (5 << 40, "5 TiB"), (100000, "97.66 KiB"),
])
def test_human_size(n: int, text: str) -> None:
    assert R.human_size(n) == text
    assert R.human_size(n, sep="") == text.replace(" ", "")


@pytest.mark.parametrize("n", [1 << 10, 1 << 20, 3 << 20, 1 << 30])
def test_human_size_parses_back_with_config_parse_size(n: int) -> None:
    assert parse_size(R.human_size(n, sep="")) == n


def test_per_half_divides_each_time_by_the_time_at_half_the_size() -> None:
    """Only where half the size was timed: not for the smallest, an odd size, or a gap."""
    ratios = R.per_half({8: 1.0, 16: 2.5, 32: 4.0, 128: 9.0, 7: 1.0, 3: 5.0})
    assert ratios == {8: None, 16: 2.5, 32: 1.6, 128: None, 7: None, 3: None}
    assert [R.times_x(r) for r in (ratios[16], ratios[8])] == ["2.50x", "-"]
    assert R.per_half({}) == {}


# ---------------------------------------------------------------- nccl-tests table

def test_table_columns_and_numbers() -> None:
    rows = [row(nbytes=8, t=36.391e-6), row(nbytes=1 * MiB, t=612.34e-6, wrong=3),
            row(nbytes=64 * MiB, t=12441.4e-6)]
    text = R.format_table(rows, title="redsock bench allreduce")
    lines = text.splitlines()
    assert lines[0] == "# redsock bench allreduce"
    assert "# redsock/ring: allreduce, 4 ranks" in lines
    header = next(line for line in lines if "size" in line and "count" in line)
    names = ["size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong"]
    assert header.split()[1:] == names  # after the leading "#"
    assert [header.index(n) for n in names] == sorted(header.index(n) for n in names)
    data = [line for line in lines if not line.startswith("#")]
    assert len(data) == 3
    # algbw = bytes/1e9/t, busbw = 1.5 algbw: 8 B -> 0.00; 1 MiB/612.34us = 1.712 -> busbw 2.569;
    # 64 MiB/12441.4us = 5.394 -> 8.091.
    assert data[0].split() == ["8", "2", "float32", "sum", "36.39", "0.00", "0.00", "0"]
    assert data[1].split() == [str(MiB), str(MiB // 4), "float32", "sum", "612.3", "1.71", "2.57", "3"]
    assert data[2].split() == [str(64 * MiB), str(16 * MiB), "float32", "sum", "12441", "5.39", "8.09", "0"]
    # Right-aligned: every number ends where its header name ends.
    for name, cell in zip(names, data[1].split(), strict=True):
        end = header.index(name) + len(name)
        assert data[1][end - len(cell):end] == cell
    assert "# Out of bounds values : 3 FAILED" in lines
    avg = np.mean([r.busbw_GBps for r in rows])
    assert f"# Avg bus bandwidth    : {avg:g}" in lines


def test_one_table_per_impl_algo_and_unchecked_rows() -> None:
    rows = [row(impl="gloo", algo="gloo", wrong=-1), row(algo="ring"), row(algo="server"), row(algo="ring", nbytes=16)]
    text = R.format_table(rows)
    titles = [line for line in text.splitlines() if line.endswith("4 ranks")]
    assert titles == ["# gloo: allreduce, 4 ranks", "# redsock/ring: allreduce, 4 ranks",
                      "# redsock/server: allreduce, 4 ranks"]
    assert text.count("# Out of bounds values : N/A") == 1
    assert text.count("# Out of bounds values : 0 OK") == 2
    gloo_table = text.split("# redsock/ring")[0]
    assert gloo_table.rstrip().splitlines()[-3].split()[-1] == "N/A"


def test_empty_table() -> None:
    assert R.format_table([]) == "# no results\n"
    assert R.compare_table([]) == "# no results\n"


def test_rich_tables_render_the_same_cells() -> None:
    rich = pytest.importorskip("rich.console")
    console = rich.Console(width=140, record=True)
    console.print(*R.rich_tables([row(), row(algo="server")], title="bench"))
    out = console.export_text()
    assert "bench: redsock/ring" in out and "busbw (GB/s)" in out and "Avg bus bandwidth" in out


# ---------------------------------------------------------------- comparison against gloo

def test_compare_table_ratios_against_gloo() -> None:
    rows = [
        row(impl="gloo", algo="gloo", nbytes=1 * MiB, t=4e-3), row(impl="gloo", algo="gloo", nbytes=64 * MiB, t=100e-3),
        row(algo="ring", nbytes=1 * MiB, t=2e-3), row(algo="ring", nbytes=64 * MiB, t=80e-3),
        row(algo="server", nbytes=64 * MiB, t=50e-3), row(algo="server", nbytes=8, t=1e-4),
    ]
    text = R.compare_table(rows)
    lines = text.splitlines()
    assert lines[0].startswith("# allreduce float32 sum, 4 ranks") and "ratios against gloo" in lines[0]
    assert lines[1].split() == ["#", "size", "gloo", "redsock/ring", "redsock/server"]
    assert lines[2].split() == ["#", "busbw", "time(us)"] + ["busbw", "time(us)", "bw/gloo", "t/gloo"] * 2
    by_size = {line.split()[0] + " " + line.split()[1]: line.split()[2:] for line in lines[3:]}
    assert list(by_size) == ["8 B", "1 MiB", "64 MiB"]  # sorted by size
    # Same bytes and world: busbw ratio = gloo time / time, latency ratio = time / gloo time.
    assert by_size["1 MiB"] == [f"{1 * MiB / 1e9 / 4e-3 * 1.5:.3f}", "4000.0", f"{1 * MiB / 1e9 / 2e-3 * 1.5:.3f}",
                                "2000.0", "2.00", "0.50", "-", "-", "-", "-"]
    assert by_size["64 MiB"][4:6] == ["1.25", "0.80"]  # ring: 100/80, 80/100
    assert by_size["64 MiB"][8:10] == ["2.00", "0.50"]  # server: 100/50, 50/100
    assert by_size["8 B"][:2] == ["-", "-"] and by_size["8 B"][8:] == ["-", "-"]  # no gloo row at 8 B


def test_compare_table_without_baseline_and_with_one_rank() -> None:
    text = R.compare_table([row(algo="ring"), row(algo="server")])
    assert "no gloo baseline in this run" in text
    assert "bw/gloo" not in text
    one = R.compare_table([row(impl="gloo", algo="gloo", world=1, t=2e-3), row(world=1, t=1e-3)])
    data = [line for line in one.splitlines() if not line.startswith("#")]
    assert data[0].split()[-2:] == ["-", "0.50"]  # busbw is 0 at one rank: no busbw ratio


def test_compare_table_separates_dtypes() -> None:
    rows = [row(impl="gloo", algo="gloo"), row(),
            Row.from_times("redsock", "ring", 4, 8 * MiB, 4 * MiB, "bfloat16", "sum", [1e-3])]
    text = R.compare_table(rows)
    assert "# allreduce float32 sum" in text and "# allreduce bfloat16 sum" in text


# ---------------------------------------------------------------- JSON Lines

def test_json_lines_round_trip(tmp_path: Path) -> None:
    rows = [row(extra={"nsocks": 4, "loss": [1, 2]}), row(impl="gloo", algo="gloo", wrong=-1, nbytes=8),
            Row.from_times("redsock", "ring", 2, 8, 4, ml_dtypes.bfloat16, ReduceOp.AVG, [1e-5, 2e-5], coll="sendrecv")]
    path = R.write_json(rows, tmp_path / "sub" / "out.jsonl")
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    for line in lines:
        obj = json.loads(line)
        required = {"impl", "algo", "world", "bytes", "dtype", "median_s", "algbw_GBps", "busbw_GBps", "wrong"}
        assert required <= obj.keys()
    assert json.loads(lines[1])["wrong"] == -1
    assert R.read_json(path) == rows
    R.write_json(rows[:1], path, append=True)
    assert R.read_json(path) == rows + rows[:1]


def test_read_json_keeps_unknown_keys_and_names_bad_lines(tmp_path: Path) -> None:
    obj = {k: v for k, v in json.loads(json.dumps(row().__dict__)).items() if k != "extra"}
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({**obj, "host": "a"}) + "\n\n")
    assert R.read_json(good)[0].extra == {"host": "a"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(obj) + "\n" + "{not json\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2"):
        R.read_json(bad)
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({k: v for k, v in obj.items() if k != "busbw_GBps"}) + "\n")
    with pytest.raises(ConfigError, match=r"missing.jsonl:1"):
        R.read_json(missing)


def test_write_json_is_strict(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        R.write_json([row(extra={"x": float("nan")})], tmp_path / "x.jsonl")


# ---------------------------------------------------------------- plot

def sweep(impl: str, algo: str, speed: float, dtype: str = "float32") -> list[Row]:
    return [Row.from_times(impl, algo, 4, 1 << e, (1 << e) // 4, dtype, "sum",
                           [(50e-6 + (1 << e) / speed) * k for k in (1.0, 1.1, 1.3)])
            for e in range(3, 27)]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    rows = sweep("gloo", "gloo", 1e9) + sweep("redsock", "ring", 1.4e9) + sweep("redsock", "server", 2e9)
    path = R.plot(rows, tmp_path / "plots" / "allreduce.png", title="all-reduce, 4 ranks")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_plot_metric_and_varying_keys(tmp_path: Path) -> None:
    rows = sweep("redsock", "ring", 1e9) + sweep("redsock", "ring", 1e9, dtype="bfloat16") + [row(nbytes=0)]
    path = R.plot(rows, tmp_path / "algbw.png", metric="algbw_GBps")
    assert path.stat().st_size > 10_000
    with pytest.raises(ConfigError, match="unknown metric"):
        R.plot(rows, tmp_path / "x.png", metric="median_s")
    with pytest.raises(ConfigError, match="nothing to plot"):
        R.plot([row(nbytes=0)], tmp_path / "x.png")


def test_size_ticks_are_powers_of_two_and_few() -> None:
    ticks = R._size_ticks(8, 64 * MiB)
    assert ticks[0] == 8 and len(ticks) <= 12
    assert all(t & (t - 1) == 0 for t in ticks)
    assert R._size_ticks(1024, 1024) == [1024]
