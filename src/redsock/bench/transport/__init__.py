"""``redsock bench transport``: one-way throughput and ping-pong latency between two processes.

One side listens (``--listen HOST:PORT``), the other connects and drives
(``--connect HOST:PORT``); ``--local`` starts the listening side as a child
process on loopback.  The listener serves a redsock Listener on PORT and a
plain one-socket TCP baseline on PORT+1, so both are measured in the same run.

Protocol (driver -> listener): a JSON plan inline on tag 0, then per case
``iters`` messages on tag 1 answered by a 1-byte ack on tag 2 (throughput),
or ``iters`` round trips on tags 3/4 (ping-pong).

The package: :mod:`.session` (the protocol and both sides) and :mod:`.testbed`
(``--testbed perflow``: the same sessions across an emulated per-flow path imbalance).
"""

from __future__ import annotations

import argparse

from .testbed import add_arguments as add_testbed_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    side = p.add_mutually_exclusive_group(required=True)
    side.add_argument("--listen", metavar="HOST:PORT", help="serve benchmark sessions (redsock on PORT, plain on PORT+1)")
    side.add_argument("--connect", metavar="HOST:PORT", help="drive the benchmark against a --listen side")
    side.add_argument("--local", action="store_true", help="start a listener child process on loopback and drive it")
    side.add_argument("--testbed", metavar="PROFILE",
                      help="build an emulated network (perflow: per-flow path classes) and compare "
                           "dynamic, static and plain across it (needs root)")
    p.add_argument("--sizes", default="8,64K,1M,16M,256M", help="comma-separated message sizes (e.g. 8,1M,256M)")
    p.add_argument("--nsocks", type=int, help="data streams (REDSOCK_NSOCKS)")
    p.add_argument("--balance", choices=["dynamic", "static"], help="slice placement (REDSOCK_BALANCE)")
    p.add_argument("--chunk", help="slice size (REDSOCK_CHUNK_BYTES)")
    p.add_argument("--impl", default="redsock,plain", help="what to measure: redsock, plain (one blocking socket)")
    p.add_argument("--iters", type=int, default=4, help="messages per throughput repetition (at least)")
    p.add_argument("--reps", type=int, default=5, help="throughput repetitions (median reported)")
    p.add_argument("--pingpong-max", default="64K", help="ping-pong for sizes up to this")
    p.add_argument("--pingpong-iters", type=int, default=2000)
    p.add_argument("--sessions", type=int, help="with --listen: exit after this many sessions")
    p.add_argument("--json", metavar="FILE", help="write one JSON object per row")
    add_testbed_arguments(p)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "testbed", None):
        from . import testbed

        return testbed.run(args)
    from .session import run_pair

    return run_pair(args)
