"""One rank of a fault-matrix cell (:mod:`redsock.faults`): repeated checked all-reduces.

``python -m redsock.faults.job --steps N --count C --algo A --pause S`` under the torchrun
variables.  Step ``i`` all-reduces ``C`` float32 values ``(rank + 1) * (1 + i % 5)`` and checks
every element against the closed form ``W(W+1)/2 * (1 + i % 5)`` (exact in float32).  It prints
one JSON line per event on stdout, with the wall-clock time ``t`` (every rank runs on this
machine, so the launcher compares it with the time it injected the fault):

``{"ev": "ready"}`` after the first step, ``{"ev": "step", "i": ...}`` every 10 steps, then one of
``{"ev": "done", "steps": N}`` (exit 0), ``{"ev": "failure", "kind": "PeerFailure", "ranks": [...],
"message": ...}`` (exit 3), ``{"ev": "wrong", "i": ..., "wrong": ...}`` (exit 4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

#: Exit codes the launcher reads.
EXIT_DONE, EXIT_FAILURE, EXIT_WRONG = 0, 3, 4


def emit(ev: str, **fields: object) -> None:
    print(json.dumps({"ev": ev, "t": time.time(), **fields}), flush=True)


def expected(world: int, step: int) -> float:
    return world * (world + 1) / 2 * (1 + step % 5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m redsock.faults.job")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--count", type=int, required=True, help="float32 elements per all-reduce")
    p.add_argument("--algo", required=True, help="all-reduce algorithm (ring, small, server, hier)")
    p.add_argument("--pause", type=float, default=0.05, help="seconds between steps")
    args = p.parse_args(argv)

    import redsock
    from redsock.errors import PeerFailure, RedsockError

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    comm = None
    try:
        comm = redsock.init()
        x = np.empty(args.count, np.float32)
        for i in range(args.steps):
            x[:] = (rank + 1) * (1 + i % 5)
            comm.all_reduce(x, "sum", algorithm=args.algo)
            wrong = int(np.count_nonzero(x != expected(world, i)))
            if wrong:
                emit("wrong", i=i, wrong=wrong)
                return EXIT_WRONG
            if i == 0:
                emit("ready")
            elif i % 10 == 0:
                emit("step", i=i)
            time.sleep(args.pause)
        emit("done", steps=args.steps)
        return EXIT_DONE
    except PeerFailure as e:
        emit("failure", kind="PeerFailure", ranks=list(e.ranks), message=str(e))
        return EXIT_FAILURE
    except RedsockError as e:  # a failure the matrix counts as wrong: not a PeerFailure
        emit("failure", kind=type(e).__name__, ranks=[], message=str(e))
        return EXIT_FAILURE
    finally:
        if comm is not None:
            comm.close()


if __name__ == "__main__":
    sys.exit(main())
