"""torchrun elastic restarts with the redsock backend (ring, and reduction servers).

``examples/elastic_ddp.py`` runs under ``torchrun --standalone --nnodes 1 --nproc-per-node 3
--max-restarts 2``; rank 1 kills itself (SIGKILL) at step 15 of the first generation, torchrun
stops the others and starts a second generation, which resumes from the checkpoint of step 15
(rank 0's save of it is slowed down by a second, as on a loaded machine: :data:`SLOW_SAVE`) and
finishes.  The final parameters must equal those of the same training in one process (the
mean loss over the whole global batch is what DDP's averaged gradients descend), and the
reducers must serve the second generation's job and free the first one's.  The recovery
time (kill to the first step of the new generation) is printed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from redsock.bench.procs import stop_processes
from test_server import _log_text, _wait_until, start_reducer

EXAMPLE = Path(__file__).parent.parent / "examples" / "elastic_ddp.py"
STEPS, KILL_AT, WORLD, BATCH = 40, 15, 3, 16


def _example():
    spec = importlib.util.spec_from_file_location("elastic_ddp", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_params() -> dict[str, torch.Tensor]:
    """The same training in one process, on each step's whole global batch."""
    ex = _example()
    model = ex.make_model()
    opt = ex.make_optimizer(model.parameters(), 0.05)
    for step in range(STEPS):
        x, y = ex.global_batch(step, WORLD * BATCH)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model.state_dict()


#: Loaded into the workers (``sitecustomize``): rank 0 of the first generation takes a second
#: to save the checkpoint of step KILL_AT, as on a loaded machine.  torchrun stops the other
#: workers within its monitor interval of the kill, so the fault must come once that
#: checkpoint is on disk, however slow rank 0 is, for the next generation to start from it.
SLOW_SAVE = f"""
import os
if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("RANK") == "0":
    import time, torch
    _save = torch.save
    def _slow_save(obj, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") == {KILL_AT}:
            time.sleep(1.0)
        return _save(obj, *args, **kwargs)
    torch.save = _slow_save
"""


def run_elastic(tmp_path: Path, env: dict[str, str] | None = None) -> tuple[str, float]:
    """torchrun with one worker killed mid-training; returns (its output, recovery seconds)."""
    final = tmp_path / "final.pt"
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SLOW_SAVE)
    path = os.pathsep.join(p for p in (str(inject), os.environ.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(WORLD), "--max-restarts", "2", "--monitor-interval", "0.1",
           "--log-dir", str(tmp_path / "torchrun"),  # (else torchrun leaves a directory in /tmp per run)
           str(EXAMPLE), "--backend", "redsock", "--checkpoint", str(tmp_path), "--steps", str(STEPS),
           "--batch-size", str(BATCH), "--kill-rank", "1", "--kill-at-step", str(KILL_AT),
           "--save-params", str(final)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(env or {})})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    assert f"generation 0: backend redsock, world {WORLD}, from step 0" in out, out[-4000:]
    # The second generation started from the checkpoint of the last step the first finished.
    assert f"generation 1: backend redsock, world {WORLD}, from step {KILL_AT}" in out, out[-4000:]
    assert f"DONE generation 1 steps {STEPS}" in out, out[-4000:]
    killed = float(re.search(r"KILL rank 1 step \d+ t=([\d.]+)", out).group(1))
    resumed = float(re.search(r"RESUMED generation 1 step \d+ t=([\d.]+)", out).group(1))
    got = torch.load(final, weights_only=True)
    for name, want in reference_params().items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    return out, resumed - killed


def test_elastic_restart_resumes_from_checkpoint_on_ring(tmp_path):
    _, recovery = run_elastic(tmp_path)
    print(f"ring: recovery (kill -> first step of generation 1) {recovery:.2f}s")


def test_elastic_restart_through_reducers_frees_the_old_generations_job(tmp_path):
    proc, address = start_reducer()
    try:
        _, recovery = run_elastic(tmp_path, {"REDSOCK_SERVERS": address, "REDSOCK_SHM": "off"})  # one host: shared memory would bypass the reducers
        print(f"reducers: recovery (kill -> first step of generation 1) {recovery:.2f}s")
        # The reducer saw one job per generation; the first was freed when its worker died
        # (aborted, or left once its last connection closed), the second left at the end.
        _wait_until(lambda: len(re.findall(r"job (0x[0-9a-f]+) left\b", _log_text(proc))) >= 2
                    or "aborted" in _log_text(proc) and re.search(r"job 0x[0-9a-f]+ left\b", _log_text(proc)), 30)
        log = _log_text(proc)
        print("reducer:", *[line for line in log.splitlines() if " job " in line], sep="\n  ")
        jobs = re.findall(r"job (0x[0-9a-f]+) joined", log)
        assert len(jobs) == 2 and jobs[0] != jobs[1], log
        old, new = jobs
        assert re.search(rf"job {old} (aborted|left\b)", log), log
        assert re.search(rf"job {new} left\b", log), log
        assert not re.search(rf"job {new} aborted", log), log
    finally:
        stop_processes([proc])
