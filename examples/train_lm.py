"""Data-parallel training of a small transformer language model, on synthetic tokens.

    torchrun --nproc-per-node 4 examples/train_lm.py --backend redsock
    torchrun --nproc-per-node 4 examples/train_lm.py --backend gloo
    torchrun --nproc-per-node 4 examples/train_lm.py --backend gloo --hook redsock   # gloo + redsock buckets
    torchrun ... --hook compress --wire bf16    # buckets on redsock's 16-bit wire, error feedback
    REDSOCK_SERVERS=host:7700 torchrun ... --backend redsock                         # via reduction servers

The default model (4 layers, d_model 256, vocab 8192, sequence 128) has 7.4 M
parameters: about 30 MB of float32 gradients to all-reduce every step.  The
data is a fixed random "next token" table plus noise, so the loss falls without
any download.  Prints loss and steps/s (after ``--warmup`` steps) on rank 0.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class TransformerLM(nn.Module):
    """Decoder-only transformer: token + position embeddings, pre-norm blocks, causal mask."""

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, seq_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        block = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(n, device=tokens.device))
        x = self.blocks(x, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(x))


class SyntheticTokens:
    """Sequences that follow a fixed random successor table, with 10% random tokens.
    The table is the same on every rank (seed); the draws differ per rank."""

    def __init__(self, vocab: int, seq_len: int, batch: int, seed: int, rank: int):
        table_gen = torch.Generator().manual_seed(seed)
        self.successor = torch.randperm(vocab, generator=table_gen)
        self.gen = torch.Generator().manual_seed(seed * 1000 + rank + 1)
        self.vocab, self.seq_len, self.batch = vocab, seq_len, batch

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.seq_len + 1
        seq = torch.empty(self.batch, n, dtype=torch.long)
        seq[:, 0] = torch.randint(self.vocab, (self.batch,), generator=self.gen)
        noise = torch.rand(self.batch, n, generator=self.gen) < 0.1
        rand = torch.randint(self.vocab, (self.batch, n), generator=self.gen)
        for t in range(1, n):
            seq[:, t] = torch.where(noise[:, t], rand[:, t], self.successor[seq[:, t - 1]])
        return seq[:, :-1], seq[:, 1:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="redsock", help="redsock or gloo (any torch.distributed backend)")
    p.add_argument("--hook", choices=["none", "redsock", "powersgd", "compress", "torch-fp16"], default="none",
                   help="redsock: keep --backend for everything else, all-reduce gradient buckets with redsock; "
                        "powersgd: torch's PowerSGD hook (rank 2, compressed from step 2) on --backend; "
                        "compress: redsock.torch.compress_hook (16-bit wire, float32 sums); "
                        "torch-fp16: torch's fp16_compress_hook on --backend")
    p.add_argument("--wire", choices=["bf16", "fp16"], default="bf16", help="the compress hook's wire type")
    p.add_argument("--no-error-feedback", action="store_true", help="the compress hook without error feedback")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the steps/s figure")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="DDP bucket size; 0: DDP's own default (no bucket_cap_mb: a 1 MB first bucket, then 25 MB)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="adamw")
    p.add_argument("--lr", type=float, default=None, help="default: 1e-3 (adamw), 0.05 (sgd)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-params", metavar="FILE", default=None,
                   help="save the final parameters (torch.save of a name->tensor dict); a '{rank}' in "
                        "FILE is replaced by the rank and every rank saves, otherwise rank 0 only")
    args = p.parse_args(argv)
    if args.bucket_cap_mb < 0:
        p.error("--bucket-cap-mb must be >= 0 (0: DDP's own default)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.backend == "redsock" or args.hook in ("redsock", "compress"):
        import redsock.torch  # noqa: F401 - registers the backend (also autoloaded by `import torch`)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = TransformerLM(args.vocab, args.d_model, args.layers, args.heads, args.seq_len)
    n_params = sum(p.numel() for p in model.parameters())
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb or None)
    hook_state = powersgd_state = None
    if args.hook == "redsock":
        from redsock.torch import HookState, allreduce_hook

        hook_state = HookState.from_process_group()
        ddp.register_comm_hook(hook_state, allreduce_hook)
    elif args.hook == "powersgd":
        # Its future callbacks start and wait for further all-reduces: a backend must run them
        # where a nested collective can still make progress.
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        powersgd_state = powersgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        ddp.register_comm_hook(powersgd_state, powersgd.powerSGD_hook)
    elif args.hook == "compress":
        from redsock.torch import HookState, compress_hook

        hook_state = HookState.from_process_group()
        ddp.register_comm_hook(hook_state, compress_hook(args.wire, error_feedback=not args.no_error_feedback))
    elif args.hook == "torch-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        ddp.register_comm_hook(None, fp16_compress_hook)
    lr = args.lr if args.lr is not None else (1e-3 if args.optimizer == "adamw" else 0.05)
    opt = (torch.optim.AdamW(ddp.parameters(), lr=lr) if args.optimizer == "adamw"
           else torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9))
    data = SyntheticTokens(args.vocab, args.seq_len, args.batch_size, args.seed, rank)
    if rank == 0:
        print(f"backend={args.backend} hook={args.hook} world={world} params={n_params / 1e6:.2f}M "
              f"grad_bytes={n_params * 4 / 2**20:.1f}MiB bucket_cap_mb={args.bucket_cap_mb} "
              f"batch={args.batch_size}x{args.seq_len}", flush=True)

    t_start = None
    loss_value = math.nan
    for step in range(args.steps):
        if step == args.warmup:
            t_start = time.perf_counter()
        x, y = data.next()
        loss = F.cross_entropy(ddp(x).reshape(-1, args.vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_value = loss.item()
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss_value:.4f}", flush=True)

    measured = args.steps - args.warmup
    if t_start is not None and measured > 0:
        elapsed = time.perf_counter() - t_start
        if rank == 0:
            print(f"RESULT backend={args.backend} hook={args.hook} world={world} steps={measured} "
                  f"time_s={elapsed:.3f} steps_per_s={measured / elapsed:.3f} final_loss={loss_value:.4f} "
                  f"grad_bytes={n_params * 4}",
                  flush=True)

    if args.save_params and ("{rank}" in args.save_params or rank == 0):
        path = args.save_params.replace("{rank}", str(rank))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, path)
    # Every rank leaves together: a rank that exits while a peer still reads from it can
    # reset that peer's connection, which gloo's I/O thread answers with std::terminate.
    dist.barrier()
    if hook_state is not None:
        hook_state.close()
    # DDP holds the process group: let go of it (its reference cycles too) before
    # destroy_process_group drops the last reference, so the backend's threads stop while
    # Python still runs.  Left to the interpreter's exit, a gloo thread letting go of a Python
    # object aborts the process ("terminate called without an active exception").
    del ddp, model, opt, hook_state, powersgd_state
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
