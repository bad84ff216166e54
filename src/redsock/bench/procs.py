"""The child processes a benchmark or test starts: their output, stopping them, and the
machine's CPU they share (with the CPU line the testbed benchmarks print and reproduce reads)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple


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


#: The output files of the processes :func:`start_logged` started (gone with the process object).
_LOGS: weakref.WeakKeyDictionary[subprocess.Popen, tuple[IO[str], IO[str]]] = weakref.WeakKeyDictionary()


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
    _LOGS[proc] = (out, err)
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
        for f in _LOGS[p]:
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


def cpu_line(wall_s: float, rank_cpu_s: float, server_cpu_s: float, busy: float, steal: float) -> str:
    """The testbed benchmarks' CPU line; reproduce and ``plan --lab`` read it back from their
    logs with :data:`CPU_SHARE_RE` and :data:`MACHINE_BUSY_RE`."""
    ncpu = os.cpu_count() or 1
    return (f"# CPU over {wall_s:.1f} s: ranks {rank_cpu_s:.1f} s, reducers {server_cpu_s:.1f} s "
            f"(= {100 * (rank_cpu_s + server_cpu_s) / (wall_s * ncpu):.0f}% of {ncpu} cores); "
            f"whole machine busy {100 * busy:.0f}% (includes anything else running, and {100 * steal:.0f}% "
            "stolen by the hypervisor)")


#: A benchmark that kept the whole machine this busy measured its cores, not its links (the
#: lab's rule: ``plan --lab`` classes such rows CPU-bound, the testbed tables print the share).
BUSY_LIMIT = 0.75
#: In :func:`cpu_line`: the CPU the benchmark's own processes used, % of all cores.
CPU_SHARE_RE = re.compile(r"\(= (\d+)% of \d+ cores\)")
#: In :func:`cpu_line`: how busy the whole machine was, %.
MACHINE_BUSY_RE = re.compile(r"whole machine busy (\d+)%")


def proc_status(pid: int) -> dict[str, float]:
    """Peak RSS (VmHWM, MiB) and CPU seconds so far of a live process, from /proc."""
    out: dict[str, float] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmHWM:", "VmRSS:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        out["cpu_s"] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    except (OSError, IndexError, ValueError):
        pass
    return out
