"""Stopping the child processes a benchmark or test started: politely, then for sure."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable


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
