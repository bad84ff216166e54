"""``redsock.init()``: a Communicator from the torchrun environment or explicit arguments."""

from __future__ import annotations

import os
from typing import Any

from .bootstrap import store_from_env
from .collectives import Communicator
from .config import Config
from .errors import ConfigError


def init(rank: int | None = None, world_size: int | None = None, store: Any = None, *,
         config: Config | None = None, namespace: str | None = None, **options: Any) -> Communicator:
    """Create a Communicator.

    Without arguments it reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` (as torchrun sets them) and bootstraps through the
    ``torch.distributed.TCPStore`` there.  ``store`` may be any object with
    ``set(key, value)`` and a blocking ``get(key)``.  Other keyword arguments are
    options (``nsocks=8``, ``algo="ring"``, ...) that override ``REDSOCK_*``.
    ``namespace`` separates communicators that share a store when not every rank
    creates the same sequence of them (see :class:`redsock.bootstrap.PeerTable`).
    """
    env = os.environ
    try:
        rank = int(env["RANK"]) if rank is None else rank
        world_size = int(env["WORLD_SIZE"]) if world_size is None else world_size
    except KeyError as e:
        raise ConfigError(f"{e.args[0]} is not set: run under torchrun or pass rank= and world_size=") from None
    except ValueError as e:
        raise ConfigError(f"RANK/WORLD_SIZE must be integers: {e}") from None
    config = config.replace(**options) if config is not None else Config.from_env(**options)
    if store is None:
        store = store_from_env(rank, world_size, config.timeout_s)
    return Communicator(rank, world_size, store, config, namespace=namespace,
                        advertise_toward=env.get("MASTER_ADDR"))
