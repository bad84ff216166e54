"""``redsock bench floor``: what this machine's kernel allows, next to gloo in the same processes.

Plain blocking sockets, no arithmetic beyond a check: a lower bound for any TCP
collective on this machine, measured so that a target can be judged against
what the hardware does rather than against what an implementation does.

* ``ring`` (N local ranks, loopback): every rank streams 2(N-1)/N x S bytes to
  the next rank while it receives as much from the previous one — the traffic
  of a bandwidth-optimal all-reduce of S bytes (no all-reduce moves less per
  rank) — with no reductions and no step waiting for the one before.  gloo's
  all-reduce of S bytes (float32 sum) is timed in the same processes,
  alternating with it, so "floor busbw / gloo busbw" is the most any TCP
  all-reduce can gain over gloo here; redsock's ring all-reduce (checked) is
  timed in the same rotation.
* ``fanin`` (N workers and one reducer process, loopback): the reduction
  server's small-message pattern — every worker sends 8 bytes to the reducer,
  which sums them and sends the sum back to every worker (checked).  The median
  round time for each N shows how per-message CPU grows with N when all the
  processes share this machine's cores; gloo's 8-byte all-reduce among the
  same workers is timed alongside.
* ``memory`` (N local ranks, one host, not part of ``both``): each rank copies its buffer once
  and meets the others at a shared-memory barrier — the least an all-reduce among processes of
  one host can cost, at a few bytes (one synchronisation) and at many (the memory's bandwidth);
  redsock's all-reduce is timed in the same processes (:mod:`.memory`).

The package: :mod:`.loopback` (local processes) and :mod:`.testbed` (``--testbed``: the
reducers' traffic on an emulated cluster), which share the fan-in's plain-socket protocol.
"""

from __future__ import annotations

import argparse
import json

from ...config import parse_size
from ...errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["ring", "fanin", "both", "memory"], default="both",
                   help="ring: bulk traffic (with --testbed: the reducers' bulk traffic); fanin: 8-byte fan-in to "
                        "one reducer (with --testbed: next to redsock's reducers and gloo on the same hosts); "
                        "both (default); memory: --nprocs ranks of one host copy their buffer once and meet at a "
                        "shared-memory barrier, next to redsock's all-reduce (no --testbed)")
    p.add_argument("--nprocs", type=int, default=4, help="ring: local ranks (default 4)")
    p.add_argument("--sizes", help="ring and memory: message sizes (default 1M,64M; memory: 8,4K,256K,1M,16M,64M)")
    p.add_argument("--workers", default="2,4,8", help="fanin: worker counts (default 2,4,8)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations (fanin: x100)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", metavar="FILE", help="write the results as a JSON list")
    g = p.add_argument_group("emulated cluster (root)")
    g.add_argument("--testbed", action="store_true",
                   help="instead: the reduction servers' traffic with plain sockets on shaped links, then gloo on "
                        "the same testbed: bulk (--nprocs worker hosts, --servers reducer hosts) and fan-in (per "
                        "--workers count N, N worker hosts and --servers reducer hosts, default N)")
    g.add_argument("--servers", type=int, help="with --testbed: reducer hosts (default: as many as the worker hosts)")
    g.add_argument("--rate", default="1gbit", help="with --testbed: link rate each way (default 1gbit)")
    g.add_argument("--tcp-cc", metavar="NAME", default="reno", help="with --testbed: TCP congestion control")
    g.add_argument("--prefix", help="with --testbed: namespace prefix (default rsfl<pid>; the fan-in adds n<N> to it)")
    g.add_argument("--timeout", type=float, default=600, help="with --testbed: per run, seconds (default 600)")


def run(args: argparse.Namespace) -> int:
    default_sizes = "8,4K,256K,1M,16M,64M" if args.mode == "memory" else "1M,64M"
    try:
        sizes = [parse_size(s) for s in (args.sizes or default_sizes).split(",") if s.strip()]
        workers = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError as e:
        raise ConfigError(f"bad --sizes or --workers value: {e}") from None
    if args.nprocs < 2 or args.iters < 1 or args.warmup < 0 or any(w < 1 for w in workers) or not sizes:
        raise ConfigError("--nprocs >= 2, --iters >= 1, --warmup >= 0, workers >= 1 and one size at least")
    if args.mode == "memory":
        if args.testbed:
            raise ConfigError("--mode memory measures one host: no --testbed")
        from .memory import print_memory, run_memory

        rows = run_memory(args.nprocs, sizes, args.warmup)
        print_memory(rows, args.nprocs)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 1 if any(r["wrong"] for r in rows) else 0
    if args.testbed:
        from . import testbed

        return testbed.run(args, sizes, workers)
    from .loopback import run_loopback

    return run_loopback(args, sizes, workers)
