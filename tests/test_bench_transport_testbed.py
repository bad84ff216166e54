"""``redsock bench transport --testbed perflow``, small: the acceptance benchmark in CI.

Four path classes of 200/150/100/50 Mbit/s picked by source-port bits, 32 MiB
messages, one repetition of 4 messages: about 20 s.  The full-size figure
(800/600/400/200 Mbit/s, 256 MiB) is in the issue's report; this checks the
same claims at a size CI affords, plus the bookkeeping that makes the numbers
trustworthy (every payload byte accounted for, tc saw it in the right classes,
nothing left behind).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from redsock.bench.transport.testbed import GOODPUT_FACTOR
from redsock.testbed import cleanup_prefix, list_prefix_netns, parse_rate

IS_ROOT = os.geteuid() == 0
RATES = ["200mbit", "150mbit", "100mbit", "50mbit"]
PREFIX = f"rsbc{os.getpid() % 100000}"


@pytest.mark.skipif(not IS_ROOT, reason="network namespaces and tc need root")
@pytest.mark.timeout(150)
def test_dynamic_beats_static_over_unequal_paths(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = [sys.executable, "-m", "redsock", "bench", "transport", "--testbed", "perflow",
            "--rates", ",".join(RATES), "--sizes", "32M", "--nsocks", "4", "--reps", "1",
            "--impl", "redsock,plain", "--prefix", PREFIX, "--json", str(out)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    finally:
        leftover = list_prefix_netns(PREFIX)
        cleanup_prefix(PREFIX)  # a failing run must not leave namespaces for the next test
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stderr
    # Torn down by the benchmark itself, not by the cleanup above.
    assert leftover == []
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                            check=True).stdout.split() if ns.startswith(PREFIX + "-")]

    rows = {(r["impl"], r["balance"]): r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {("redsock", "dynamic"), ("redsock", "static"), ("plain", "-")}
    rates = [parse_rate(r) for r in RATES]
    for r in rows.values():
        e = r["extra"]
        assert r["bytes"] == 32 << 20 and r["gbps"] > 0
        # Shaping holds: nothing beats the classes it went through (2% for timer slack).
        assert r["gbps"] * 1e9 <= 1.02 * e["capacity_bps"], r
        # Every payload byte went out exactly once, over the data streams...
        assert sum(e["bytes_per_stream"]) == e["payload_bytes"]
        # ...and tc counted at least that much in the classes those streams hash to.
        for c in set(e["classes"]):
            mine = sum(b for b, k in zip(e["bytes_per_stream"], e["classes"]) if k == c)
            assert e["class_sent_bytes"][c] >= mine, (c, e["class_sent_bytes"], mine)

    dyn, sta, plain = rows["redsock", "dynamic"], rows["redsock", "static"], rows["plain", "-"]
    # A fair comparison: both landed one stream on each class (the benchmark reconnects until so).
    assert sorted(dyn["extra"]["classes"]) == sorted(sta["extra"]["classes"]) == [0, 1, 2, 3]
    assert dyn["extra"]["capacity_bps"] == sum(rates)
    assert plain["extra"]["classes"] == [0]  # the single socket gets its best case, the fastest class

    # Static: an even split, so every stream is held to the slowest class's pace.
    assert all(abs(s["share"] - 0.25) < 1e-9 for s in sta["extra"]["streams"])
    assert sta["gbps"] * 1e9 <= 1.02 * 4 * min(rates)
    # Dynamic: each stream's share of the bytes follows its class rate.
    for s in dyn["extra"]["streams"]:
        assert abs(s["share"] - s["ideal_share"]) < 0.05, dyn["extra"]["streams"]

    # The bounds.  >= 85% of the goodput capacity (0.956 x configured: tc counts
    # headers) rather than of the configured rate: a 1-rep CI run on a shared 2-core box
    # keeps a little slack; full size reaches ~99% of goodput, ~95% of configured.  The
    # 1.6x bound needs no softening: with dynamic >= 85% (406 Mbit/s) static would have
    # to beat 254 Mbit/s, above its 4 x 50 Mbit/s ceiling.
    assert dyn["gbps"] * 1e9 >= 0.85 * GOODPUT_FACTOR * dyn["extra"]["capacity_bps"], dyn
    assert dyn["gbps"] >= 1.6 * sta["gbps"], (dyn["gbps"], sta["gbps"])
    assert dyn["extra"]["dynamic_over_static"] == pytest.approx(dyn["gbps"] / sta["gbps"])
