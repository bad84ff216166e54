"""Fast Socket: a multi-stream TCP transport (control stream + K data streams per connection)."""

from .connection import Connection, Handle, as_bytes, irecv_any
from .endpoint import Listener, connect

__all__ = ["Connection", "Handle", "Listener", "as_bytes", "connect", "irecv_any"]
