"""``redsock bench allreduce``: an nccl-tests-style sweep, redsock against gloo in the same run.

Run once per rank with the torchrun environment, under ``torchrun``, or with
``--nprocs N`` to start N local ranks.  Every algorithm named in ``--algo`` is
measured on the same ranks, one size at a time, so ratios compare like with
like on a noisy machine.  Rank 0 prints the tables; ``--check`` validates every
result against a float64 numpy reference and across ranks (bitwise).

The package: :mod:`.options` (one parser for every mode), :mod:`.rank` (the runner
every rank runs, whichever launcher started it), :mod:`.inputs` (inputs and float64
references), and two launchers, :mod:`.local` (``--nprocs``) and :mod:`.testbed`
(``--testbed``: one rank per namespace of an emulated cluster).
"""

from __future__ import annotations

import argparse
import os
import sys

from ...errors import ConfigError, RedsockError
from .inputs import count_wrong, make_input, reference, reference_of, timing_input
from .options import add_arguments

__all__ = ["add_arguments", "count_wrong", "make_input", "reference", "reference_of", "run", "timing_input"]


def run(args: argparse.Namespace) -> int:
    if getattr(args, "testbed", False):
        from . import testbed

        return testbed.run(args)  # one rank per namespace of an emulated cluster
    from .rank import run_rank, sweep

    if args.nprocs is not None:
        from .local import launch_local, strip_options

        if args.nprocs < 1:
            raise ConfigError("--nprocs must be >= 1")
        algos = sweep(args)[2]
        if "mpi" in algos and not getattr(args, "peer", None):
            raise ConfigError("--algo mpi needs processes that mpirun starts: pass --peer mpi (and --algo without mpi)")
        argv = [a for a in sys.argv[1:]]
        # Re-run this same command in each rank, minus the launcher's own options.
        child = strip_options(argv, {"--nprocs": 1, "--timeout": 1, "--peer": 1})
        if getattr(args, "peer", None):
            return _with_peer(args, child)
        return launch_local(args.nprocs, child, args.timeout)
    if getattr(args, "peer", None):
        raise ConfigError("--peer needs --nprocs (the peer runs on this host with as many ranks)")
    from .mpi_peer import adopt_mpi_ranks

    adopt_mpi_ranks()  # (ranks that mpirun started: --peer mpi)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError("set RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun does), or pass --nprocs N")
    try:
        return run_rank(args)
    except RedsockError as e:
        who = f"rank {os.environ.get('RANK')}: "
        text = str(e)  # a failed collective's message names its rank already
        print(f"redsock: {text if text.startswith(who) else who + text}", file=sys.stderr)
        return 2


def _with_peer(args: argparse.Namespace, child: list[str]) -> int:
    """The sweep with Open MPI's all-reduce beside redsock's ("mpi" added to ``--algo``), in
    ranks that ``mpirun`` starts (:mod:`.mpi_peer`)."""
    from . import mpi_peer
    from .local import strip_options
    from .rank import sweep

    if "mpi" not in (a.strip() for a in args.algo.split(",")):
        args.algo = f"{args.algo},mpi"
    sweep(args)  # (refused here, once, rather than in every rank)
    return mpi_peer.launch(args.nprocs, [*strip_options(child, {"--algo": 1}), "--algo", args.algo], args.timeout)
