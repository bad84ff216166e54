"""``bench allreduce --peer mpi``: Open MPI's shared-memory all-reduce beside redsock's, in the same processes.

``--peer mpi`` starts the ranks with ``mpirun --mca btl vader,self`` (Open MPI's
shared-memory transport, and the loopback to itself) instead of the local launcher; every
rank joins redsock too (through a store the launcher hosts, as with ``--nprocs``), and
the sweep times ``--algo``'s redsock all-reduce and mpi4py's ``Allreduce`` ("mpi") on the
same ranks, round by round in turn (:func:`~.rank.time_in_turn`): this machine's speed
changes from one minute to the next (up to 3x, 2026-12-07), and a peer timed a sweep later
meets another machine.  The same run, without the launcher, is
``mpirun --allow-run-as-root --oversubscribe -np 4 --mca btl vader,self python -m redsock
bench allreduce --back-to-back --algo auto,mpi`` with ``MASTER_ADDR``/``MASTER_PORT`` naming
a store (:func:`adopt_mpi_ranks` takes the ranks from Open MPI's environment).

MPI's calls are timed as ``../shared/anchors/mpi_allreduce.py`` times them: float32, out
of place (``Allreduce(x, out)``; its result is checked in place).  Needs ``mpirun`` and
mpi4py (``apt-get install openmpi-bin libopenmpi-dev``, ``pip install mpi4py``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import Any

import numpy as np

from ... import ops
from ...errors import ConfigError
from ...results import per_half, times_x
from ..procs import stop_processes

#: Open MPI's shared-memory transport (vader) and the loopback to itself; nothing else.
MCA_SHM = ["--mca", "btl", "vader,self"]


def adopt_mpi_ranks() -> bool:
    """Where ``mpirun`` started this process and torchrun's variables are unset, take
    ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` from Open MPI's; True if it did."""
    if "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" not in os.environ:
        return False
    os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
    os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
    os.environ["LOCAL_RANK"] = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ["RANK"])
    return True


class MpiPeer:
    """mpi4py's all-reduce on this rank (the peer ``--algo ...,mpi`` times beside redsock)."""

    def __init__(self, rank: int, world: int):
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise ConfigError("--algo mpi needs mpi4py (pip install mpi4py)") from e
        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        if (self.comm.Get_rank(), self.comm.Get_size()) != (rank, world):
            raise ConfigError(f"--algo mpi: this is rank {rank} of {world}, but MPI says rank "
                              f"{self.comm.Get_rank()} of {self.comm.Get_size()}: start the ranks with "
                              "mpirun (bench allreduce --peer mpi does)")
        self._outs: dict[tuple, np.ndarray] = {}

    def timed(self, x: np.ndarray) -> None:
        """One out-of-place float32 sum, as the anchor times it (``x`` unchanged), into an
        output kept per shape (``--sizes-in-turn`` goes back and forth between sizes)."""
        out = self._outs.get((x.shape, x.dtype))
        if out is None:
            out = self._outs[(x.shape, x.dtype)] = np.empty_like(x)
        self.comm.Allreduce(x, out)

    def all_reduce(self, x: np.ndarray, op: ops.ReduceOp) -> None:
        """``x`` reduced in place (the check's call)."""
        if op is not ops.ReduceOp.SUM or x.dtype != np.float32:
            raise ConfigError("--algo mpi times float32 sum only")
        self.comm.Allreduce(self.MPI.IN_PLACE, x)


def launch(nprocs: int, argv: list[str], timeout_s: float) -> int:
    """Run ``python -m redsock <argv>`` in ``nprocs`` ranks started by ``mpirun`` with
    Open MPI's shared-memory transport, around a store hosted here (as :func:`.local.launch_local`
    does), and wait at most ``timeout_s``: the exit status (mpirun stops every rank when one fails)."""
    from .local import host_store

    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise ConfigError("--peer mpi needs mpirun (apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py)")
    store, to_store = host_store(timeout_s)
    env = {**os.environ, **to_store}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # the ranks take theirs from Open MPI
        env.pop(name, None)
    forward = [arg for name in to_store for arg in ("-x", name)]
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(nprocs), *MCA_SHM, *forward,
           sys.executable, "-m", "redsock", *argv]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"redsock: mpirun still running after {timeout_s:.0f}s; stopping it and its ranks", file=sys.stderr)
        return 124
    finally:
        _stop_group(proc)
        del store  # closes its server


def _stop_group(proc: subprocess.Popen) -> None:
    """mpirun (SIGTERM: it stops its ranks), then anything of its session still there."""
    stop_processes([proc], grace_s=5.0)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def side_by_side(rows: list[Any]) -> str:
    """The redsock rows and the MPI rows of one run (report.Row) by size: both times, their
    ratio (with its range over the rounds, each round's pair timed one after the other), each
    one's time over its time at half the size (where the sweep has it: ``-f 2``), the path
    redsock's in-host stage took, and the machine's busy and steal shares while the size was
    timed (both, rounds in turn)."""
    mpi = {r.bytes: r for r in rows if r.impl == "mpi"}
    ours = [r for r in rows if r.impl == "redsock" and r.bytes in mpi]
    ours_half = per_half({r.bytes: r.median_s for r in ours})
    mpi_half = per_half({n: m.median_s for n, m in mpi.items()})
    out = ["# redsock against Open MPI shared memory (vader), the same sizes in the same processes, rounds in turn",
           "#", "#       size    redsock   MPI shm   redsock/MPI  (rounds)   x half size      busy  steal  path",
           "#        (B)       (us)      (us)                          redsock    MPI"]
    for r in ours:
        m = mpi[r.bytes]
        extra = r.extra or {}
        pairs = [a / b for a, b in zip(extra.get("rounds_s", ()), (m.extra or {}).get("rounds_s", ()))]
        spread = f"{min(pairs):.2f}-{max(pairs):.2f}" if pairs else "-"
        out.append(f"{r.bytes:>12}  {r.median_s * 1e6:>9.1f} {m.median_s * 1e6:>9.1f}  {r.median_s / m.median_s:>9.2f}x"
                   f"  {spread:<9}  {times_x(ours_half[r.bytes]):>7} {times_x(mpi_half[r.bytes]):>6}"
                   f"  {extra.get('machine_busy', float('nan')):>4.0%}  "
                   f"{extra.get('machine_steal', float('nan')):>4.0%}  {extra.get('path', extra.get('scheme', '-'))}")
    return "\n".join(out) + "\n"
