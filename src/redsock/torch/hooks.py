"""A DDP communication hook that sends gradient buckets through redsock.

For jobs that keep another backend (gloo, nccl) for everything else::

    dist.init_process_group("gloo")
    model = DDP(model)
    state = redsock.torch.HookState.from_process_group()      # a redsock Communicator for the same ranks
    model.register_comm_hook(state, redsock.torch.allreduce_hook)

The hook averages (sum, then divide by the world size), like DDP's default.

:func:`compress_hook` does the same on a 16-bit wire (half the bytes), summing in float32,
with error feedback: each rank keeps what rounding took from each bucket and adds it to that
bucket's next gradient, so that over the steps nothing is lost::

    model.register_comm_hook(state, redsock.torch.compress_hook(wire="bf16"))
"""

# No `from __future__ import annotations` here: DDP compares allreduce_hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] as objects, not strings.

import itertools
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import ops
from ..api import init as redsock_init
from ..collectives import Communicator
from ..errors import ConfigError
from .backend import ProcessGroupRedsock, new_communicator
from .bridge import Staged, copy_into, cuda_devices, sync_devices
from .work import RedsockWork, Tracker

_hook_counts: defaultdict[str, itertools.count] = defaultdict(itertools.count)
_hook_counts_lock = threading.Lock()


@dataclass
class HookState:
    """What :func:`allreduce_hook` needs: a redsock Communicator over the DDP ranks."""

    comm: Communicator
    tracker: Tracker = field(default_factory=Tracker)

    @classmethod
    def from_process_group(cls, group: Any = None, **options: Any) -> "HookState":
        """A Communicator over the ranks of ``group`` (default: the world), bootstrapped
        through the default group's store.  A redsock group's own Communicator is reused.
        Every rank of the group must call this, in the same order as its other HookStates.
        ``options`` override ``REDSOCK_*`` (e.g. ``servers=``, ``algo=``)."""
        pg = group if group is not None else dist.group.WORLD
        if pg is None:
            raise ConfigError("HookState.from_process_group: torch.distributed is not initialised "
                              "(call dist.init_process_group first)")
        if isinstance(pg, ProcessGroupRedsock) and not options:
            return cls(pg.comm)
        name = pg.group_name
        with _hook_counts_lock:
            n = next(_hook_counts[name])
        # A namespace of the default store that no group and no other HookState uses.
        store = dist.PrefixStore(f"redsock-hook/{name}/{n}/", dist.distributed_c10d._get_default_store())
        return cls(new_communicator(pg.rank(), pg.size(), store, **options))

    @classmethod
    def from_env(cls, **options: Any) -> "HookState":
        """A Communicator from ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` (``redsock.init()``)."""
        return cls(redsock_init(**options))

    def close(self) -> None:
        self.comm.close()


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average ``bucket`` across ranks with redsock; the future's value is
    the bucket's buffer (reduced in place when it is a contiguous CPU tensor)."""
    tensor = bucket.buffer()
    staged = Staged(tensor, read=True, write=True, what="allreduce_hook")
    work = RedsockWork("allreduce_hook", cuda_devices([tensor]))
    sync_devices([tensor])
    part = state.comm.all_reduce(staged.array, "avg", async_op=True).get_future()

    def finish() -> torch.Tensor:
        staged.finish()
        return tensor

    state.tracker.complete_when_done(work, [part], finish, keep=staged)
    return work.get_future()


_TORCH_WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compress_hook(wire: str = "bf16", error_feedback: bool = True):
    """A DDP comm hook (use it as :func:`allreduce_hook`) that averages float32 buckets on a
    16-bit ``wire`` ("bf16" or "fp16"): each rank rounds its bucket once, to nearest even (on
    the GPU for a CUDA bucket, so the copy to the host halves too), the sum is float32, the
    result rounded once.  ``error_feedback``: each rank adds the rounding residual of a bucket
    to the same bucket's next gradient (the residual is exact: the bucket is rounded here,
    so the all-reduce's own rounding of it changes nothing).  On the fp16 wire an average
    beyond 65504 fails the step with :class:`~redsock.errors.WireOverflow` on every rank.
    """
    name = wire.strip().lower() if isinstance(wire, str) else wire
    if name not in _TORCH_WIRE:
        raise ConfigError(f"compress_hook: wire must be bf16 or fp16, got {wire!r} (for float32, allreduce_hook)")
    low_dtype, wire_np = _TORCH_WIRE[name], ops.wire_dtype(name)
    residuals: dict[int, Any] = {}  # bucket index -> what rounding took from it last step
    lows: dict[int, np.ndarray] = {}  # bucket index -> its 16-bit staging buffer (kept: no page faults per step)

    def hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        tensor = bucket.buffer()
        if tensor.dtype != torch.float32:
            raise ConfigError(f"compress_hook: gradients are {tensor.dtype}; the 16-bit wire is for float32")
        work = RedsockWork("compress_hook", cuda_devices([tensor]))
        if tensor.is_cuda:
            staged, array = _round_on_device(tensor, bucket.index())
        else:
            staged = Staged(tensor, read=True, write=True, what="compress_hook")
            array = staged.array
            _round_on_host(array, bucket.index())
        part = state.comm.all_reduce(array, "avg", async_op=True, wire_dtype=wire_np).get_future()

        def finish() -> torch.Tensor:
            if tensor.is_cuda:
                copy_into(tensor, torch.from_numpy(array).view(tensor.shape))
            else:
                staged.finish()
            return tensor

        state.tracker.complete_when_done(work, [part], finish, keep=staged)
        return work.get_future()

    def _kept(index: int, like: Any, make: Any) -> Any:
        """The bucket's residual buffer (a new zeroed one when the bucket is new or changed:
        DDP rebuilds its buckets after the first step)."""
        kept = residuals.get(index)
        if kept is None or kept.shape != like.shape or (isinstance(like, torch.Tensor) and kept.device != like.device):
            kept = residuals[index] = make()
        return kept

    def _round_on_host(array: np.ndarray, index: int) -> None:
        """``array`` (the bucket, in place) plus its residual, rounded once to the wire and
        widened back, so the all-reduce's own rounding of it is exact; the residual kept.
        numpy and ml_dtypes: a pass each, several times faster than torch's casts on the CPU."""
        low = lows.get(index)
        if low is None or low.size != array.size:
            low = lows[index] = np.empty(array.size, wire_np)
        if error_feedback:
            kept = _kept(index, array, lambda: np.zeros_like(array))
            np.add(array, kept, out=array)
            ops.to_wire(array, low)
            ops.from_wire(low, kept)
            np.subtract(array, kept, out=kept)  # what the rounding took, for the next step
        else:
            ops.to_wire(array, low)
        ops.from_wire(low, array)

    def _round_on_device(tensor: torch.Tensor, index: int) -> tuple[Staged, np.ndarray]:
        """Rounded on the GPU (the residual stays there), 16 bits to the host, widened there."""
        if error_feedback:
            tensor.add_(_kept(index, tensor, lambda: torch.zeros_like(tensor)))
        low = tensor.to(low_dtype)
        if error_feedback:
            torch.sub(tensor, low, out=residuals[index])
        staged = Staged(low, read=True, write=False, what="compress_hook")
        sync_devices([low])
        array = np.empty(tensor.numel(), np.float32)
        ops.from_wire(staged.array, array)
        return staged, array

    hook.__name__ = hook.__qualname__ = f"compress_hook_{name}{'_ef' if error_feedback else ''}"
    return hook
