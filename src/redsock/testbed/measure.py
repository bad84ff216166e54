"""Goodput measurement between testbed hosts with real TCP flows.

A receiver (``python -m redsock.testbed.flow recv``) runs in the destination
namespace, a sender in the source namespace; both stop by themselves.  The
rate is computed at the receiver over a common window that skips the first
``warmup`` seconds (slow start, the token bucket's initial burst), so it is
what an application sees: TCP payload bits per second (about 95.6 % of the
shaped rate, which counts Ethernet/IP/TCP headers, at a 1500-byte MTU).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import ConfigError
from .cluster import NetnsTopology
from .netns import TestbedError, format_rate

__all__ = ["FlowRate", "GoodputResult", "measure_flows", "measure_tcp_goodput"]


@dataclass(frozen=True)
class FlowRate:
    sport: int        # the flow's source port (decides its htb path class)
    bps: float        # goodput in bits/s over the measurement window


@dataclass(frozen=True)
class GoodputResult:
    total_bps: float
    flows: tuple[FlowRate, ...]
    window_s: float   # length of the common window the rates are computed over

    def __str__(self) -> str:
        per = ", ".join(f"{f.sport}:{format_rate(f.bps)}" for f in self.flows)
        return f"{format_rate(self.total_bps)} over {self.window_s:.2f}s ({per})"


def measure_flows(testbed: NetnsTopology, src_host: str, dst_host: str, seconds: float = 2.0,
                  *, nflows: int = 1, sports: Sequence[int] | None = None,
                  warmup: float = 0.3) -> GoodputResult:
    """Send bulk TCP ``src_host -> dst_host`` on ``nflows`` parallel flows, return per-flow goodput.

    ``sports`` binds the flows to these source ports (one flow each), which
    picks their path classes on per-flow-shaped links; otherwise the kernel
    picks ephemeral ports.  Runs about ``warmup + seconds`` plus process start;
    raises :class:`TestbedError` if a side fails or does not finish in time.
    """
    if seconds <= 0 or warmup < 0:
        raise ConfigError("seconds must be > 0 and warmup >= 0")
    sports = list(sports or [])
    n = max(nflows, len(sports))
    if n < 1:
        raise ConfigError("need at least one flow")
    dst_addr = testbed.host_addr(dst_host)
    src_addr = testbed.host_addr(src_host)
    budget = warmup + seconds + 20.0  # process start and connection set-up included
    flow = [sys.executable, "-m", "redsock.testbed.flow"]
    recv = testbed.popen(dst_host, flow + ["recv", "--bind", dst_addr, "--nflows", str(n),
                                           "--deadline", f"{budget:.1f}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert recv.stdout is not None
        first = recv.stdout.readline()  # {"port": P} once listening; "" if it died
        try:
            port = int(json.loads(first)["port"])
        except (ValueError, KeyError, TypeError):
            _, err = _finish(recv, 5.0)
            raise TestbedError(f"flow receiver in {dst_host} did not start: {first!r} {err}")
        argv = flow + ["send", "--to", dst_addr, "--port", str(port), "--bind", src_addr,
                       "--seconds", f"{warmup + seconds:.3f}", "--nflows", str(n)]
        for sp in sports:
            argv += ["--sport", str(sp)]
        try:
            snd = testbed.exec(src_host, argv, capture_output=True, text=True, timeout=budget)
        except subprocess.TimeoutExpired as exc:
            raise TestbedError(f"flow sender in {src_host} did not finish in {budget:.0f}s") \
                from exc
        if snd.returncode != 0:
            raise TestbedError(f"flow sender {src_host} -> {dst_host} failed "
                               f"(exit {snd.returncode}): {snd.stdout.strip()} "
                               f"{snd.stderr.strip()}")
        out, err = _finish(recv, 15.0)
        try:
            result = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise TestbedError(f"flow receiver in {dst_host} gave no result: {out!r} {err}") \
                from None
        if recv.returncode != 0 or "error" in result:
            raise TestbedError(f"flow receiver in {dst_host} failed (exit {recv.returncode}): "
                               f"{result.get('error', '')} {err}")
        return _rates(result, warmup)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()


def measure_tcp_goodput(testbed: NetnsTopology, src_host: str, dst_host: str,
                        seconds: float = 2.0, nflows: int = 1) -> float:
    """Total TCP goodput in bits/s of ``nflows`` parallel flows ``src_host -> dst_host``."""
    return measure_flows(testbed, src_host, dst_host, seconds, nflows=nflows).total_bps


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return out or "", (err or "").strip()


def _rates(result: dict[str, Any], warmup: float) -> GoodputResult:
    firsts, lasts = result["first"], result["last"]
    if not all(result["bytes"]):
        raise TestbedError(f"a flow delivered no bytes: {result['bytes']}")
    t0 = max(firsts) + warmup   # every flow is past its start-up
    t1 = min(lasts)             # no flow has stopped yet
    if t1 - t0 < 0.1:
        raise TestbedError(f"measurement window too short ({t1 - t0:.3f}s); raise seconds")
    timeline = [(t, counts) for t, counts in result["timeline"]]
    c0, c1 = _counts_at(timeline, t0), _counts_at(timeline, t1)
    flows = tuple(FlowRate(sport=sp, bps=(b - a) * 8 / (t1 - t0))
                  for sp, a, b in zip(result["sports"], c0, c1))
    return GoodputResult(total_bps=sum(f.bps for f in flows), flows=flows, window_s=t1 - t0)


def _counts_at(timeline: list[tuple[float, list[int]]], t: float) -> list[float]:
    """Byte counts at time ``t``, interpolated linearly between timeline samples."""
    prev: tuple[float, list[float] | list[int]] = (timeline[0][0], [0.0] * len(timeline[0][1]))
    for ts, counts in timeline:
        if ts >= t:
            span = ts - prev[0]
            w = (t - prev[0]) / span if span > 0 else 1.0
            return [a + (b - a) * w for a, b in zip(prev[1], counts)]
        prev = (ts, counts)
    return [float(c) for c in timeline[-1][1]]
