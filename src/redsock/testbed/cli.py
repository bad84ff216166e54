"""``redsock testbed ...``: build, inspect, use and remove an emulated cluster.

Wire it into the main command with ``add_parser(subparsers)``; every
subcommand sets ``func(args) -> int`` (the exit code).  State lives in the
system (namespaces ``<prefix>-*``) plus ``/run/redsock/<prefix>.json``, so
``status`` / ``exec`` / ``measure`` / ``down`` work from a later process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from ..errors import RedsockError
from .cluster import DEFAULT_PREFIX, PROFILES, Testbed, cleanup_prefix, list_prefix_netns, load
from .measure import measure_flows
from .netns import format_rate, parse_rate, require_root

__all__ = ["add_parser", "main"]


def add_parser(subparsers: Any) -> Any:
    """Register ``testbed`` and its subcommands on an argparse ``subparsers`` object; returns
    the testbed's own subparsers, where the main command adds the ones built on upper layers
    (``faults``)."""
    p = subparsers.add_parser(
        "testbed", help="emulated cluster in network namespaces with shaped links",
        description="Emulated cluster: one network namespace per host, veths to a bridge, "
                    "tc shaping on both directions of every link. Needs root.")

    def usage(args: argparse.Namespace) -> int:  # `redsock testbed` with no subcommand
        p.print_help()
        return 2

    p.set_defaults(func=usage)
    sub = p.add_subparsers(dest="testbed_cmd", metavar="{up,pair,down,status,exec,measure,faults}")

    def prefix_arg(sp: argparse.ArgumentParser, default: str = DEFAULT_PREFIX) -> None:
        sp.add_argument("--prefix", default=default,
                        help=f"namespace name prefix (default {default})")

    up = sub.add_parser("up", help="build (or rebuild) a star cluster of workers and reducers")
    up.add_argument("--workers", "-n", type=int, default=4, help="worker hosts w0.. (default 4)")
    up.add_argument("--servers", "-m", type=int, default=0, help="reducer hosts s0.. (default 0)")
    up.add_argument("--rate", type=_rate, default=parse_rate("1gbit"),
                    help="link rate, e.g. 2gbit, 800mbit, 1G (default 1gbit)")
    up.add_argument("--profile", choices=PROFILES, default="uniform",
                    help="uniform | perflow (4 port-hashed path classes) | "
                         "slow-server (s0 at rate/2)")
    prefix_arg(up)
    up.set_defaults(func=_cmd_up)

    pair = sub.add_parser("pair", help="two hosts a->b on one veth, per-port path classes on a")
    pair.add_argument("--rates", default="800mbit,600mbit,400mbit,200mbit",
                      help="comma-separated class rates (power-of-two count)")
    pair.add_argument("--shift", type=int, default=1, help="source-port bit where the class "
                                                           "index starts (default 1)")
    pair.add_argument("--total", type=_rate, default=None, help="cap on the sum of the classes")
    prefix_arg(pair, "rstp")
    pair.set_defaults(func=_cmd_pair)

    down = sub.add_parser("down",
                          help="remove every namespace of the prefix, killing its processes")
    prefix_arg(down)
    down.set_defaults(func=_cmd_down)

    st = sub.add_parser("status", help="show hosts, addresses, shaping and processes")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    prefix_arg(st)
    st.set_defaults(func=_cmd_status)

    ex = sub.add_parser("exec", help="run a command inside a host's namespace",
                        usage="%(prog)s [--prefix P] HOST -- CMD [ARG...]")
    prefix_arg(ex)
    ex.add_argument("host", help="w0, s1, a, b, ...")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="command and arguments")
    ex.set_defaults(func=_cmd_exec)

    me = sub.add_parser("measure", help="TCP goodput between two hosts")
    me.add_argument("src")
    me.add_argument("dst")
    me.add_argument("--seconds", type=float, default=2.0)
    me.add_argument("--nflows", type=int, default=1)
    me.add_argument("--sport", type=int, action="append", help="bind a flow to this source port")
    prefix_arg(me)
    me.set_defaults(func=_cmd_measure)
    return sub


def _rate(text: str) -> int:
    try:
        return parse_rate(text)
    except RedsockError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _guard(fn: Any) -> Any:
    """Turn redsock errors into a one-line message and exit code 1 instead of a traceback."""
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return int(fn(args))
        except RedsockError as exc:
            print(f"redsock testbed: {exc}", file=sys.stderr)
            return 1
    wrapped.__name__ = fn.__name__
    return wrapped


@_guard
def _cmd_up(args: argparse.Namespace) -> int:
    require_root("redsock testbed up")
    tb = Testbed(args.workers, args.servers, args.rate, args.profile, args.prefix)
    tb.up()
    print(tb.status())
    return 0


@_guard
def _cmd_pair(args: argparse.Namespace) -> int:
    require_root("redsock testbed pair")
    rates = [parse_rate(r) for r in args.rates.split(",") if r.strip()]
    tb = Testbed.pair(rates, args.prefix, shift=args.shift, total=args.total)
    tb.up()
    print(tb.status())
    return 0


@_guard
def _cmd_down(args: argparse.Namespace) -> int:
    removed = cleanup_prefix(args.prefix)
    print(f"removed {len(removed)} namespace(s)" + (": " + " ".join(removed) if removed else ""))
    return 0


@_guard
def _cmd_status(args: argparse.Namespace) -> int:
    require_root("redsock testbed status")
    try:
        tb = load(args.prefix)
    except RedsockError as exc:
        # No state file: still report what the system holds under this prefix.
        leftovers = list_prefix_netns(args.prefix)
        if args.json:
            print(json.dumps({"prefix": args.prefix, "up": False, "error": str(exc),
                              "namespaces": leftovers}))
        else:
            print(exc)
            if leftovers:
                print("namespaces with this prefix: " + " ".join(leftovers)
                      + f"  (remove with `redsock testbed down --prefix {args.prefix}`)")
        return 1
    st = tb.status()
    print(json.dumps(st.to_dict(), indent=1) if args.json else st)
    return 0 if st.up else 1


@_guard
def _cmd_exec(args: argparse.Namespace) -> int:
    require_root("redsock testbed exec")
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("redsock testbed exec: no command given (usage: exec HOST -- CMD ...)",
              file=sys.stderr)
        return 2
    tb = load(args.prefix)
    try:
        return subprocess.call(tb.netns_argv(args.host, cmd))
    except KeyboardInterrupt:
        return 130


@_guard
def _cmd_measure(args: argparse.Namespace) -> int:
    require_root("redsock testbed measure")
    tb = load(args.prefix)
    res = measure_flows(tb, args.src, args.dst, args.seconds, nflows=args.nflows,
                        sports=args.sport)
    print(f"{args.src} -> {args.dst}: {format_rate(res.total_bps)} goodput "
          f"over {res.window_s:.2f}s")
    for f in res.flows:
        cap = tb.flow_capacity(args.src, args.dst, f.sport)
        capstr = f" (class ceiling {format_rate(cap)})" if cap else ""
        print(f"  sport {f.sport}: {format_rate(f.bps)}{capstr}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m redsock.testbed.cli testbed up ...``."""
    parser = argparse.ArgumentParser(prog="redsock")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
