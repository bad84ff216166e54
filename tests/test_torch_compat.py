"""A curated, fast part of ``make compat``: tests from torch's own distributed suite
(``tests/compat``) that cover what redsock added for it — any-source receive, coalesced and
sparse all-reduce/all-gather, the profiler's records, and (behind the suite's gates on the
name "gloo") batched send/recv, monitored barriers, timeouts and DDP with ``no_sync``.
Each passes for gloo in ``make compat``; here they must pass for redsock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

RUNNER = Path(__file__).parent / "compat" / "torch_suite.py"

FEATURES = ["test_send_recv_any_source", "test_send_recv_any_source_autograd_profiler",
            "test_send_recv_with_tag_autograd_profiler", "test_isend_torch_profiler",
            "test_all_gather_coalesced_simple", "test_all_gather_coalesced_with_empty",
            "test_all_reduce_sum", "test_all_reduce_sum_async", "test_broadcast", "test_reduce_sum"]
GLOO_GATED = ["test_batch_isend_irecv_gloo_tags", "test_sparse_all_reduce_sum",
              "test_monitored_barrier_gloo_rank_0_timeout", "test_barrier_timeout_full_group",
              "test_accumulate_gradients_no_sync", "test_all_reduce_coalesced_sum"]


def run_suite(tmp_path: Path, names: list[str], world: int, gate: str | None = None) -> dict:
    out = tmp_path / f"w{world}{gate or ''}.json"
    cmd = [sys.executable, str(RUNNER), "--backend", "redsock", "--world-size", str(world), "--json", str(out),
           "--only", *names]
    if gate:
        cmd += ["--gate", gate]
    with tempfile.TemporaryDirectory(prefix="rsc-") as tmp:  # (short: forkserver's socket goes in it)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                              env={**os.environ, "PYTORCH_PRINT_REPRO_ON_FAILURE": "0", "TMPDIR": tmp})
        left = [f for f in os.listdir(tmp) if not f.startswith("torchinductor_")]  # (torch's cache, kept)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-6000:]
    assert not left, f"the run left temporary files behind: {left}"
    return json.loads(out.read_text())["tests"]


@pytest.mark.parametrize("gate", [None, "gloo"], ids=["feature-sets", "gloo-gated"])
def test_torch_suite_curated(tmp_path, gate):
    names = GLOO_GATED if gate else FEATURES
    results = run_suite(tmp_path, names, 3, gate)
    assert sorted(results) == sorted(names), f"not run: {set(names) - set(results)}"
    bad = {n: r for n, r in results.items() if r["outcome"] != "passed"}
    assert not bad, "\n".join(f"{n}: {r['outcome']}: {r.get('detail', '')[-1500:]}" for n, r in bad.items())
