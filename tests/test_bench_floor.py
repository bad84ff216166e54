"""``redsock bench floor``: plain-socket lower bounds, measured in the same processes as gloo."""

from __future__ import annotations

import json
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
