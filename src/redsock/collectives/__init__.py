"""Collectives on numpy arrays: ring, latency-optimised and (with servers) reduction-server all-reduce."""

from .communicator import ALLREDUCE_ALGORITHMS, Communicator, Work
from .context import call_timeout

__all__ = ["ALLREDUCE_ALGORITHMS", "Communicator", "Work", "call_timeout"]
