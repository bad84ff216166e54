"""``redsock bench floor``: plain-socket lower bounds, measured in the same processes as gloo."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


def floor(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "redsock", "bench", "floor", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_ring_and_fanin_report_checked_measurements(tmp_path):
    out = tmp_path / "floor.json"
    r = floor("--nprocs", "3", "--sizes", "64K,100000", "--workers", "2,3", "--iters", "2", "--warmup", "1",
              "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())
    ring = [row for row in rows if row["mode"] == "ring"]
    fanin = [row for row in rows if row["mode"] == "fanin"]
    assert [row["size"] for row in ring] == [65536, 100000]
    for row in ring:
        assert row["checked"] == 3 * (2 + 1)  # every rank verified the bytes of every iteration
        assert min(row["floor_s"], row["gloo_s"], row["redsock_ring_s"]) > 0
        assert row["max_x_gloo"] == pytest.approx(row["gloo_s"] / row["floor_s"])
        assert row["ring_x_gloo"] == pytest.approx(row["gloo_s"] / row["redsock_ring_s"])
        # busbw = size / time x 2(N-1)/N, in GB/s
        assert row["floor_busbw"] == pytest.approx(row["size"] / row["floor_s"] * 4 / 3 / 1e9)
    assert [row["workers"] for row in fanin] == [2, 3]
    for row in fanin:
        assert row["checked"] == 1 * 50 + 2 * 100  # rounds the reducer summed (each sum checked by every worker)
        assert row["floor_us"] > 0 and row["gloo_us"] > 0
    assert "64 KiB" in r.stdout and "x first" in r.stdout


@pytest.mark.parametrize("args", [["--nprocs", "1"], ["--iters", "0"], ["--workers", "0"], ["--sizes", "12Q"]])
def test_bad_options_are_refused(args):
    r = floor(*args, timeout=60)
    assert r.returncode == 2 and "redsock: error:" in r.stderr


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root")


def test_testbed_row_arithmetic():
    from redsock.bench.floor.testbed import _row

    r = _row(64 << 20, 4, 2, 1_000_000_000, 0.8, 1.0)
    assert r["floor_algbw"] == pytest.approx((64 << 20) / 0.8 / 1e9)
    assert r["floor_good"] == pytest.approx(r["floor_algbw"] / (1e9 / 8 * 0.956 / 1e9))
    assert r["max_x_gloo"] == pytest.approx(1.25) and r["ideal"] == pytest.approx(1.5)


@needs_root
def test_testbed_floor_runs_the_pattern_and_gloo_and_cleans_up(tmp_path):
    from redsock.testbed import list_prefix_netns

    out, prefix = tmp_path / "tb.json", f"rsflt{os.getpid() % 10000}"
    r = floor("--testbed", "--mode", "ring", "--nprocs", "2", "--servers", "2", "--rate", "1gbit", "--sizes", "2M",
              "--iters", "2", "--warmup", "1", "--prefix", prefix, "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["size"] == 2 << 20 and row["workers"] == 2 and row["servers"] == 2
    assert row["floor_s"] > 0 and row["gloo_s"] > 0 and 0 <= row["floor_cpu_steal"] <= row["floor_cpu_busy"] <= 1
    # bytes per worker cannot cross a 1 Gbit/s link faster than the link
    assert row["floor_s"] >= (2 << 20) / (1e9 / 8)
    assert list_prefix_netns(prefix) == []


@needs_root
def test_testbed_fanin_puts_the_floor_next_to_the_reducers_and_gloo_on_the_same_hosts(tmp_path):
    from redsock.testbed import list_prefix_netns

    out, prefix = tmp_path / "fi.json", f"rsfit{os.getpid() % 10000}"
    r = floor("--testbed", "--mode", "fanin", "--workers", "2,3", "--servers", "1", "--iters", "1", "--warmup", "1",
              "--prefix", prefix, "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(row["mode"], row["workers"], row["servers"]) for row in rows] == [("testbed-fanin", 2, 1),
                                                                               ("testbed-fanin", 3, 1)]
    for row in rows:
        for what in ("floor", "server", "gloo"):  # two turns each, the faster counts
            assert len(row[f"{what}_turns_us"]) == 2 and row[f"{what}_us"] == min(row[f"{what}_turns_us"]) > 0
        assert row["server_x_floor"] == pytest.approx(row["server_us"] / row["floor_us"])
        assert row["server_x_gloo"] == pytest.approx(row["server_us"] / row["gloo_us"])
        assert all(0 <= row[f"{k}_steal"] <= row[f"{k}_busy"] <= 1 for k in ("floor", "server", "gloo"))
    assert "from 2 to 3 workers: floor x" in r.stdout
    assert list_prefix_netns(prefix + "n2") == [] and list_prefix_netns(prefix + "n3") == []


def test_fanin_reducer_refuses_a_rank_out_of_range():
    import socket
    import struct

    from redsock.bench.floor.loopback import fanin_accept
    from redsock.errors import PeerFailure

    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(10)
    with srv, socket.create_connection(srv.getsockname()) as c:
        c.sendall(struct.pack("<i", 2))
        with pytest.raises(PeerFailure, match="rank 2 \\(of 2"):
            fanin_accept(srv, 2)


def test_run_threads_waits_for_all_and_reraises_the_first_error():
    from redsock.bench.floor.loopback import run_threads

    done = []

    def boom():
        raise OSError("peer gone")

    with pytest.raises(OSError, match="peer gone"):
        run_threads([boom, lambda: done.append(1), lambda: done.append(2)])
    assert sorted(done) == [1, 2]
    run_threads([])  # nothing to run: no error


def test_memory_floor_times_redsock_in_the_same_processes(tmp_path):
    """--mode memory: per size, the copy-and-barrier floor and redsock's all-reduce (checked:
    0 wrong), each a positive time per call, their ratio, redsock's path and the machine's shares."""
    out = tmp_path / "memory.json"
    r = floor("--mode", "memory", "--nprocs", "3", "--sizes", "8,16,1M", "--warmup", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "memory floor: 3 ranks" in r.stdout
    rows = json.loads(out.read_text())
    assert [row["size"] for row in rows] == [8, 16, 1 << 20]
    for row in rows:
        assert row["wrong"] == 0 and row["mode"] == "memory" and row["nprocs"] == 3
        assert row["floor_s"] > 0 and row["redsock_s"] > 0
        assert row["x_floor"] == pytest.approx(row["redsock_s"] / row["floor_s"])
        assert row["calls"] >= 5 and 0 <= row["machine_steal"] <= row["machine_busy"] <= 1
    # (each one's time over its time at half the size, where that was timed: 16 B only)
    for key in ("floor", "redsock"):
        halves = [row[f"{key}_x_half"] for row in rows]
        assert halves == [None, pytest.approx(rows[1][f"{key}_s"] / rows[0][f"{key}_s"]), None]
    table = [cells for cells in map(str.split, r.stdout.splitlines()) if cells[:2] == ["16", "B"]]
    assert len(table) == 1 and table[0][6:8] == [f"{rows[1]['floor_x_half']:.2f}x", f"{rows[1]['redsock_x_half']:.2f}x"]
    # (1 MiB goes either way, the faster lately: one name, or both with their shares)
    from test_bench_allreduce import WAYS

    assert rows[0]["path"] == "whole" and re.fullmatch(WAYS, rows[-1]["path"])


def test_memory_floor_is_one_host_only():
    r = floor("--mode", "memory", "--testbed", timeout=60)
    assert r.returncode != 0 and "one host" in r.stderr



def test_memory_floor_barrier_gives_up_on_a_peer_that_never_comes(monkeypatch):
    """The floor's barrier spins without system calls; a peer that never arrives (it died, and
    the parent that would stop this rank is gone too) ends in PeerFailure, not a spin forever."""
    import time

    from redsock.bench.floor import memory
    from redsock.errors import PeerFailure

    monkeypatch.setattr(memory, "BARRIER_TIMEOUT_S", 0.5)
    steps = memoryview(bytearray(2 * 64)).cast("Q")
    t0 = time.monotonic()
    with pytest.raises(PeerFailure, match="did not reach the barrier"):
        memory._barrier(steps, 0, steps[0:16:8], 1)  # rank 1's counter stays at 0
    assert 0.5 <= time.monotonic() - t0 < 5
