"""PyTorch Lightning, unchanged, on the redsock backend: ``examples/lightning_ddp.py`` trains
with ``DDPStrategy(process_group_backend=...)`` on 2 CPU processes, once on gloo and once on
redsock, to the same loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parent.parent / "examples" / "lightning_ddp.py"


def train(backend: str, workdir: Path) -> list[float]:
    out = workdir / f"{backend}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--backend", backend, "--epochs", "3", "--json", str(out)],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{backend}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(out.read_text())
    assert result["backend"] == backend
    return result["losses"]


def test_lightning_module_trains_to_the_same_loss_as_on_gloo(tmp_path):
    gloo = train("gloo", tmp_path)
    redsock = train("redsock", tmp_path)
    assert len(gloo) == len(redsock) == 3
    assert gloo[-1] < 0.7 * gloo[0], f"gloo did not learn: {gloo}"
    # With 2 ranks every gradient element is one float32 sum of two addends on both
    # backends (addition commutes), and DDP averages the same way: the same bits.
    assert redsock == gloo, f"redsock {redsock} != gloo {gloo}"
