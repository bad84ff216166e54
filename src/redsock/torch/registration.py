"""Registering ``redsock`` with ``torch.distributed`` — cheap, and safe inside ``import torch``.

torch (2.4+, checked against 2.13) runs every ``torch.backends`` entry point near
the end of ``torch/__init__.py`` (``_import_device_backends``), after
``torch.distributed`` has been imported; an exception there makes ``import torch``
itself fail.  So :func:`autoload` (the entry point) only registers a creator
function — numpy, the transport and the process group are imported the first
time a group is created — and it logs, never raises.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..errors import ConfigError
from .name import BACKEND_NAME

__all__ = ["autoload", "register"]

log = logging.getLogger("redsock.torch")
_lock = threading.Lock()
_registered = False


def register() -> None:
    """Make ``dist.init_process_group("redsock")`` / ``new_group(backend="redsock")`` work.

    Idempotent.  Raises :class:`ConfigError` when this torch build has no
    ``torch.distributed``.
    """
    global _registered
    import torch.distributed as dist

    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed: the redsock backend cannot register")
    with _lock:
        if _registered:
            return
        # extended_api: the creator also gets the group's name and global ranks (for names
        # in errors and logs) and the pg_options passed to init_process_group/new_group.
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
        _registered = True


def autoload() -> None:
    """The ``torch.backends`` entry point: register, and never break ``import torch``."""
    try:
        register()
    except Exception:  # any failure here would surface as "import torch" failing
        log.warning("redsock: could not register the torch.distributed backend "
                    "(call redsock.torch.register() to see the error)", exc_info=True)


def _create(dist_opts: Any, pg_options: Any) -> Any:
    from .backend import create_process_group  # heavy imports only when a group is made

    return create_process_group(dist_opts, pg_options)
