"""A DDP communication hook that sends gradient buckets through redsock.

For jobs that keep another backend (gloo, nccl) for everything else::

    dist.init_process_group("gloo")
    model = DDP(model)
    state = redsock.torch.HookState.from_process_group()      # a redsock Communicator for the same ranks
    model.register_comm_hook(state, redsock.torch.allreduce_hook)

The hook averages (sum, then divide by the world size), like DDP's default.
"""

# No `from __future__ import annotations` here: DDP compares allreduce_hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] as objects, not strings.

import itertools
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..api import init as redsock_init
from ..collectives import Communicator
from ..errors import ConfigError
from .backend import ProcessGroupRedsock, new_communicator
from .bridge import Staged, cuda_devices, sync_devices
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
