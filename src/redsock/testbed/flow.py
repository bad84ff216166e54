"""Bulk TCP sender / receiver used to measure goodput between testbed hosts.

Run inside a namespace with ``ip netns exec NS python -m redsock.testbed.flow ...``:

``recv --bind ADDR [--nflows N] [--deadline S]``
    listens on an ephemeral port, prints ``{"port": P}`` as its first line,
    accepts N connections, counts bytes until every sender closed, then prints
    one JSON line with per-flow byte counts over time and exits.
``send --to ADDR --port P --seconds S [--nflows N] [--sport PORT ...]``
    opens N connections (from the given source ports, if any, so a benchmark
    can pick the htb path class) and sends zeros for S seconds, then closes.

Both sides stop by themselves: every blocking call has a deadline.
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import sys
import threading
import time
from typing import Any

CHUNK = 1 << 20  # 1 MiB per send/recv call keeps Python overhead far below the link time
TICK_S = 0.02    # resolution of the receiver's byte-count timeline


def _recv(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.deadline
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((args.bind, args.port))
    lsock.listen(max(8, args.nflows))
    print(json.dumps({"port": lsock.getsockname()[1]}), flush=True)

    conns: list[socket.socket] = []
    peers: list[int] = []
    while len(conns) < args.nflows:
        lsock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            conn, peer = lsock.accept()
        except socket.timeout:
            print(json.dumps({"error": f"only {len(conns)}/{args.nflows} senders connected"}))
            return 2
        conn.setblocking(False)
        conns.append(conn)
        peers.append(peer[1])
    lsock.close()

    counts = [0] * len(conns)
    first = [0.0] * len(conns)
    last = [0.0] * len(conns)
    open_ = set(range(len(conns)))
    timeline: list[tuple[float, list[int]]] = []
    sel = selectors.DefaultSelector()
    for i, c in enumerate(conns):
        sel.register(c, selectors.EVENT_READ, i)
    buf = bytearray(CHUNK)
    next_tick = time.monotonic()
    while open_ and time.monotonic() < deadline:
        for key, _ in sel.select(TICK_S):
            i = key.data
            try:
                n = key.fileobj.recv_into(buf)  # type: ignore[union-attr]
            except BlockingIOError:
                continue
            now = time.monotonic()
            if n == 0:
                sel.unregister(key.fileobj)
                open_.discard(i)
                continue
            if counts[i] == 0:
                first[i] = now
            counts[i] += n
            last[i] = now
        now = time.monotonic()
        if now >= next_tick:
            timeline.append((now, list(counts)))
            next_tick = now + TICK_S
    timeline.append((time.monotonic(), list(counts)))
    for c in conns:
        c.close()
    out: dict[str, Any] = {"sports": peers, "bytes": counts, "first": first, "last": last,
                           "timeline": timeline, "complete": not open_}
    print(json.dumps(out), flush=True)
    return 0 if not open_ else 3


def _send(args: argparse.Namespace) -> int:
    sports: list[int] = list(args.sport or [])
    nflows = max(args.nflows, len(sports))
    socks: list[socket.socket] = []
    for i in range(nflows):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(args.seconds + 10.0)
        if i < len(sports):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((args.bind, sports[i]))
        s.connect((args.to, args.port))
        socks.append(s)
    used = [s.getsockname()[1] for s in socks]
    payload = memoryview(bytearray(CHUNK))
    stop_at = time.monotonic() + args.seconds
    sent = [0] * nflows
    errors: list[str] = []

    def pump(i: int) -> None:
        s = socks[i]
        try:
            while time.monotonic() < stop_at:
                s.sendall(payload)
                sent[i] += CHUNK
        except OSError as exc:
            errors.append(f"flow {i} (sport {used[i]}): {exc}")
        finally:
            s.close()

    # sendall releases the GIL, so one thread per flow keeps every flow busy.
    threads = [threading.Thread(target=pump, args=(i,), daemon=True) for i in range(nflows)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.seconds + 15.0)
    print(json.dumps({"sports": used, "sent": sent, "errors": errors}), flush=True)
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m redsock.testbed.flow")
    sub = p.add_subparsers(dest="role", required=True)
    r = sub.add_parser("recv")
    r.add_argument("--bind", required=True)
    r.add_argument("--port", type=int, default=0)
    r.add_argument("--nflows", type=int, default=1)
    r.add_argument("--deadline", type=float, default=30.0,
                   help="give up this many seconds after start, whatever happens")
    s = sub.add_parser("send")
    s.add_argument("--to", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--bind", default="0.0.0.0")
    s.add_argument("--seconds", type=float, default=2.0)
    s.add_argument("--nflows", type=int, default=1)
    s.add_argument("--sport", type=int, action="append",
                   help="source port of a flow (repeat for several flows)")
    args = p.parse_args(argv)
    return _recv(args) if args.role == "recv" else _send(args)


if __name__ == "__main__":
    sys.exit(main())
