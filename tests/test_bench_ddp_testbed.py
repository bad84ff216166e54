"""``redsock bench ddp --testbed``: DDP steps/s of the example model per backend (root).

The pure parts (the RESULT line, the summary) are tested without root; one small
end-to-end run trains on 2 worker namespaces + 1 reducer namespace with gloo, the
redsock ring and the reducer, and checks the three trainings agree and the testbed
is gone afterwards.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from redsock.bench import ddp_testbed
from redsock.errors import RedsockError
from redsock.testbed import list_prefix_netns

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root")


def test_parse_result_reads_the_last_result_line():
    text = ("step 0 loss 9.2\nRESULT backend=gloo hook=none world=4 steps=8 time_s=3.900 steps_per_s=2.051 "
            "final_loss=9.1845 grad_bytes=29480960\n")
    r = ddp_testbed.parse_result(text)
    assert r == {"backend": "gloo", "hook": "none", "world": 4, "steps": 8, "time_s": 3.9, "steps_per_s": 2.051,
                 "final_loss": 9.1845, "grad_bytes": 29480960}
    with pytest.raises(RedsockError, match="no RESULT"):
        ddp_testbed.parse_result("step 0 loss 9.2\n")


def test_summary_takes_medians_and_counts_reducer_hosts():
    def res(sps, rtos=0, steal=0.0):
        return {"steps": 10, "time_s": 10 / sps, "steps_per_s": sps, "final_loss": 9.0, "grad_bytes": 100,
                "tcp": {"RetransSegs": 5, "TCPTimeouts": rtos}, "machine_busy": 0.9, "machine_steal": steal}

    rows = ddp_testbed.summarize({"gloo": [res(2.0, steal=0.2), res(1.0), res(3.0, steal=0.05)],
                                  "server": [res(3.0), res(4.0, rtos=2), res(2.0, rtos=1)]},
                                 workers=4, servers=4, rate=10**9)
    gloo, server = rows
    assert gloo["steps_per_s"] == 2.0 and server["steps_per_s"] == 3.0
    assert (gloo["hosts"], server["hosts"]) == (4, 8) and server["servers"] == 4 and gloo["servers"] == 0
    assert server["vs_gloo"] == pytest.approx(1.5)
    assert gloo["host_s_per_step"] == pytest.approx(2.0) and server["host_s_per_step"] == pytest.approx(8 / 3)
    assert server["cost_vs_gloo"] == pytest.approx(4 / 3)
    assert (gloo["tcp_timeouts"], server["tcp_timeouts"]) == (0, 3)  # summed over the runs
    assert (gloo["machine_steal"], server["machine_steal"]) == (0.05, 0.0)  # medians, as busy
    text = ddp_testbed.format_summary(rows, workers=4, rate=10**9)
    assert next(x for x in text.splitlines() if x.split()[0] == "gloo").split()[-4:-3] == ["5%"]
    assert "1.50" in text and "1 Gbit/s" in text and "RTOs" in text
    assert text.splitlines()[-1].split()[7] == "3"  # the server row's RTO column


def test_bad_options_are_refused_before_anything_starts():
    for extra, msg in ((["--algos", "gloo,nccl"], "unknown nccl"), (["--steps", "3", "--warmup", "3"], "exceed"),
                       (["--workers", "1"], "workers"), (["--bucket-cap-mb", "-1"], "bucket-cap-mb")):
        r = subprocess.run([sys.executable, "-m", "redsock", "bench", "ddp", "--testbed", *extra],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and msg in r.stderr, r.stderr


@needs_root
def test_ddp_on_the_testbed_gloo_ring_and_reducer_agree(tmp_path):
    prefix = f"rsdt{os.getpid() % 10000}"
    out = tmp_path / "ddp.jsonl"
    r = subprocess.run([sys.executable, "-m", "redsock", "bench", "ddp", "--testbed", "--workers", "2",
                        "--servers", "1", "--rate", "500mbit", "--steps", "6", "--warmup", "2",
                        "--prefix", prefix, "--timeout", "240", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    try:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        rows = {o["algo"]: o for o in map(json.loads, out.read_text().splitlines())}
        assert set(rows) == {"gloo", "ring", "server"}
        for o in rows.values():
            assert o["steps"] == 4 and o["steps_per_s"] > 0 and o["grad_bytes"] > 10 << 20
            assert o["host_s_per_step"] == pytest.approx(o["hosts"] / o["steps_per_s"])
            # Same seeds, same data: the three backends train the same model.
            assert math.isclose(o["final_loss"], rows["gloo"]["final_loss"], rel_tol=1e-3)
        assert (rows["gloo"]["hosts"], rows["ring"]["hosts"], rows["server"]["hosts"]) == (2, 2, 3)
        assert "x gloo" in r.stdout
        # Every run reports the hosts' TCP retransmission counters (differences: never negative).
        per_run = [line for line in r.stdout.splitlines() if line.startswith("# TCP during the run")]
        assert len(per_run) == 3, r.stdout[-3000:]
        for line in per_run:
            counts = dict(kv.rsplit(" ", 1) for kv in line.split(": ", 1)[1].split(", "))
            assert set(counts) >= {"RetransSegs", "TCPTimeouts"} and all(int(v) >= 0 for v in counts.values())
        assert all(isinstance(o["tcp_timeouts"], int) and o["tcp_timeouts"] >= 0 for o in rows.values())
    finally:
        assert list_prefix_netns(prefix) == []
