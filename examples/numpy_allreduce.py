"""All-reduce numpy arrays on several local ranks; numpy only, no torch needed.

    python examples/numpy_allreduce.py --nprocs 4                 # 4 ranks on this machine
    torchrun --nproc-per-node 4 examples/numpy_allreduce.py       # the same, ranks started by torchrun
    REDSOCK_SERVERS=127.0.0.1:7700 REDSOCK_ALGO=server python examples/numpy_allreduce.py --nprocs 2

Rank r contributes r + 1 everywhere, so every element of the sum is N(N+1)/2; each rank checks
that, and that its result is bitwise the same as rank 0's.  Exit status 0 when all agree.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile

import numpy as np

import redsock
from redsock.bootstrap import FileStore


def rank_main(rank: int | None, world: int | None, store_dir: str | None, nbytes: int) -> None:
    store = FileStore(store_dir) if store_dir else None  # None: torchrun's TCPStore
    comm = redsock.init(rank=rank, world_size=world, store=store)
    n = comm.world_size
    grad = np.full(nbytes // 4, comm.rank + 1, np.float32)
    comm.all_reduce(grad, op="sum")                         # in place
    expected = n * (n + 1) / 2
    assert (grad == expected).all(), f"rank {comm.rank}: wrong sum"
    first = grad.copy()
    comm.broadcast(first, root=0)                           # rank 0's bits to everyone
    assert first.tobytes() == grad.tobytes(), f"rank {comm.rank}: differs from rank 0"
    if comm.rank == 0:
        print(f"all-reduce of {grad.nbytes >> 20} MiB float32 on {n} ranks: every element {expected:g}, "
              f"bitwise equal on every rank (algo {comm.config.algo})", flush=True)
    comm.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", type=int, default=4, help="ranks to start here (ignored under torchrun)")
    p.add_argument("--bytes", type=int, default=4 << 20, help="array size (default 4 MiB)")
    args = p.parse_args()
    if "RANK" in os.environ:                                # started by torchrun
        rank_main(None, None, None, args.bytes)
        return 0
    with tempfile.TemporaryDirectory() as store_dir:        # the ranks meet through files here
        procs = [mp.get_context("spawn").Process(target=rank_main, args=(r, args.nprocs, store_dir, args.bytes))
                 for r in range(args.nprocs)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=120)
            if proc.is_alive():
                proc.kill()
    failed = [r for r, proc in enumerate(procs) if proc.exitcode != 0]
    if failed:
        print(f"ranks {failed} failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
