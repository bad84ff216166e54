"""The ``redsock`` backend for ``torch.distributed``, and a DDP communication hook.

``import redsock.torch`` registers the backend; so does ``import torch`` on its own
when redsock is installed (the ``torch.backends`` entry point).  Then::

    dist.init_process_group("redsock")            # torchrun env; REDSOCK_* options apply
    model = DDP(model)                              # gradients all-reduced by redsock

or keep another backend and send only gradient buckets through redsock::

    state = redsock.torch.HookState.from_process_group(dist.group.WORLD)
    model.register_comm_hook(state, redsock.torch.allreduce_hook)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

try:
    import torch  # noqa: F401 - (inside torch's own autoload this is the module being initialised)
except ImportError as e:
    raise ImportError("redsock.torch needs PyTorch: pip install 'redsock[torch]'") from e

from .name import BACKEND_NAME
from .registration import autoload, register

if TYPE_CHECKING:
    from .backend import Options, ProcessGroupRedsock
    from .hooks import HookState, allreduce_hook

# Explicit `import redsock.torch` registers too.  It logs instead of raising because this
# package is also what torch's autoload imports, inside `import torch`.
autoload()

_LAZY = {"ProcessGroupRedsock": "backend", "Options": "backend", "HookState": "hooks",
         "allreduce_hook": "hooks"}


def __getattr__(name: str) -> Any:
    # Lazy, so the autoload entry point stays cheap (no numpy/transport import at `import torch`).
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'redsock.torch' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{module}", __name__), name)


__all__ = ["BACKEND_NAME", "HookState", "Options", "ProcessGroupRedsock", "allreduce_hook", "autoload",
           "register"]
