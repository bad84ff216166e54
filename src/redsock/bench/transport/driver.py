"""The driver side of ``bench transport --testbed``: runs in namespace ``a`` as its own command,
``python -m redsock.bench.transport.driver drive --connect HOST:PORT ...``, lands the data
streams on the wanted path classes and prints one JSON row per case with per-stream statistics.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time
from dataclasses import asdict
from typing import Any, Sequence

import numpy as np

from ...config import Config, parse_hostport, parse_size
from ...errors import ConfigError, RedsockError
from ...testbed.netns import path_class
from ..procs import box_cpu, cpu_shares
from .session import (
    ACK_TAG,
    DATA_TAG,
    PLAN_BYTES,
    PLAN_TAG,
    TransportRow,
    _cases,
    _many,
    _PlainConn,
    open_session,
)

SAMPLE_S = 0.01  # per-stream byte-counter sampling period of the driver
WARMUP = {"mode": "throughput", "bytes": 1 << 20, "iters": 32, "reps": 1}
#: A last 1-byte case whose ack is allowed to get lost.  The listener sends its final
#: ack and closes at once; the driver's data-stream threads can see that close before
#: the ack is read off the control stream and fail the pending receive (a race in the
#: transport: see the module docstring).  With this case last, every measured ack
#: arrives while the listener still waits for more.
SENTINEL = {"mode": "throughput", "bytes": 1, "iters": 1, "reps": 1, "sentinel": True}


def want_spread(nstreams: int, nclasses: int) -> list[int]:
    """The 'spread' landing: stream i on class i mod nclasses (as a sorted multiset)."""
    return sorted(i % nclasses for i in range(nstreams))


def _empty_session(conn: Any) -> None:
    """Run a session with no cases and wait for the listener to end it.

    Waiting matters: closing first could let the listener see the data streams
    end before it has read the plan, and its serve loop has no per-session
    error handling.
    """
    plan = json.dumps({"cases": []}).encode().ljust(PLAN_BYTES, b"\0")
    if isinstance(conn, _PlainConn):
        conn.send(plan)
        conn.sock.settimeout(10)
        try:
            conn.sock.recv(1)  # b"" once the listener closed its side
        except OSError:
            pass
        return
    conn.send(np.frombuffer(plan, np.uint8), PLAN_TAG)
    # The data streams' receiver threads see the listener's close and mark the
    # connection failed (quietly: no operation is pending).
    deadline = time.monotonic() + 10
    while conn.error is None and time.monotonic() < deadline:
        time.sleep(0.002)


def connect_landed(addr: tuple[str, int], impl: str, config: Config, want: list[int] | None,
                   nclasses: int, shift: int, max_attempts: int) -> tuple[Any, list[int], int]:
    """Connect until the data streams' source ports land on the class multiset ``want``.

    Returns ``(conn, source ports, attempts)``.  ``want=None`` takes the first
    connection.  Raises :class:`ConfigError` after ``max_attempts`` misses.
    """
    for attempt in range(1, max_attempts + 1):
        conn, ports = open_session(addr, impl, config, "bench-testbed")
        got = sorted(path_class(p, nclasses, shift) for p in ports)
        if want is None or got == sorted(want):
            return conn, ports, attempt
        try:
            _empty_session(conn)
        finally:
            conn.close()
    raise ConfigError(f"no {impl} connection landed on classes {sorted(want or [])} in "
                      f"{max_attempts} attempts (raise --max-attempts or use --land random)")


class _Sampler:
    """Samples the connection's per-stream byte counters every SAMPLE_S in a thread."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="bench-sampler")

    def _counters(self) -> list[int]:
        return list(getattr(self.conn, "bytes_sent", [0]))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), self._counters()))
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> "_Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.perf_counter(), self._counters()))

    def last_change(self, stream: int) -> float:
        """Time of the first sample at which ``stream`` had reached its final count."""
        final = self.samples[-1][1][stream]
        for t, c in self.samples:
            if c[stream] >= final:
                return t
        return self.samples[-1][0]


def drive_with_stats(conn: Any, cases: list[dict]) -> list[dict]:
    """The protocol of :func:`.session.drive`, plus per-rep per-stream statistics."""
    plan = json.dumps({"cases": cases}).encode()
    if len(plan) > PLAN_BYTES:
        raise ConfigError("too many benchmark cases for one plan")
    conn.send(np.frombuffer(plan.ljust(PLAN_BYTES, b"\0"), np.uint8), PLAN_TAG)
    buf = np.random.default_rng(0).integers(0, 255, max([c["bytes"] for c in cases] + [1]), dtype=np.uint8)
    ack = np.zeros(1, np.uint8)
    results = []
    for case in cases:
        if case.get("sentinel"):
            # Quiet from here to close (run_drive restores): the lost ack is expected.
            logging.getLogger("redsock.transport").setLevel(logging.ERROR)
            try:
                conn.send(buf[:1], DATA_TAG)
                conn.recv(ack, ACK_TAG)
            except RedsockError:
                pass  # the close race described at SENTINEL: nothing measured is lost
            continue
        if case["mode"] != "throughput":
            raise ConfigError("the testbed benchmark measures throughput only")
        view = memoryview(buf)[: case["bytes"]]
        reps = []
        for _ in range(case["reps"]):
            b0 = list(getattr(conn, "bytes_sent", [0]))
            s0 = list(getattr(conn, "slices_sent", [0]))
            cpu0, own0 = box_cpu(), os.times()
            with _Sampler(conn) as sampler:
                t0 = time.perf_counter()
                _many(conn, "send", view, case["iters"], DATA_TAG)
                conn.recv(ack, ACK_TAG)
                t1 = time.perf_counter()
            (busy, steal), own1 = cpu_shares(cpu0, box_cpu()), os.times()
            if isinstance(conn, _PlainConn):
                sent, slices, tails = [case["bytes"] * case["iters"]], [0], [0.0]
            else:
                sent = [b - a for a, b in zip(b0, conn.bytes_sent)]
                slices = [b - a for a, b in zip(s0, conn.slices_sent)]
                tails = [max(0.0, t1 - sampler.last_change(i)) for i in range(len(sent))]
            reps.append({
                "seconds": t1 - t0, "bytes_per_stream": sent, "slices_per_stream": slices,
                "tail_s": tails,
                "machine_cpu": busy, "machine_steal": steal,
                "driver_cpu_s": (own1.user + own1.system) - (own0.user + own0.system),
            })
        results.append({**case, "reps_detail": reps,
                        "times": [r["seconds"] / case["iters"] for r in reps]})
    return results


def run_drive(addr: tuple[str, int], impl: str, config: Config, sizes: list[int], iters: int,
              reps: int, want: list[int] | None, nclasses: int, shift: int,
              max_attempts: int) -> list[TransportRow]:
    """One configuration: land the streams, warm up, measure every size; rows out."""
    conn, ports, attempts = connect_landed(addr, impl, config, want, nclasses, shift, max_attempts)
    cases = [c for c in _cases(sizes, iters, reps, 0, 1) if c["mode"] == "throughput"]
    tlog = logging.getLogger("redsock.transport")
    level = tlog.level
    try:
        results = drive_with_stats(conn, [WARMUP] + cases + [SENTINEL])[1:]
    finally:
        conn.close()
        tlog.setLevel(level)
    rows = []
    for r in results:
        med = statistics.median(r["times"])
        detail = r["reps_detail"]
        n = len(detail[0]["bytes_per_stream"])
        total_s = sum(d["seconds"] for d in detail)
        per_stream = [sum(d["bytes_per_stream"][i] for d in detail) for i in range(n)]
        rows.append(TransportRow(
            impl=impl, mode="throughput", bytes=r["bytes"],
            nsocks=config.nsocks if impl == "redsock" else 1,
            balance=config.balance if impl == "redsock" else "-", iters=r["iters"],
            median_s=med, min_s=min(r["times"]),
            gbps=r["bytes"] * 8 / med / 1e9 if med > 0 else 0.0,
            extra={
                "src_ports": ports, "attempts": attempts,
                "chunk_bytes": config.chunk_bytes, "notsent_lowat": config.notsent_lowat,
                "slices_per_stream": [sum(d["slices_per_stream"][i] for d in detail) for i in range(n)],
                "bytes_per_stream": per_stream,
                "stream_mbps": [b * 8 / total_s / 1e6 for b in per_stream],
                "tail_ms": [statistics.median(d["tail_s"][i] for d in detail) * 1e3 for i in range(n)],
                "rep_gbps": [r["bytes"] * r["iters"] * 8 / d["seconds"] / 1e9 for d in detail],
                "machine_cpu": statistics.median(d["machine_cpu"] for d in detail),
                "machine_steal": statistics.median(d["machine_steal"] for d in detail),
                "driver_cpu": sum(d["driver_cpu_s"] for d in detail) / total_s,
                "payload_bytes": r["bytes"] * r["iters"] * r["reps"],
            }))
    return rows


def _drive_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m redsock.bench.transport.driver drive",
                                description="driver side of the testbed benchmark (JSON rows on stdout)")
    p.add_argument("--connect", required=True, metavar="HOST:PORT")
    p.add_argument("--impl", default="redsock", choices=["redsock", "plain"])
    p.add_argument("--sizes", default="256M")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--nclasses", type=int, default=4)
    p.add_argument("--shift", type=int, default=1)
    p.add_argument("--want", default="", help="class multiset to land on, e.g. 0,1,2,3 (empty: any)")
    p.add_argument("--max-attempts", type=int, default=400)
    a = p.parse_args(argv)
    config = Config.from_env()  # REDSOCK_* set by the orchestrator
    want = [int(x) for x in a.want.split(",") if x != ""] or None
    rows = run_drive(parse_hostport(a.connect), a.impl, config,
                     [parse_size(s) for s in a.sizes.split(",") if s], a.iters, a.reps, want,
                     a.nclasses, a.shift, a.max_attempts)
    for r in rows:
        print(json.dumps(asdict(r)), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "drive":
        try:
            raise SystemExit(_drive_main(sys.argv[2:]))
        except RedsockError as e:
            print(f"redsock bench driver: error: {e}", file=sys.stderr)
            raise SystemExit(2)
    print("usage: python -m redsock.bench.transport.driver drive --connect HOST:PORT ...", file=sys.stderr)
    raise SystemExit(2)
