"""The training script of tests/test_deploy.py: what deploy/'s job runs, shrunk to one check.

Run by torchrun with the job manifest's environment (REDSOCK_SERVERS, REDSOCK_TOKEN_FILE,
REDSOCK_ALGO=server): an all-reduce through the reducer must give the closed-form sum.
"""

import os

import torch
import torch.distributed as dist

dist.init_process_group("redsock")
rank, world = dist.get_rank(), dist.get_world_size()
n = 1 << 18
x = torch.arange(n, dtype=torch.float32) + rank  # integers: the float32 sum is exact
dist.all_reduce(x)
expected = world * torch.arange(n, dtype=torch.float32) + world * (world - 1) / 2
assert torch.equal(x, expected), f"rank {rank}: wrong all-reduce result"
dist.barrier()
print(f"rank {rank}/{world}: all-reduce through {os.environ['REDSOCK_SERVERS']} ok", flush=True)
dist.destroy_process_group()
