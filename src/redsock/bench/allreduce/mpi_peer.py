"""``bench allreduce --peer mpi``: Open MPI's shared-memory all-reduce beside redsock's, same run.

After the redsock ranks finish, the same sizes run under ``mpirun --mca btl vader,self``
(Open MPI's shared-memory transport, mpi4py's ``Allreduce`` on float32), timed exactly as
``--back-to-back`` times redsock: a barrier, ``-n`` back-to-back calls, the slowest rank's
total / ``-n``, median of the same number of rounds, with the machine's busy and steal
shares per size.  The timing loop is :func:`main`, which ``mpirun`` starts in every rank
(``python -m redsock.bench.allreduce.mpi_peer``); it needs ``mpirun`` and ``mpi4py``
(``apt-get install openmpi-bin libopenmpi-dev``, ``pip install mpi4py``).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable

from ...errors import ConfigError
from ..procs import box_cpu, cpu_shares
from .rank import B2B_ROUNDS

#: Open MPI's shared-memory transport (vader) and the loopback to itself; nothing else.
MCA_SHM = ["--mca", "btl", "vader,self"]


def run_peer(plan: Iterable[tuple[int, int, int]], nprocs: int, timeout_s: float) -> dict[int, dict]:
    """Time Open MPI on ``plan`` ((bytes, warm-up, iterations) per size) with ``nprocs`` ranks:
    one record per size (``median_s``, ``rounds_s``, ``machine_busy``, ``machine_steal``).
    Raises :class:`ConfigError` when mpirun or mpi4py is missing or the run fails."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise ConfigError("--peer mpi needs mpirun (apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py)")
    spec = ",".join(f"{b}:{w}:{n}" for b, w, n in plan)
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(nprocs), *MCA_SHM,
           sys.executable, "-m", __name__, spec]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise ConfigError(f"--peer mpi: mpirun did not finish within {timeout_s:g}s") from e
    records = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            records[r["bytes"]] = r
    if done.returncode != 0 or not records:
        raise ConfigError(f"--peer mpi: mpirun failed (status {done.returncode}): {done.stderr.strip()[-1500:]}")
    return records


def side_by_side(rows: list, mpi: dict[int, dict]) -> str:
    """The redsock rows (report.Row, one algorithm) and Open MPI's records by size: both
    times, their ratio, the path redsock's in-host stage took, and the busy shares."""
    out = ["# redsock against Open MPI shared memory (vader), the same sizes in the same run",
           "#", "#       size    redsock   MPI shm   redsock/MPI  path    busy (redsock, MPI)  steal (redsock, MPI)",
           "#        (B)       (us)      (us)"]
    for r in rows:
        m = mpi.get(r.bytes)
        if m is None:
            continue
        extra = r.extra or {}
        out.append(f"{r.bytes:>12}  {r.median_s * 1e6:>9.1f} {m['median_s'] * 1e6:>9.1f}  {r.median_s / m['median_s']:>9.2f}x"
                   f"    {extra.get('path', extra.get('scheme', '-')):<6}  "
                   f"{extra.get('machine_busy', float('nan')):>4.0%}, {m['machine_busy']:>4.0%}          "
                   f"{extra.get('machine_steal', float('nan')):>4.0%}, {m.get('machine_steal', float('nan')):>4.0%}")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> None:
    """The timing loop in every MPI rank; rank 0 prints one JSON line per size."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    for item in argv[0].split(","):
        nbytes, warm, iters = (int(v) for v in item.split(":"))
        a = np.zeros(max(1, nbytes // 4), np.float32)
        b = np.empty_like(a)
        for _ in range(warm):
            comm.Allreduce(a, b)
        box0, per_call = box_cpu(), []
        for _ in range(B2B_ROUNDS):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                comm.Allreduce(a, b)
            per_call.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) / iters)
        busy, steal = cpu_shares(box0, box_cpu())
        if comm.Get_rank() == 0:
            print(json.dumps({"impl": "mpi", "world": comm.Get_size(), "bytes": nbytes,
                              "median_s": statistics.median(per_call), "rounds_s": per_call,
                              "machine_busy": round(busy, 3), "machine_steal": round(steal, 3)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
