"""Hierarchical collectives across emulated hosts (network namespaces; needs root).

Six ranks on three hosts of 3, 1 and 2 ranks, not consecutive: shared memory inside each
host, one shard per local rank between hosts (here one shard: the smallest host has one rank).
"""

import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from redsock.bench.procs import start_logged, wait_logged
from redsock.testbed import Testbed, list_prefix_netns
from test_collectives import digests

WORKER = Path(__file__).parent / "collective_worker.py"
PLACEMENT = {0: "w0", 1: "w1", 2: "w2", 3: "w0", 4: "w2", 5: "w0"}  # hosts of 3, 1 and 2 ranks

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def run_hosts(scenario: str, env: dict | None = None, timeout: float = 300, servers: int = 0):
    """Run ``scenario`` with ranks placed by PLACEMENT; returns (returncode, stdout, stderr) per rank."""
    prefix = f"rsh{os.getpid() % 100000}"
    world = len(PLACEMENT)
    # The ranks meet through a FileStore: the namespaces share the filesystem.
    with Testbed(workers=3, servers=servers, rate="10gbit", prefix=prefix) as tb, \
            tempfile.TemporaryDirectory(prefix="redsock-store-") as store:
        # MASTER_ADDR: each rank advertises the address that routes there (its host's own).
        common = {**os.environ, "MASTER_ADDR": tb.host_addr("w0"), "TEST_TIMEOUT_S": "30", **(env or {})}
        if servers:
            reducers = [tb.popen(s, [sys.executable, "-m", "redsock", "serve", "--host", tb.host_addr(s),
                                     "--port", "7700"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                        for s in tb.server_names]
            common["REDSOCK_SERVERS"] = ",".join(f"{tb.host_addr(s)}:7700" for s in tb.server_names)
        procs = [start_logged([sys.executable, str(WORKER), scenario, str(r), str(world), store],
                              functools.partial(tb.popen, PLACEMENT[r]), env=common)
                 for r in range(world)]
        outs = wait_logged(procs, timeout)
        if servers:
            for s in reducers:
                s.terminate()
    assert not list_prefix_netns(prefix)
    return outs


def test_every_op_and_dtype_across_uneven_hosts():
    outs = run_hosts("auto_matrix", {"TEST_EXPECT_HIER": "1"})
    for r, (code, out, err) in enumerate(outs):
        assert code == 0 and out.rstrip().endswith("ok"), "\n".join(f"rank {q}: {e[-1500:]}" for q, (_, _, e) in enumerate(outs))
    first = digests(outs[0][1])
    assert len(first) > 5 * 8 * 7
    for r, (_, out, _) in enumerate(outs[1:], 1):
        assert digests(out) == first, f"rank {r} differs from rank 0"


def test_killed_local_rank_fails_every_rank_on_every_host():
    """kill -9 of rank 5 (third rank of host w0): ranks on w0 see it through shared memory,
    ranks on w1 and w2 through the inter-host group; all name rank 5."""
    outs = run_hosts("dies_auto", {"TEST_COUNT": str(1 << 20)}, timeout=120)
    assert outs[5][0] == -9
    for r, (code, out, err) in enumerate(outs[:5]):
        assert code == 0, f"rank {r}:\n{err[-3000:]}"
        assert "ranks=[5]" in out, f"rank {r} did not name the dead rank: {out}"


def test_inter_host_shards_through_reduction_servers():
    """With reducers, each inter-host group is a reducer job of its own (world = 3 hosts)."""
    outs = run_hosts("others", servers=2, timeout=180)
    for r, (code, out, err) in enumerate(outs):
        assert code == 0 and out.rstrip().endswith("ok"), "\n".join(f"rank {q}: {e[-1500:]}" for q, (_, _, e) in enumerate(outs))
    assert len({tuple(digests(out)) for _, out, _ in outs}) == 1


def test_16_bit_wire_between_hosts_through_reducers_and_ring():
    """The in-host stage sums float32 in shared memory; between hosts each shard travels on
    the wire (reducers, or the ring's all-gather): within the bound, the same bits everywhere,
    fp16 overflow raised on every rank of every host."""
    outs = run_hosts("wire_matrix", {"TEST_EXPECT_HIER": "1"}, servers=2, timeout=240)
    for r, (code, out, err) in enumerate(outs):
        assert code == 0 and out.rstrip().endswith("ok"), "\n".join(f"rank {q}: {e[-1500:]}" for q, (_, _, e) in enumerate(outs))
    first = digests(outs[0][1])
    assert len(first) == 2 * 4 * 2 * 4
    assert all(digests(out) == first for _, out, _ in outs[1:])
