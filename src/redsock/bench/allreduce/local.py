"""``redsock bench allreduce --nprocs N``: N ranks on this machine, as torchrun --nproc-per-node starts them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ..procs import stop_processes


def host_store(timeout_s: float) -> tuple[object, dict[str, str]]:
    """The ranks' store, hosted here on a port the kernel picked, as torchrun's agent hosts it
    (a port found free and closed again for rank 0 to bind could be taken in between), and
    the variables that lead a rank to it.  The store's server lives as long as the object."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "true"}


def launch_local(nprocs: int, argv: list[str], timeout_s: float) -> int:
    """Start ``nprocs`` ranks on this machine, like torchrun --nproc-per-node, and wait."""
    store, to_store = host_store(timeout_s)
    procs = []
    for r in range(nprocs):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(r), **to_store}
        procs.append(subprocess.Popen([sys.executable, "-m", "redsock", *argv], env=env))
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = [None] * nprocs
    try:
        while None in codes:
            for i, p in enumerate(procs):
                if codes[i] is None:
                    codes[i] = p.poll()
            if any(c not in (None, 0) for c in codes):
                break  # one rank failed: the others will not finish
            if time.monotonic() > deadline:
                print(f"redsock: ranks still running after {timeout_s:.0f}s; stopping them", file=sys.stderr)
                break
            time.sleep(0.05)
    finally:
        stop_processes(procs)
        del store  # closes its server
    failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]  # before we stopped anyone
    for i, code in failed:
        print(f"redsock: rank {i} {_exit_reason(code)}", file=sys.stderr)
    bad = failed or [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    return 0 if not bad else bad[0][1] if bad[0][1] > 0 else 128 - bad[0][1]


def _exit_reason(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    hint = " (out of memory? see dmesg)" if code == -signal.SIGKILL else ""
    return f"was killed by {name}{hint}"


def strip_options(argv: list[str], options: dict[str, int]) -> list[str]:
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in options:
            skip = 0 if "=" in a else options[name]
            continue
        out.append(a)
    return out
