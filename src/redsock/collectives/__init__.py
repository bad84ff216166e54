"""Collectives on numpy arrays: ring, latency-optimised and (with servers) reduction-server all-reduce."""

from .communicator import ALLREDUCE_ALGORITHMS, Communicator, Work

__all__ = ["ALLREDUCE_ALGORITHMS", "Communicator", "Work"]
