"""The child processes a benchmark or test starts: their output, stopping them, and the
machine's CPU they share."""

from __future__ import annotations

import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple


def stop_processes(procs: Iterable[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every process still running, wait up to ``grace_s`` each, then SIGKILL."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def start_logged(argv: Sequence[str], popen: Callable[..., subprocess.Popen] = subprocess.Popen,
                 **kwargs: Any) -> subprocess.Popen:
    """``popen(argv, **kwargs)`` with stdout and stderr going to unlinked temporary files, not
    pipes: a child that writes a lot must never block on a pipe that nobody reads yet (the
    parent may be waiting for another child, which waits for this one).  Read them with
    :func:`wait_logged`."""
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    try:
        proc = popen(argv, stdout=out, stderr=err, text=True, **kwargs)
    except BaseException:
        out.close()
        err.close()
        raise
    proc.logs = (out, err)
    return proc


def wait_logged(procs: Sequence[subprocess.Popen], timeout_s: float) -> list[tuple[int, str, str]]:
    """Wait for processes started by :func:`start_logged` until one shared deadline, then kill
    the ones still running (their stderr ends with a note saying so).  Returns (returncode,
    stdout, stderr) per process."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    killed = [p for p in procs if p.poll() is None]
    for p in killed:
        p.kill()
        p.wait()
    outs = []
    for p in procs:
        texts = []
        for f in p.logs:
            f.seek(0)
            texts.append(f.read())
            f.close()
        if p in killed:
            texts[1] += f"\n[killed: still running after {timeout_s:g}s]"
        outs.append((p.returncode, texts[0], texts[1]))
    return outs


class BoxCpu(NamedTuple):
    """Jiffies of the whole machine since boot, from /proc/stat."""

    busy: int  # not idle: our work, anything else running, and steal
    total: int
    steal: int  # taken by the hypervisor for other guests (on a VM)


def box_cpu() -> BoxCpu:
    """The whole machine's CPU so far (see :func:`cpu_shares`)."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]  # guest: in user
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return BoxCpu(sum(vals) - idle, sum(vals), vals[7] if len(vals) > 7 else 0)


def cpu_shares(before: BoxCpu, after: BoxCpu) -> tuple[float, float]:
    """The shares of the machine's time between two readings that were busy and, of those,
    stolen by the hypervisor.  Steal counts as busy (those cycles were not ours to use: a
    run can be CPU-bound through it), and is shown apart because it slows every process
    down at once: on this lab's VM, 8-byte all-reduces (reducers, gloo and the plain-socket
    floor alike) took 2.3-3.6x as long in runs with 20-28% steal as in runs with 0-7%
    (2026-12-03)."""
    total = max(1, after.total - before.total)
    return (after.busy - before.busy) / total, (after.steal - before.steal) / total


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM/SIGHUP raise KeyboardInterrupt, so the testbed's ``finally`` runs for them too."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        for s in old:
            signal.signal(s, handler)
    try:
        yield
    finally:
        if in_main:
            for s, h in old.items():
                signal.signal(s, h)


@contextmanager
def no_interrupts() -> Iterator[None]:
    """Hold off Ctrl-C / SIGTERM while tearing down, so a second one cannot leave namespaces."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.getsignal(s) for s in sigs}
    for s in sigs:
        signal.signal(s, signal.SIG_IGN)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
