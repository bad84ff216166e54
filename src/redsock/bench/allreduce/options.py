"""The options of ``redsock bench allreduce``, and the argv a launcher hands its ranks.

One parser for both modes: the ranks of ``--nprocs`` and of ``--testbed`` run this same
command minus the launcher's own options (:func:`child_argv`).
"""

from __future__ import annotations

import argparse

from ...errors import ConfigError
from ...testbed.cluster import PROFILES
from .rank import B2B_ROUNDS

#: Options that belong to the launchers (``--testbed``'s and ``--nprocs``), not to the ranks.
_LAUNCHER_DESTS = {"nprocs", "timeout", "json", "plot", "no_progress", "peer"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-b", "--minbytes", default="8", help="smallest size (default 8)")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest size (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier between rows")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("-w", "--warmup", type=int, default=5, help="warm-up iterations per size")
    p.add_argument("-d", "--dtype", default="float32", help="float32, float16, bfloat16, float64, int8, uint8, int32, int64")
    p.add_argument("-o", "--op", default="sum", help="sum, avg, min, max, prod")
    p.add_argument("--back-to-back", action="store_true",
                   help="time per call = the slowest rank's total over -n back-to-back calls (median of "
                        "--rounds rounds), not the median of per-call maxima")
    p.add_argument("--rounds", type=int, default=B2B_ROUNDS,
                   help=f"with --back-to-back: rounds per size, every implementation's in turn (default {B2B_ROUNDS})")
    p.add_argument("--sizes-in-turn", action="store_true",
                   help="with --back-to-back: each round times every size in turn (round 1 of all sizes, then "
                        "round 2...), so a slow minute of the machine spreads over every size instead of landing "
                        "on one: the size-to-size ratios compare the same minutes (holds every size's buffers at once)")
    p.add_argument("--algo", default="auto,gloo", help="comma-separated: auto, ring, small, server, hier, gloo")
    p.add_argument("-c", "--check", action="store_true",
                   help="validate results (the #wrong column; on a 16-bit wire against its error bound, with "
                        "the largest relative error beside)")
    p.add_argument("--wire-dtype", choices=["off", "bf16", "fp16"],
                   help="redsock's float32 sum/avg on a 16-bit wire (rounded once per rank, summed in float32); "
                        "default: REDSOCK_WIRE_DTYPE")
    p.add_argument("--json", metavar="FILE", help="write one JSON object per row")
    p.add_argument("--plot", metavar="FILE.png", help="plot bus bandwidth and latency against size")
    p.add_argument("--nprocs", type=int, help="start this many local ranks (else: RANK/WORLD_SIZE from the environment)")
    p.add_argument("--timeout", type=float, default=1800, help="with --nprocs: stop everything after this many seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--peer", choices=("mpi",),
                   help="with --nprocs and --back-to-back (float32 sum, one redsock --algo): time Open MPI's "
                        "shared-memory all-reduce (mpirun --mca btl vader,self, mpi4py) on the same sizes after "
                        "redsock's, and print both side by side")
    add_testbed_arguments(p)  # --testbed --workers --servers --rate --profile --prefix


def add_testbed_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("emulated cluster (--testbed; needs root)")
    g.add_argument("--testbed", action="store_true",
                   help="run every rank in its own network namespace with shaped links, "
                        "and one reduction server per reducer host (--timeout bounds the whole run)")
    g.add_argument("--workers", type=int, default=4,
                   help="with --testbed: worker hosts (default 4); ranks = workers x --ranks-per-host")
    g.add_argument("--ranks-per-host", type=int, default=1, metavar="L",
                   help="with --testbed: ranks on every worker host, consecutive as torchrun numbers them "
                        "(default 1)")
    g.add_argument("--servers", type=int, help="with --testbed: reducer hosts (default: as many as workers)")
    g.add_argument("--rate", default="2gbit", help="with --testbed: link rate each way, e.g. 2gbit, 800mbit")
    g.add_argument("--profile", default="uniform", choices=PROFILES,
                   help="with --testbed: uniform | perflow | slow-server (reducer s0 at rate/2)")
    g.add_argument("--prefix", help="with --testbed: namespace prefix (default rsar<pid>)")
    g.add_argument("--tcp-cc", metavar="NAME", default="reno",
                   help="with --testbed: TCP congestion control in every host namespace (default reno: "
                        "loss-based like Linux's usual cubic, which this kernel may not offer; BBR through "
                        "tbf links with no propagation delay drops heavily with many flows)")



def _testbed_dests() -> set[str]:
    p = argparse.ArgumentParser(add_help=False)
    add_testbed_arguments(p)
    return {a.dest for a in p._actions}


def child_argv(args: argparse.Namespace, json_path: str | None) -> list[str]:
    """The ``redsock bench allreduce ...`` argv each rank runs: every bench option that
    differs from its default, none of the launcher's, ``--json json_path``, no progress bar.

    Built from the parser itself (:func:`add_arguments`), so options added there
    later travel too, and abbreviations on the command line cannot slip through.
    """
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    skip = _testbed_dests() | _LAUNCHER_DESTS
    out = ["bench", "allreduce"]
    for action in parser._actions:
        if action.dest in skip or not action.option_strings or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        opt = max(action.option_strings, key=len)  # the long form
        if isinstance(action, argparse._StoreTrueAction):
            out.append(opt)
        elif isinstance(action, argparse._StoreFalseAction):
            out.append(opt)
        elif isinstance(action, argparse._StoreAction) and value is not None:
            out += [opt, str(value)]
        elif value is not None:
            raise ConfigError(f"--testbed cannot forward option {opt} ({type(action).__name__})")
    out.append("--no-progress")
    if json_path:
        out += ["--json", json_path]
    return out
