"""redsock: fast multi-stream TCP transport and CPU reduction server for gradient aggregation."""

from .config import Config
from .errors import (
    AuthError,
    ConfigError,
    PeerFailure,
    ProtocolError,
    RedsockError,
    Timeout,
    TransportError,
)

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so `import redsock` stays cheap (no numpy/torch import for `redsock --help`).
    if name == "init":
        from .api import init
        return init
    if name == "Communicator":
        from .collectives import Communicator
        return Communicator
    raise AttributeError(name)

__all__ = [
    "init", "Communicator", "AuthError", "Config", "ConfigError", "PeerFailure", "ProtocolError",
    "RedsockError", "Timeout", "TransportError", "__version__",
]
