"""The ``redsock`` command (also ``python -m redsock``)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .errors import RedsockError

#: (parent command, name, module, help): each module has add_arguments(parser) and run(args).
COMMANDS = [
    ("bench", "transport", "redsock.bench.transport", "throughput and latency between two processes"),
    ("bench", "allreduce", "redsock.bench.allreduce", "nccl-tests-style all-reduce sweep, side by side with gloo"),
    ("bench", "soak", "redsock.bench.soak", "thousands of random checked all-reduces; reducer memory must stay flat"),
    ("bench", "floor", "redsock.bench.floor", "what plain sockets allow here (ring traffic, reducer fan-in), next to gloo"),
    ("bench", "ddp", "redsock.bench.ddp_testbed", "DDP training steps/s on the emulated cluster: gloo, redsock ring, reducers"),
    ("", "reproduce", "redsock.reproduce", "measure the seed's claims on the emulated testbed (root): docs/results.md"),
    ("", "plan", "redsock.plan.command", "predict every all-reduce algorithm's time at any scale; size reducers"),
    ("", "calibrate", "redsock.plan.calibrate", "measure the plan's constants here and write a profile (JSON)"),
    ("testbed", "faults", "redsock.faults",
     "the fault matrix (root): kill, stop, cut or flap a worker or reducer mid-job; every survivor must fail in time, naming it"),
]


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; given ``argv``, only the command it names imports its module
    (a reducer's start-up does not pay for numpy-heavy benchmark modules it never uses)."""
    p = argparse.ArgumentParser(prog="redsock", description=__doc__)
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = p.add_subparsers(dest="command", required=True)
    words = None if argv is None else [a for a in argv if not a.startswith("-")]

    from .testbed.cli import add_parser as add_testbed_parser

    bench = sub.add_parser("bench", help="benchmarks")
    parents = {"": sub, "bench": bench.add_subparsers(dest="bench", required=True),
               "testbed": add_testbed_parser(sub)}
    for parent, name, module_name, help_text in COMMANDS:
        cmd = parents[parent].add_parser(name, help=help_text)
        path = [w for w in (parent, name) if w]
        if words is None or words[:len(path)] == path:
            module = importlib.import_module(module_name)
            module.add_arguments(cmd)
            cmd.set_defaults(func=module.run)

    srv = sub.add_parser("serve", help="run a reduction server (stops on SIGTERM/SIGINT)")
    srv.add_argument("--host", default="0.0.0.0", help="address to listen on (default all)")
    srv.add_argument("--port", type=int, default=7700, help="port (default 7700)")
    srv.add_argument("--token-file", help="shared secret every worker must prove (HMAC handshake)")
    srv.add_argument("--threads", type=int, help="event-loop threads serving the connections (default: the cores)")
    srv.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port, on --host (default or 0: none)")
    srv.add_argument("--max-piece-bytes", default="256M",
                     help="largest piece a worker may send (bounds what one message can make the server hold)")
    srv.set_defaults(func=_serve)
    return p


def _serve(args: argparse.Namespace) -> int:
    from .config import Config, parse_size, read_token_file
    from .server import ReductionServer

    overrides: dict = {"max_message_bytes": parse_size(args.max_piece_bytes)}
    if args.token_file:
        overrides["token"] = read_token_file(args.token_file)
    server = ReductionServer(args.host, args.port, config=Config.from_env(**overrides), threads=args.threads,
                             metrics_port=args.metrics_port)
    server.stop_on_signals()  # before the ready line: a supervisor may signal right after reading it
    print(f"redsock reduction server on {server.address[0]}:{server.address[1]}", flush=True)
    server.serve_forever()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    # The daemon logs joins and leaves at INFO: one line each.
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose + (args.command == "serve"), 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except RedsockError as e:
        print(f"redsock: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
