"""``redsock bench allreduce --testbed``: reducers against gloo on an emulated cluster (root).

One small end-to-end run: 3 worker namespaces + 3 reducer namespaces on shaped
links, every rank running the benchmark, ``--check`` on, and the testbed gone
afterwards.  The pure helpers (argv forwarding, the summary) are tested without root.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from redsock import results as report
from redsock.bench import allreduce
from redsock.bench.allreduce import testbed as allreduce_testbed
from redsock.testbed import list_prefix_netns

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="network namespaces and tc need root")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    allreduce.add_arguments(p)
    return p.parse_args(argv)


def test_child_argv_drops_launcher_options_and_keeps_bench_options():
    args = _parse(["--testbed", "--workers", "3", "--servers", "2", "--rate", "1gbit", "--prefix", "abc",
                   "--tcp-cc", "reno", "-b", "8M", "-e", "64M", "-n", "5", "--algo", "server,ring,gloo",
                   "--check", "--json", "out.json", "--plot", "p.png", "--timeout", "60"])
    argv = allreduce_testbed.child_argv(args, "/tmp/rows.jsonl")
    assert argv[:2] == ["bench", "allreduce"]
    for gone in ("--testbed", "--workers", "--servers", "--rate", "--prefix", "--tcp-cc", "--plot",
                 "--timeout", "out.json"):
        assert gone not in argv
    assert argv[argv.index("--minbytes") + 1] == "8M"
    assert argv[argv.index("--iters") + 1] == "5"
    assert argv[argv.index("--algo") + 1] == "server,ring,gloo"
    assert "--check" in argv and "--no-progress" in argv
    assert argv[argv.index("--json") + 1] == "/tmp/rows.jsonl"
    # What the ranks get parses back to the same bench options.
    child = _parse(argv[2:])
    assert (child.minbytes, child.maxbytes, child.iters, child.algo, child.check) == ("8M", "64M", 5,
                                                                                     "server,ring,gloo", True)
    assert not child.testbed


def test_summary_ratios_against_link_and_gloo():
    rate = 1_000_000_000
    goodput = rate * allreduce_testbed.GOODPUT_FACTOR / 8 / 1e9
    rows = [report.Row.from_times("redsock", "server", 4, 1 << 26, 1 << 24, "float32", "sum",
                                  [(1 << 26) / 1e9 / goodput], 0),
            report.Row.from_times("gloo", "gloo", 4, 1 << 26, 1 << 24, "float32", "sum",
                                  [1.5 * (1 << 26) / 1e9 / goodput], 0,
                                  extra={"machine_busy": 0.614, "machine_steal": 0.052})]
    text = allreduce_testbed.summary_table(rows, rate, 4, 4, "uniform")
    line = next(x for x in text.splitlines() if "server" in x and "MiB" in x)
    assert "100.0%" in line      # at the link goodput
    assert " 1.50 " in line      # 1.5x gloo, and the ideal 2(N-1)/N = 1.5 at N=4
    # How busy the machine was while each row was timed, and of that the hypervisor's steal, where
    # the row says: the two columns before the last.
    assert line.split()[-3:-1] == ["-", "-"]
    assert next(x for x in text.splitlines() if " gloo " in x and "MiB" in x).split()[-3:-1] == ["61%", "5%"]
    assert allreduce_testbed.ideal_over_gloo("server", 8) == pytest.approx(1.75)


@needs_root
def test_small_testbed_run_server_beats_gloo_and_cleans_up(tmp_path):
    prefix = f"rsat{os.getpid() % 100000}"
    out = tmp_path / "rows.jsonl"
    argv = [sys.executable, "-m", "redsock", "bench", "allreduce", "--testbed",
            "--workers", "3", "--servers", "3", "--rate", "300mbit", "--prefix", prefix,
            # A loss-based congestion control in the namespaces, so the result does not depend
            # on the CI machine's default (this lab's is bbr; reno is always permitted).
            "--tcp-cc", "reno",
            "-b", "32M", "-e", "32M", "-n", "2", "-w", "1", "--algo", "server,gloo", "--check",
            "--json", str(out), "--timeout", "100"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=110)
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        rows = {r["algo"]: r for r in map(json.loads, out.read_text().splitlines())}
        assert set(rows) == {"server", "gloo"}, proc.stdout
        assert all(r["wrong"] == 0 for r in rows.values()), proc.stdout
        assert rows["server"]["extra"]["testbed"]["workers"] == 3
        # Per worker a reducer moves S each way, gloo's ring 2S(N-1)/N: the ideal ratio at
        # N=3 is 4/3.  Measured here: 1.04x (the reducers reach ~78% of link goodput, against
        # ~75% for gloo's ring: incast at the reducers' shaped downlinks costs drops).  The
        # acceptance ratios are benchmark figures (issue notes); this guards that the reducer
        # path stays correct and keeps pace with the ring through shaped links.
        ratio = rows["server"]["algbw_GBps"] / rows["gloo"]["algbw_GBps"]
        assert ratio >= 0.9, f"server/gloo algbw = {ratio:.2f} < 0.9\n{proc.stdout}"
        assert "peak RSS" in proc.stdout and "link goodput" in proc.stdout
    finally:
        left = list_prefix_netns(prefix)
        if left:  # clean up for the next run, but still fail
            subprocess.run([sys.executable, "-m", "redsock", "testbed", "down", "--prefix", prefix],
                           capture_output=True)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not left and prefix not in listed, f"namespaces left behind: {left}"
