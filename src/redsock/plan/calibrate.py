"""``redsock calibrate``: measure the plan's constants on this machine and write a profile.

Each constant comes from an existing benchmark run as its own process (``python -m redsock
bench ... --json FILE``), on loopback, so no root is needed:

* per-message latency: 2-rank 8-byte all-reduces (``bench allreduce --nprocs 2``): recursive
  doubling is one round (``redsock_step_s``), gloo's ring two steps (``gloo_step_s``), the
  reducers two hops (``reducer_hop_s``, against a ``redsock serve`` started here);
* reducer per-byte CPU: the same reducer's CPU seconds (``/proc``) over a 2-rank 16 MiB
  all-reduce sweep, divided by the contribution bytes it received;
* TCP loopback bandwidth of one flow (``bench transport --local``, one plain socket, 64 MiB);
* a rank's reduction and shared-memory copy rates: numpy (redsock's own reduction kernel,
  :func:`redsock.ops.combine`, and one copy) on 16 MiB arrays, timed in this process.

The link goodput factor is not measured here (loopback has no line rate): it stays that of
the testbed's shaped links, 0.956, unless ``--goodput`` gives another.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .. import ops
from ..errors import ConfigError, RedsockError
from .profile import DEFAULT, Profile

__all__ = ["add_arguments", "measure", "run"]

_MiB = 1 << 20
REDUCER_SWEEP_BYTES = 16 * _MiB  #: one size, below the benchmark's >= 64 MiB iteration cap


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDSOCK_ALGO", "REDSOCK_SERVERS")}
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def _bench(argv: list[str], out: Path, timeout_s: float, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``python -m redsock bench <argv> --json out``; its rows, or a clear error."""
    cmd = [sys.executable, "-m", "redsock", "bench", *argv, "--json", str(out)]
    try:
        done = subprocess.run(cmd, env=_child_env(env), capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        raise RedsockError(f"calibrate: {' '.join(argv[:2])} still running after {timeout_s:.0f} s") from None
    if done.returncode != 0 or not out.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise RedsockError(f"calibrate: `redsock bench {' '.join(argv)}` failed ({done.returncode}): "
                           + " | ".join(tail))
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def _median_s(rows: list[dict[str, Any]], algo: str, nbytes: int) -> float:
    for r in rows:
        if r["algo"] == algo and r["bytes"] == nbytes:
            return float(r["median_s"])
    raise RedsockError(f"calibrate: no {algo} row at {nbytes} bytes in the benchmark's output")


class _Reducer:
    """A ``redsock serve`` on a free loopback port, stopped on exit."""

    def __enter__(self) -> "_Reducer":
        self.proc = subprocess.Popen([sys.executable, "-m", "redsock", "serve", "--host", "127.0.0.1", "--port", "0"],
                                     env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     stdin=subprocess.DEVNULL)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if "reduction server on" not in line:
            self.proc.kill()
            self.proc.wait(10)
            raise RedsockError(f"calibrate: the reducer did not start ({line.strip() or 'no output'})")
        self.address = line.rsplit(" ", 1)[1].strip()
        return self

    def cpu_s(self) -> float:
        from ..bench.procs import proc_status

        return proc_status(self.proc.pid).get("cpu_s", 0.0)

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout:
            self.proc.stdout.close()


def _rate(fn: Any, nbytes: int, reps: int) -> float:
    """Bytes per second of ``fn()`` over ``nbytes``, median of ``reps`` timings."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def memory_rates(nbytes: int = 16 * _MiB, reps: int = 9) -> tuple[float, float]:
    """(reduce_Bps, intra_Bps): redsock's float32 sum kernel, and one copy into a buffer
    (what a rank's copy into or out of shared memory costs), on ``nbytes`` arrays."""
    acc = np.ones(nbytes // 4, np.float32)
    other = np.ones_like(acc)
    reduce_Bps = _rate(lambda: ops.combine(acc, other, ops.ReduceOp.SUM), nbytes, reps)
    return reduce_Bps, _rate(lambda: np.copyto(acc, other), nbytes, reps)


def measure(workdir: Path, quick: bool = False, timeout_s: float = 300.0,
            goodput: float = DEFAULT.goodput_factor, log: Any = print) -> tuple[Profile, dict[str, Any]]:
    """Run the benchmarks in ``workdir``; the profile and the raw figures it came from."""
    n_small, w_small = (60, 10) if quick else (300, 30)
    # Enough contribution bytes (1.1 GB; quick: 130 MB) that the reducer's CPU time is many 10 ms clock ticks.
    n_big, w_big = (3, 1) if quick else (32, 2)
    raw: dict[str, Any] = {}

    log("calibrate: 8-byte all-reduces, 2 ranks (recursive doubling, gloo's ring)")
    rows = _bench(["allreduce", "--nprocs", "2", "-b", "8", "-e", "8", "--algo", "small,gloo",
                   "-n", str(n_small), "-w", str(w_small), "--no-progress", "--timeout", str(timeout_s)],
                  workdir / "latency.jsonl", timeout_s + 30)
    raw["small_8B_s"], raw["gloo_8B_s"] = _median_s(rows, "small", 8), _median_s(rows, "gloo", 8)

    log("calibrate: TCP loopback, one plain socket, 64 MiB messages")
    rows = _bench(["transport", "--local", "--sizes", "64M", "--impl", "redsock,plain", "--iters", "2" if quick else "4",
                   "--reps", "2" if quick else "3", "--pingpong-max", "0"], workdir / "loopback.jsonl", timeout_s)
    tput = [r for r in rows if r["mode"] == "throughput" and r["impl"] == "plain"]
    if not tput:
        raise RedsockError("calibrate: the transport benchmark reported no throughput row")
    raw["loopback_gbps"] = max(r["gbps"] for r in tput)

    log("calibrate: a reducer here, 2 ranks: 8-byte round trips, then 16 MiB all-reduces (its CPU per byte)")
    with _Reducer() as reducer:
        env = {"REDSOCK_SERVERS": reducer.address}
        rows = _bench(["allreduce", "--nprocs", "2", "-b", "8", "-e", "8", "--algo", "server",
                       "-n", str(n_small), "-w", str(w_small), "--no-progress", "--timeout", str(timeout_s)],
                      workdir / "reducer-latency.jsonl", timeout_s + 30, env)
        raw["server_8B_s"] = _median_s(rows, "server", 8)
        cpu0 = reducer.cpu_s()
        size = REDUCER_SWEEP_BYTES
        rows = _bench(["allreduce", "--nprocs", "2", "-b", str(size), "-e", str(size), "--algo", "server",
                       "-n", str(n_big), "-w", str(w_big), "--no-progress", "--timeout", str(timeout_s)],
                      workdir / "reducer-bytes.jsonl", timeout_s + 30, env)
        raw["reducer_cpu_s"] = reducer.cpu_s() - cpu0
        raw["reducer_bytes_in"] = (n_big + w_big) * 2 * size
        raw["server_16M_s"] = _median_s(rows, "server", size)
    if raw["reducer_cpu_s"] <= 0:
        raise RedsockError("calibrate: could not read the reducer's CPU time from /proc")

    log("calibrate: reduction kernel and shared-memory copies (numpy, this process)")
    raw["reduce_Bps"], raw["intra_Bps"] = memory_rates(reps=5 if quick else 9)

    profile = Profile(
        goodput_factor=goodput,
        gloo_step_s=raw["gloo_8B_s"] / 2,
        redsock_step_s=raw["small_8B_s"],
        reducer_hop_s=raw["server_8B_s"] / 2,
        reducer_cpu_s_per_byte=raw["reducer_cpu_s"] / raw["reducer_bytes_in"],
        reduce_Bps=raw["reduce_Bps"],
        intra_Bps=raw["intra_Bps"],
        loopback_Bps=raw["loopback_gbps"] * 1e9 / 8,
        piece_bytes=DEFAULT.piece_bytes,
        source=f"redsock calibrate on {os.uname().nodename} ({os.cpu_count()} cores), "
               f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
    )
    return profile, raw


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="redsock-profile.json", metavar="FILE",
                   help="where to write the profile (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="fewer iterations (about 8 s on 2 cores; full: about 15 s)")
    p.add_argument("--goodput", type=float, default=DEFAULT.goodput_factor,
                   help="payload share of a link's line rate (default %(default)s, the testbed's)")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of each benchmark, seconds")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.goodput <= 1:
        raise ConfigError(f"--goodput must be in (0, 1], got {args.goodput}")
    if args.timeout <= 0:
        raise ConfigError("--timeout must be > 0")
    with tempfile.TemporaryDirectory(prefix="redsock-calibrate-") as tmp:
        profile, raw = measure(Path(tmp), args.quick, args.timeout, args.goodput)
    obj = {**profile.to_json(), "measured": raw}
    Path(args.out).write_text(json.dumps(obj, indent=2) + "\n")
    for k, v in profile.to_json().items():
        print(f"  {k:24s} {v}")
    print(f"wrote {args.out} (cores busy during calibration: {os.getloadavg()[0]:.1f} load average)")
    return 0
