"""One data stream throttled by tc (in a namespace of its own): the others take its share."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from redsock.testbed import netns

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a network namespace and tc")

PEERS = Path(__file__).parent / "peer_programs.py"
RATE_BPS = 100e6


def run_in_namespace(balance, nbytes):
    ns = f"rsthr{os.getpid() % 100000}"
    netns.del_netns(ns) if netns.netns_exists(ns) else None
    netns.add_netns(ns)
    try:
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, str(PEERS), "throttled_stream",
                              "100mbit", str(nbytes), balance],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        netns.del_netns(ns)
        assert not netns.netns_exists(ns)


def test_throttled_stream_takes_fewer_slices_and_nothing_is_lost():
    nbytes = 64 << 20
    r = run_in_namespace("dynamic", nbytes)
    assert r["intact"]
    total = sum(r["slices"])
    assert total == nbytes // (64 * 1024)
    # The throttled stream (0) moved a small share: 100 Mbit/s against ~Gbit/s loopback streams.
    assert r["bytes"][0] < 0.1 * nbytes, r
    # An even split would leave 16 MiB on the 100 Mbit/s stream: 1.34 s. Dynamic finishes far sooner.
    static_estimate = (nbytes / 4) * 8 / RATE_BPS
    assert r["elapsed"] < 0.4 * static_estimate, r


def test_static_split_waits_for_the_throttled_stream():
    nbytes = 16 << 20
    r = run_in_namespace("static", nbytes)
    assert r["intact"]
    assert r["bytes"][0] == nbytes // 4  # its fixed piece, whatever its speed
    assert r["elapsed"] > 0.8 * (nbytes / 4) * 8 / RATE_BPS, r
