"""The reduction server: a CPU-only daemon that sums gradient pieces for workers."""

from .daemon import ReductionServer

__all__ = ["ReductionServer"]
