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

__all__ = [
    "AuthError", "Config", "ConfigError", "PeerFailure", "ProtocolError",
    "RedsockError", "Timeout", "TransportError", "__version__",
]
