"""``redsock bench allreduce`` on this machine: the check's references and the local launcher."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from redsock import ops
from redsock.bench import allreduce
from redsock.bench.allreduce import local
from redsock.bench.allreduce import rank as rank_mod
from redsock.bench.procs import BoxCpu, box_cpu, cpu_shares
from redsock.config import parse_size


@pytest.mark.parametrize("dtype, op", [(np.float32, "sum"), (ops.bfloat16, "avg"), (np.int8, "prod"),
                                       (np.uint8, "max"), (np.int64, "min")])
def test_references_in_blocks_equal_the_whole(dtype, op):
    """The check builds float64 references a block at a time (a whole 256 MiB one is GBs)."""
    dtype, op = np.dtype(dtype), ops.ReduceOp.parse(op)
    whole_in = allreduce.make_input(1000, dtype, op, 2, 1)
    whole_ref = allreduce.reference(1000, dtype, op, 3, 1)
    for lo in range(0, 1000, 333):
        n = min(333, 1000 - lo)
        assert np.array_equal(allreduce.make_input(n, dtype, op, 2, 1, lo), whole_in[lo:lo + n])
        assert np.array_equal(allreduce.reference(n, dtype, op, 3, 1, lo), whole_ref[lo:lo + n])


@pytest.mark.parametrize("dtype", [np.float16, ops.bfloat16, np.float32, np.int8, np.uint8, np.int64])
@pytest.mark.parametrize("op", ["sum", "avg", "prod", "min", "max"])
def test_timing_inputs_stay_put_under_repeated_reductions(dtype, op):
    """The timed calls reduce one buffer in place hundreds of times: its values must not grow."""
    dtype, op, world = np.dtype(dtype), ops.ReduceOp.parse(op), 4
    xs = [allreduce.timing_input(1000, dtype, op, r) for r in range(world)]
    for _ in range(3):
        ref = allreduce.reference_of([x.astype(np.float64) for x in xs], op, dtype)
        xs = [ref.astype(dtype) for _ in range(world)]
    assert np.all(np.isfinite(ref)) and np.array_equal(ref, xs[0].astype(np.float64))


def test_exit_reasons_name_the_signal():
    assert local._exit_reason(3) == "exited with status 3"
    assert "SIGKILL" in local._exit_reason(-signal.SIGKILL) and "out of memory" in local._exit_reason(-9)
    assert local._exit_reason(-signal.SIGTERM) == "was killed by SIGTERM"


def test_launcher_says_which_rank_failed():
    # The ranks fail, not the launcher: the reducers' algorithm with no reducers configured.
    env = {k: v for k, v in os.environ.items() if k != "REDSOCK_SERVERS"}
    r = subprocess.run([sys.executable, "-m", "redsock", "bench", "allreduce", "--nprocs", "2", "--algo", "server",
                        "-b", "8", "-e", "8", "--no-progress"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0
    assert "redsock: rank 0 exited with status" in r.stderr or "redsock: rank 1 exited with status" in r.stderr
    assert "needs reduction servers" in r.stderr and "rank 0: rank 0" not in r.stderr  # named once


def test_checked_sweep_over_blocks_reports_zero_wrong(monkeypatch, tmp_path):
    """A sweep whose sizes span several check blocks, end to end on 3 local ranks; each row
    records the share of the cores its ranks used while it was timed."""
    monkeypatch.setenv("REDSOCK_TIMEOUT_S", "60")
    out = tmp_path / "rows.jsonl"
    r = subprocess.run([sys.executable, "-m", "redsock", "bench", "allreduce", "--nprocs", "3", "-b", "4M", "-e", "32M",
                        "-f", "8", "-d", "float16", "-o", "sum", "--algo", "auto", "--check", "-n", "1", "-w", "0",
                        "--no-progress", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "# check: 0 wrong elements over 2 rows" in r.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # 3 ranks busy reducing, each with at most every core: above nothing, below 3 machines' worth
    assert len(rows) == 2 and all(0 < row["extra"]["ranks_busy"] <= 3 for row in rows)
    # ... and the share of the whole machine busy meanwhile (the same on every rank: rank 0's reading)
    # (and of that, the share the hypervisor gave other guests)
    assert all(0 <= row["extra"]["machine_steal"] <= row["extra"]["machine_busy"] <= 1 for row in rows)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8", "int64"])
@pytest.mark.parametrize("op", ["sum", "prod"])
def test_tiled_inputs_and_references_follow_their_closed_form(dtype, op):
    """Inputs are built by tiling one period: element i of rank r must still be
    (7i + 3r + seed) mod 11 - 5 (|.| for uint8), or 1 + (i + r + seed) mod 2 for prod."""
    dt, rop = ops.dtype_from_name(dtype), ops.ReduceOp.parse(op)
    start, count, world, seed = 1_000_003, 5_000, 3, 9
    i = np.arange(start, start + count, dtype=np.int64)

    def closed_form(r: int) -> np.ndarray:
        if rop is ops.ReduceOp.PROD:
            return 1 + (i + r + seed) % 2
        v = (7 * i + 3 * r + seed) % 11 - 5
        return np.abs(v) if dt == np.uint8 else v

    for r in range(world):
        assert np.array_equal(allreduce.make_input(count, dt, rop, r, seed, start).astype(np.float64), closed_form(r))
    want = (np.prod if rop is ops.ReduceOp.PROD else np.sum)([closed_form(r) for r in range(world)], axis=0)
    assert np.array_equal(allreduce.reference(count, dt, rop, world, seed, start), want)


@pytest.mark.parametrize("argv, says", [
    (["--nprocs", "0"], "--nprocs must be >= 1"),
    (["--nprocs", "2", "-b", "8", "-e", "4"], "need -b <= -e"),
    (["--nprocs", "2", "-d", "complex64"], "unsupported dtype 'complex64'"),
    (["--nprocs", "2", "--algo", "auto,warp"], "unknown --algo 'warp'"),
    (["--nprocs", "2", "-n", "0"], "need -n >= 1"),
    (["--nprocs", "2", "--back-to-back", "--rounds", "0"], "need --rounds >= 1"),
    (["--nprocs", "2", "--peer", "mpi"], "--peer mpi times float32 sum with --back-to-back against one"),
    (["--nprocs", "2", "--back-to-back", "--algo", "auto,mpi"], "--algo mpi needs processes that mpirun starts"),
    (["--nprocs", "2", "--algo", "auto,gloo,auto"], "--algo names 'auto' twice"),
    (["--nprocs", "2", "--sizes-in-turn"], "--sizes-in-turn takes turns between --back-to-back rounds"),
])
def test_launcher_refuses_bad_options_once_before_starting_ranks(argv, says):
    """One clear line from the launcher (exit 2), not one per rank after N interpreters started."""
    p = subprocess.run([sys.executable, "-m", "redsock", "bench", "allreduce", *argv], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [f"redsock: error: {p.stderr.split('error: ', 1)[1].strip()}"]
    assert says in p.stderr and "rank" not in p.stderr.replace("--nprocs", "")


class _OneRank:
    """The communicator calls the sweep's timing makes, for a world of one rank (its own
    maximum is itself)."""

    def barrier(self) -> None:
        pass

    def all_reduce(self, x, op, algorithm=None) -> None:
        assert op == "max"


def _recording_run(calls: list[str], name: str, cost_s: float):
    def fn(x):
        calls.append(name)
        time.sleep(cost_s)
    return rank_mod._Run(name, fn, fn, np.zeros(1, np.float32))


def test_back_to_back_rounds_take_turns_so_every_implementation_meets_the_same_minutes():
    """Each implementation's warm-up, then the rounds in turn, the order reversed every other
    round (A B, B A, A B): a peer timed a whole sweep later meets another machine (its speed
    changes up to 3x from one minute to the next here).  Each round's time is its calls'
    total / calls, and only the timed calls count as the run's CPU time."""
    calls: list[str] = []
    size = rank_mod._Sized(8, [_recording_run(calls, "a", 0.002), _recording_run(calls, "b", 0.001)], 2, 3)
    ((timed, ticks),) = rank_mod.time_in_turn([size], comm=_OneRank())
    rounds = [calls[i] for i in range(4, len(calls), 3)]  # (after 2 + 2 warm-up calls, blocks of 3)
    assert calls[:4] == ["a", "a", "b", "b"] and len(calls) == 4 + 3 * 2 * rank_mod.B2B_ROUNDS
    assert rounds == ["a", "b", "b", "a", "a", "b"] and all(calls[i:i + 3] == [calls[i]] * 3 for i in range(4, 22, 3))
    (a_times, a_spent), (b_times, b_spent) = timed
    assert len(a_times) == len(b_times) == rank_mod.B2B_ROUNDS
    assert all(0.002 <= t < 0.02 for t in a_times) and all(0.001 <= t < 0.02 for t in b_times)
    assert a_spent.wall_s >= 3 * 3 * 0.002 and b_spent.wall_s >= 3 * 3 * 0.001
    assert a_spent.cpu_s < a_spent.wall_s  # (asleep, not computing)
    assert ticks.total >= ticks.busy >= ticks.steal >= 0


def test_sizes_in_turn_time_every_size_in_each_round():
    """--sizes-in-turn: every size's warm-up, then each round visits every size (and at each
    size every implementation, in the order of that round): a slow minute falls on every size
    alike, so half a size's time against the next is measured over the same minutes."""
    calls: list[str] = []
    small = rank_mod._Sized(8, [_recording_run(calls, "a8", 0.001), _recording_run(calls, "b8", 0.001)], 1, 2)
    large = rank_mod._Sized(16, [_recording_run(calls, "a16", 0.002), _recording_run(calls, "b16", 0.002)], 1, 2)
    timed = rank_mod.time_in_turn([small, large], comm=_OneRank(), rounds=3)
    assert calls[:4] == ["a8", "b8", "a16", "b16"]  # (the warm-ups)
    blocks = [calls[i] for i in range(4, len(calls), 2)]
    assert blocks == ["a8", "b8", "a16", "b16", "b8", "a8", "b16", "a16", "a8", "b8", "a16", "b16"]
    assert all(calls[i] == calls[i + 1] for i in range(4, len(calls), 2))
    (small_runs, _), (large_runs, _) = timed
    assert all(len(t) == 3 for t, _ in small_runs + large_runs)
    assert all(0.001 <= t < 0.02 for t in small_runs[0][0]) and all(0.002 <= t < 0.02 for t in large_runs[1][0])


def test_ranks_that_mpirun_started_take_their_rank_from_open_mpi(monkeypatch):
    """Under mpirun (--peer mpi) a rank has Open MPI's variables, not torchrun's: it takes
    RANK, WORLD_SIZE and LOCAL_RANK from them; torchrun's, where set, win."""
    from redsock.bench.allreduce.mpi_peer import adopt_mpi_ranks

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK"):
        # (set first, so that monkeypatch puts back what was there: adopt_mpi_ranks writes
        # os.environ itself, and a RANK left behind would make later tests' ranks join a world of 4)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert not adopt_mpi_ranks() and "RANK" not in os.environ  # (neither launcher)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    assert adopt_mpi_ranks()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("2", "4", "0")
    monkeypatch.setenv("RANK", "1")
    assert not adopt_mpi_ranks() and os.environ["RANK"] == "1"


def test_cpu_shares_count_steal_as_busy_and_show_it_apart():
    """Steal (cycles the hypervisor gave other guests) is busy time (not ours to use: a run can
    be CPU-bound through it), and its share is reported apart; readings come from /proc/stat."""
    before, after = BoxCpu(busy=100, total=1000, steal=10), BoxCpu(busy=700, total=2000, steal=210)
    assert cpu_shares(before, after) == (0.6, 0.2)
    fields = [int(v) for v in open("/proc/stat").readline().split()[1:9]]
    now = box_cpu()
    assert now.total >= sum(fields) and now.steal >= fields[7] and 0 <= now.steal <= now.busy <= now.total


# ---------------------------------------------------------------- the 16-bit wire (--wire-dtype)

def test_wire_check_inputs_need_rounding_and_their_reference_is_closed_form():
    from redsock.bench.allreduce.inputs import INPUT_PERIOD, wire_errors, wire_input, wire_reference

    world, seed, start, count = 4, 1, 5, 3 * INPUT_PERIOD + 7
    rows = [wire_input(count, r, seed, start) for r in range(world)]
    bf16 = ops.wire_dtype("bf16")
    assert all((rows[r].astype(bf16).astype(np.float32) != rows[r]).mean() > 0.5 for r in range(world))
    i = np.arange(start, start + count)  # the closed form, element by element
    want = [np.where((i + r + seed) % 2 == 0, -1.0, 1.0) * (1 + ((i * 7 + r * 3 + seed) % 11) / 3)
            * 2.0 ** ((i * 3 + r * 5) % 11 - 5) for r in range(world)]
    assert all(np.array_equal(rows[r], want[r].astype(np.float32)) for r in range(world))
    exact, abs_sum = wire_reference(count, world, seed, start)
    wide = np.stack(rows).astype(np.float64)
    assert np.array_equal(exact, wide.sum(axis=0)) and np.array_equal(abs_sum, np.abs(wide).sum(axis=0))
    # The reducers' arithmetic (round each, sum in float32, round once) is within the bound ...
    acc = sum(r.astype(bf16).astype(np.float32) for r in rows).astype(bf16).astype(np.float32)
    wrong, worst = wire_errors(acc, exact, abs_sum, world, bf16, ops.ReduceOp.SUM)
    assert wrong == 0 and 0 < worst < 2.0**-6
    # ... a result off by 1% is not.
    assert wire_errors(acc * np.float32(1.01), exact, abs_sum, world, bf16, ops.ReduceOp.SUM)[0] > 0


def test_checked_sweep_on_the_bf16_wire_reports_the_largest_error(monkeypatch, tmp_path):
    monkeypatch.setenv("REDSOCK_TIMEOUT_S", "60")
    out = tmp_path / "rows.jsonl"
    r = subprocess.run([sys.executable, "-m", "redsock", "bench", "allreduce", "--nprocs", "2", "-b", "1M", "-e", "1M",
                        "--algo", "ring,gloo", "--check", "--wire-dtype", "bf16", "-n", "1", "-w", "0",
                        "--no-progress", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "# check: 0 wrong elements over 2 rows" in r.stdout
    assert "redsock/ring on the bf16 wire" in r.stdout and "maxerr" in r.stdout
    rows = {row["algo"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert rows["ring"]["extra"]["wire_dtype"] == "bf16" and 0 < rows["ring"]["extra"]["max_rel_err"] < 2.0**-6
    assert "wire_dtype" not in rows["gloo"]["extra"] and "max_rel_err" not in rows["gloo"]["extra"]


@pytest.mark.parametrize("argv", [["-d", "int32"], ["-d", "float64"], ["-o", "max"]])
def test_a_wire_asked_for_where_it_cannot_apply_is_refused_before_ranks_start(argv):
    p = subprocess.run([sys.executable, "-m", "redsock", "bench", "allreduce", "--nprocs", "2", "--wire-dtype", "bf16",
                        *argv], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "float32 sum/avg" in p.stderr and "rank" not in p.stderr.replace("--nprocs", "")


def test_wire_halves_the_bounds_bytes():
    from redsock.bench.bounds import host_nic_factor, ideal_over_gloo

    assert host_nic_factor("server", 8, 4, "hierarchical", wire=True) == pytest.approx(0.5)
    assert host_nic_factor("server", 4, 4, wire=True) == pytest.approx(0.5)
    assert host_nic_factor("ring", 8, 8, wire=True) == pytest.approx(2 * 7 / 8 * 0.75)  # all-gather only
    assert host_nic_factor("gloo", 8, 8, wire=True) == host_nic_factor("gloo", 8, 8)  # gloo has no wire
    assert ideal_over_gloo("server", 8, 4, "hierarchical", wire=True) == pytest.approx(3.5)  # the ideal
    assert ideal_over_gloo("server", 4, 4, wire=True) == pytest.approx(3.0)


def test_ddp_runs_redsock_buckets_through_the_compress_hook_on_the_wire():
    import argparse

    from redsock.bench import ddp_testbed

    p = argparse.ArgumentParser()
    ddp_testbed.add_arguments(p)
    args = p.parse_args(["--testbed", "--wire-dtype", "fp16"])
    argv = ddp_testbed._train_argv(args, "redsock")
    assert argv[argv.index("--hook") + 1] == "compress" and argv[argv.index("--wire") + 1] == "fp16"
    assert "--hook" not in ddp_testbed._train_argv(args, "gloo")
    assert "--hook" not in ddp_testbed._train_argv(p.parse_args(["--testbed"]), "redsock")


#: How a bench row names the in-host path of sizes that go either way (Hierarchy.path_taken).
WAYS = r"(cma|arena)|(cma|arena):\d+%\+(cma|arena):\d+%"


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun: `make setup` installs Open MPI where it runs "
                    "as root with apt; elsewhere apt-get install openmpi-bin")
@pytest.mark.parametrize("algo, order, sizes", [("auto", [], ("64K", "1M", "4")),
                                                ("auto,mpi", ["--sizes-in-turn"], ("256K", "1M", "2"))],
                         ids=["size-after-size", "sizes-in-turn"])
def test_peer_mpi_puts_open_mpis_time_beside_redsocks(tmp_path, algo, order, sizes):
    """4 ranks that mpirun starts time redsock's and Open MPI's shared-memory all-reduce in
    the same processes, round by round in turn: one line per size with both times (as their
    JSON rows say), their ratio and its range over the rounds, each one's time over its time
    at half the size (where the sweep has it), the machine's busy share, and the in-host path
    (the whole buffer up to 64 KiB for 4 ranks, then sharded through the arena or one copy
    each way by cross-memory attach, whichever has been faster lately).  MPI's results are
    checked too (--check: 0 wrong).  The same with the sizes in turn, and with "mpi" in
    --algo already (timed once, not twice)."""
    out = tmp_path / "rows.jsonl"
    low, high, factor = sizes
    r = subprocess.run([sys.executable, "-m", "redsock", "bench", "allreduce", "--nprocs", "4", "-b", low, "-e", high,
                        "-f", factor, "--algo", algo, "--back-to-back", "-n", "20", "-w", "2", "--no-progress",
                        "--peer", "mpi", "--check", "--json", str(out), *order], capture_output=True, text=True,
                       timeout=300,
                       env={**os.environ, "REDSOCK_SHM_CMA": "auto"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "# check: 0 wrong elements over 6 rows" in r.stdout
    rows: dict[str, dict[int, dict]] = {}
    for row in map(json.loads, out.read_text().splitlines()):
        rows.setdefault(row["impl"], {})[row["bytes"]] = row
    assert sorted(rows) == ["mpi", "redsock"] and rows["mpi"].keys() == rows["redsock"].keys()
    assert all(row["extra"]["inter"] == "vader" and len(row["extra"]["rounds_s"]) == 3 for row in rows["mpi"].values())
    table = r.stdout.split("redsock against Open MPI shared memory")[1].split("\n", 1)[1]
    lines = [line.split() for line in table.splitlines() if line and not line.startswith("#")]
    expected = [parse_size(low) * int(factor) ** k for k in range(3)]
    assert [int(cells[0]) for cells in lines] == expected == sorted(rows["redsock"])
    for size, ours, mpi, ratio, spread, ours_half, mpi_half, busy, steal, path in lines:
        mine, theirs = rows["redsock"][int(size)], rows["mpi"][int(size)]
        assert float(ours) == pytest.approx(mine["median_s"] * 1e6, abs=0.06)
        assert float(mpi) == pytest.approx(theirs["median_s"] * 1e6, abs=0.06)
        assert float(ratio[:-1]) == pytest.approx(float(ours) / float(mpi), rel=0.01, abs=0.006)
        for impl, half in (("redsock", ours_half), ("mpi", mpi_half)):
            below = rows[impl].get(int(size) // 2)
            assert half == (f"{rows[impl][int(size)]['median_s'] / below['median_s']:.2f}x" if below else "-")
        pairs = [a / b for a, b in zip(mine["extra"]["rounds_s"], theirs["extra"]["rounds_s"])]
        assert spread == f"{min(pairs):.2f}-{max(pairs):.2f}"
        # (from 256 KiB the calls go through the arena or by cross-memory attach, whichever has
        # been faster lately: one name, or both with their shares)
        assert path == mine["extra"]["path"]
        assert path == "whole" if int(size) == 65536 else re.fullmatch(WAYS, path), path
        assert 0 <= float(busy[:-1]) <= 100 and 0 <= float(steal[:-1]) <= 100


def test_huge_sizes_time_fewer_calls_but_keep_every_warm_up_call():
    """From 64 MiB the sweep times at most 8 calls a round (it stays bounded), but warms up
    with all of -w: what an implementation settles in its first calls (redsock's first trial
    of its ways, at a shape's 8th call) stays out of the timed calls."""
    import argparse

    args = argparse.Namespace(warmup=30, iters=300)
    assert rank_mod.iters_for(32 << 20, args) == (30, 300)
    assert rank_mod.iters_for(64 << 20, args) == (30, 8)
    assert rank_mod.iters_for(1 << 30, argparse.Namespace(warmup=0, iters=2)) == (0, 3)
