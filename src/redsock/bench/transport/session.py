"""The two processes of ``redsock bench transport``: the session protocol, the listening side and the
driver (``--listen``, ``--connect``, ``--local``); the testbed mode drives the same sessions."""


from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ...config import Config, parse_hostport, parse_size
from ...errors import ConfigError, RedsockError
from ...transport import Listener, connect

log = logging.getLogger("redsock.bench")

PLAN_TAG, DATA_TAG, ACK_TAG, PING_TAG, PONG_TAG = 0, 1, 2, 3, 4
PLAN_BYTES = 4096
WINDOW = 8  # messages in flight during a throughput repetition


@dataclass
class TransportRow:
    impl: str  # "redsock" or "plain" (one blocking TCP socket)
    mode: str  # "throughput" or "pingpong"
    bytes: int
    nsocks: int
    balance: str
    iters: int
    median_s: float  # per message (throughput) or per round trip (ping-pong)
    min_s: float
    gbps: float  # payload Gbit/s (throughput); 0 for ping-pong
    extra: dict = field(default_factory=dict)


# -- plain-socket baseline ------------------------------------------------------

def _plain_recv(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError("peer closed")
        got += k


class _PlainConn:
    """The baseline: one blocking TCP socket, sendall/recv_into, TCP_NODELAY."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, buf, tag: int = 0) -> None:
        self.sock.sendall(memoryview(buf).cast("B"))

    def recv(self, buf, tag: int = 0) -> None:
        _plain_recv(self.sock, memoryview(buf).cast("B"))

    def send_many(self, buf, count: int, tag: int = 0) -> None:
        for _ in range(count):
            self.send(buf, tag)

    def recv_many(self, buf, count: int, tag: int = 0) -> None:
        for _ in range(count):
            self.recv(buf, tag)

    def close(self) -> None:
        self.sock.close()


# -- the two sides ----------------------------------------------------------------

def _serve_one(conn) -> None:
    """Listener side of one benchmark session (either impl)."""
    plan_buf = bytearray(PLAN_BYTES)
    conn.recv(plan_buf, PLAN_TAG)
    plan = json.loads(bytes(plan_buf).rstrip(b"\0"))
    buf = np.empty(max([c["bytes"] for c in plan["cases"]] + [1]), np.uint8)
    ack = np.zeros(1, np.uint8)
    for case in plan["cases"]:
        view = buf.data[: case["bytes"]]
        for _ in range(case["reps"]):
            if case["mode"] == "throughput":
                _many(conn, "recv", view, case["iters"], DATA_TAG)
                conn.send(ack, ACK_TAG)
            else:
                for _ in range(case["iters"]):
                    conn.recv(view, PING_TAG)
                    conn.send(view, PONG_TAG)
    conn.close()


def serve(host: str, port: int, config: Config, sessions: int | None = None) -> None:
    """Serve benchmark sessions (redsock on ``port``, plain TCP on ``port + 1``)."""
    plain = socket.create_server((host, port + 1))
    plain.settimeout(0.2)
    with Listener(host, port, config=config) as listener:
        print(f"listening on {host}:{port} (redsock) and {host}:{port + 1} (plain)", flush=True)
        served = 0
        while sessions is None or served < sessions:
            conn: Any  # a redsock Connection or the plain baseline's _PlainConn: the same calls
            try:
                conn = listener.accept(timeout=0.2)
            except Exception:
                try:
                    s, _ = plain.accept()
                except socket.timeout:
                    continue
                s.settimeout(None)
                conn = _PlainConn(s)
            try:
                _serve_one(conn)
            except RedsockError as e:  # one broken session must not end the listener
                log.warning("benchmark session failed: %s", e)
                conn.close()
            served += 1
    plain.close()


def drive(conn, cases: list[dict]) -> list[dict]:
    """Driver side: run every case; returns per-case timings (seconds)."""
    plan = json.dumps({"cases": cases}).encode()
    if len(plan) > PLAN_BYTES:
        raise ConfigError("too many benchmark cases for one plan")
    conn.send(plan.ljust(PLAN_BYTES, b"\0"), PLAN_TAG)
    buf = np.random.default_rng(0).integers(0, 255, max([c["bytes"] for c in cases] + [1]), dtype=np.uint8)
    ack = np.zeros(1, np.uint8)
    results = []
    for case in cases:
        view = buf.data[: case["bytes"]]
        times = []
        for _ in range(case["reps"]):
            if case["mode"] == "throughput":
                t0 = time.perf_counter()
                _many(conn, "send", view, case["iters"], DATA_TAG)
                conn.recv(ack, ACK_TAG)
                times.append((time.perf_counter() - t0) / case["iters"])
            else:
                for _ in range(case["iters"]):
                    t0 = time.perf_counter()
                    conn.send(view, PING_TAG)
                    conn.recv(view, PONG_TAG)
                    times.append(time.perf_counter() - t0)
        results.append({**case, "times": times})
    return results


def _many(conn, op: str, view, count: int, tag: int) -> None:
    """``count`` messages with up to WINDOW outstanding (osu_bw style); the plain
    socket baseline can only go one at a time."""
    if isinstance(conn, _PlainConn):
        getattr(conn, op + "_many")(view, count, tag)
        return
    start = conn.isend if op == "send" else conn.irecv
    window: list = []
    for _ in range(count):
        if len(window) >= WINDOW:
            window.pop(0).wait()
        window.append(start(view, tag))
    for h in window:
        h.wait()


def _cases(sizes: list[int], iters: int, reps: int, pingpong_max: int, pp_iters: int) -> list[dict]:
    cases = []
    for n in sizes:
        if n <= pingpong_max:
            cases.append({"mode": "pingpong", "bytes": n, "iters": pp_iters, "reps": 1})
        # Enough messages per rep that a rep moves >= 64 MiB (or `iters`, if larger).
        it = max(iters, (64 << 20) // max(n, 1)) if n < (64 << 20) else iters
        cases.append({"mode": "throughput", "bytes": n, "iters": min(it, 20000), "reps": reps})
    return cases


def open_session(addr: tuple[str, int], impl: str, config: Config, name: str) -> tuple[Any, list[int]]:
    """A benchmark connection of either kind, and the source ports of its data streams."""
    if impl == "redsock":
        conn = connect(addr, config=config, name=name, retry_s=10)
        return conn, [s.getsockname()[1] for s in conn._data]
    if impl == "plain":
        s = socket.create_connection((addr[0], addr[1] + 1), timeout=config.timeout_s)
        s.settimeout(None)
        return _PlainConn(s), [s.getsockname()[1]]
    raise ConfigError(f"unknown impl {impl!r} (redsock, plain)")


def run_driver(addr: tuple[str, int], impls: list[str], config: Config, sizes: list[int], iters: int,
               reps: int, pingpong_max: int, pp_iters: int, warmup: bool = True) -> list[TransportRow]:
    rows: list[TransportRow] = []
    cases = _cases(sizes, iters, reps, pingpong_max, pp_iters)
    for impl in impls:
        conn, ports = open_session(addr, impl, config, "bench")
        try:
            results = drive(conn, ([{"mode": "throughput", "bytes": 1 << 20, "iters": 32, "reps": 1}]
                                   if warmup else []) + cases)
        finally:
            conn.close()
        for r in results[1 if warmup else 0:]:
            med = statistics.median(r["times"])
            extra = {"src_ports": ports}
            if impl == "redsock":
                extra["slices_per_stream"] = list(conn.slices_sent)
            rows.append(TransportRow(
                impl=impl, mode=r["mode"], bytes=r["bytes"],
                nsocks=len(ports) if impl == "redsock" else 1,
                balance=config.balance if impl == "redsock" else "-", iters=r["iters"],
                median_s=med, min_s=min(r["times"]),
                gbps=(r["bytes"] * 8 / med / 1e9) if r["mode"] == "throughput" and med > 0 else 0.0,
                extra=extra))
    return rows


def format_rows(rows: list[TransportRow]) -> str:
    head = f"{'impl':>8} {'streams':>7} {'balance':>8} {'mode':>10} {'size':>10} {'median':>12} {'Gbit/s':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        med = f"{r.median_s * 1e6:.1f} us" if r.mode == "pingpong" else f"{r.median_s * 1e3:.2f} ms"
        gbps = f"{r.gbps:8.2f}" if r.mode == "throughput" else f"{'-':>8}"
        lines.append(f"{r.impl:>8} {r.nsocks:>7} {r.balance:>8} {r.mode:>10} {_human(r.bytes):>10} {med:>12} {gbps}")
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def write_json(rows: list[TransportRow], path: str) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(asdict(r)) + "\n")


def run_pair(args: argparse.Namespace) -> int:
    """``--listen``, ``--connect`` or ``--local``: the two processes of the benchmark."""
    # An explicit --nsocks holds for a peer on this host too (Config.local_nsocks).
    config = Config.from_env(nsocks=args.nsocks, local_nsocks=args.nsocks, balance=args.balance,
                             chunk_bytes=parse_size(args.chunk) if args.chunk else None)
    if args.listen:
        host, port = parse_hostport(args.listen)
        serve(host, port, config, args.sessions)
        return 0
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    impls = [s.strip() for s in args.impl.split(",") if s.strip()]
    child = None
    if args.local:
        port = _free_port_pair()
        addr = ("127.0.0.1", port)
        child = subprocess.Popen([sys.executable, "-m", "redsock", "bench", "transport",
                                  "--listen", f"127.0.0.1:{port}", "--sessions", str(len(impls))],
                                 stdout=subprocess.DEVNULL, env={**os.environ, **_config_env(config)})
    else:
        addr = parse_hostport(args.connect)
    try:
        rows = run_driver(addr, impls, config, sizes, args.iters, args.reps,
                          parse_size(args.pingpong_max), args.pingpong_iters)
    finally:
        if child is not None:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.send_signal(signal.SIGTERM)
                child.wait(timeout=10)
    print(format_rows(rows))
    _print_ratios(rows)
    if args.json:
        write_json(rows, args.json)
    return 0


def _print_ratios(rows: list[TransportRow]) -> None:
    base = {(r.mode, r.bytes): r for r in rows if r.impl == "plain"}
    for r in rows:
        b = base.get((r.mode, r.bytes))
        if r.impl == "redsock" and b is not None:
            if r.mode == "throughput":
                print(f"{_human(r.bytes):>10} throughput redsock/plain = {r.gbps / b.gbps:.2f}x")
            else:
                print(f"{_human(r.bytes):>10} round trip redsock/plain = {r.median_s / b.median_s:.2f}x")


def _config_env(config: Config) -> dict[str, str]:
    return {"REDSOCK_NSOCKS": str(config.nsocks), "REDSOCK_LOCAL_NSOCKS": str(config.local_nsocks),
            "REDSOCK_BALANCE": config.balance,
            "REDSOCK_CHUNK_BYTES": str(config.chunk_bytes)}


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            try:
                with socket.socket() as s2:
                    s2.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise ConfigError("no free pair of ports on 127.0.0.1")
