"""DDP training that survives a worker's death under ``torchrun`` (elastic restarts).

    torchrun --standalone --nnodes 1 --nproc-per-node 3 --max-restarts 2 \\
        examples/elastic_ddp.py --backend redsock --checkpoint ckpt/ --steps 40
    REDSOCK_SERVERS=r1:7700 torchrun ...          # gradients through reduction servers

Rank 0 writes a checkpoint (model, optimizer, next step) after every step, atomically
(a temporary file, then ``os.replace``); every rank of a new generation starts from it.
When a worker dies, torchrun stops the others and starts the group again
(``TORCHELASTIC_RESTART_COUNT`` counts the generations); the backend's communicator is made
afresh through the new generation's store keys.  ``--kill-rank R --kill-at-step S`` makes rank
R kill itself (SIGKILL, no clean-up) at step S of the first generation, once every rank has
finished step S-1 (a barrier): a fault to recover from, after which training resumes from step S.

Each step's global batch is drawn from a generator seeded by the step number, and rank r
trains on rows r*B..(r+1)*B of it: a resumed run sees the same data as an uninterrupted one.
Rank 0 prints ``KILL``/``RESUMED`` lines with wall-clock times (for the recovery time) and,
with ``--save-params``, writes the final parameters.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

FEATURES, HIDDEN = 64, 512  # 33 K parameters: a 133 KB gradient bucket (the reducers take >= 64 KiB)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def make_optimizer(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def global_batch(step: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's whole batch (every rank draws the same one and takes its own rows)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(rows, FEATURES, generator=g)
    y = torch.sin(x[:, :8].sum(dim=1, keepdim=True)) + 0.05 * torch.randn(rows, 1, generator=g)
    return x, y


def save_checkpoint(path: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}, tmp)
    os.replace(tmp, path)  # a reader sees the old checkpoint or the new one, never half of one


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="redsock")
    p.add_argument("--checkpoint", required=True, help="directory for the checkpoint")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16, help="rows per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--save-params", help="rank 0 writes the final parameters here (torch.save)")
    args = p.parse_args(argv)

    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group(args.backend, timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    opt = make_optimizer(model.parameters(), args.lr)
    ckpt = Path(args.checkpoint) / "checkpoint.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    ddp = DDP(model)
    if rank == 0:
        print(f"generation {generation}: backend {args.backend}, world {world}, from step {start}", flush=True)

    for step in range(start, args.steps):
        if generation == 0 and step == args.kill_at_step:
            # The fault comes once every rank has finished step S-1, so rank 0 has saved the
            # checkpoint of step S (torchrun stops the others within its monitor interval of
            # the kill, which a slow save could outlast): the next generation starts from S.
            dist.barrier()
            if rank == args.kill_rank:
                print(f"KILL rank {rank} step {step} t={time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        x, y = global_batch(step, world * args.batch_size)
        mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
        loss = F.mse_loss(ddp(x[mine]), y[mine])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0:
            save_checkpoint(ckpt, step + 1, model, opt)
            if generation > 0 and step == start:
                print(f"RESUMED generation {generation} step {step} t={time.time():.3f}", flush=True)

    if rank == 0:
        print(f"DONE generation {generation} steps {args.steps}", flush=True)
        if args.save_params:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.save_params)
    dist.barrier()  # leave together (a rank that exits while a peer reads can reset its connection)
    del ddp, model, opt  # DDP holds the process group: destroyed with it, while Python runs (see train_lm.py)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
