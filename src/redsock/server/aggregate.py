"""Summing pieces: the server's arithmetic and bookkeeping, with no sockets.

A :class:`Round` is one all-reduce call of one job as this server sees it; it
owns a :class:`Piece` per piece assigned to the server.  Each piece collects
one contribution per rank and, once it has all of them, yields the reduced
piece (in the workers' dtype) to send back.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .. import ops
from ..errors import ProtocolError


class BufferPool:
    """Reusable byte buffers in power-of-two size classes, so steady-state rounds of any mix
    of sizes allocate nothing and the server's resident memory stays flat."""

    def __init__(self, keep_bytes: int = 64 << 20):
        self._free: dict[int, list[np.ndarray]] = {}
        self._kept = 0
        self._keep = keep_bytes
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array of exactly ``nbytes`` (a view of a pooled buffer)."""
        size = 1 << max(12, (nbytes - 1).bit_length())
        with self._lock:
            bucket = self._free.get(size)
            if bucket:
                self._kept -= size
                return bucket.pop()[:nbytes]
        return np.empty(size, np.uint8)[:nbytes]

    def give(self, buf: np.ndarray) -> None:
        """Return a buffer (or any view of one) that came from :meth:`take`; a view of
        memory the pool does not own (a record's payload, read in place) is left alone."""
        while isinstance(buf.base, np.ndarray):
            buf = buf.base
        if buf.base is not None:
            return
        with self._lock:
            if self._kept + buf.nbytes <= self._keep:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._kept += buf.nbytes


@dataclass
class Piece:
    """One piece of one round: contributions in, one reduced piece out."""

    dtype: np.dtype
    count: int
    world: int
    op: ops.ReduceOp
    ordered: bool  # combine in rank order (bitwise repeatable from run to run)
    pool: BufferPool
    acc: np.ndarray | None = None
    arrived: int = 0
    next_rank: int = 0  # ordered mode: the next rank to combine
    waiting: dict[int, np.ndarray] = field(default_factory=dict)  # ordered mode: arrived early
    ranks_in: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.nbytes = self.count * self.dtype.itemsize
        # Contributions combine with one ufunc call when they need no widening (a small
        # piece's whole cost is a few such calls); 16-bit ones go through ops.combine.
        self._ufunc = ops.ufunc_of(self.op) if ops.accum_dtype(self.dtype) == self.dtype else None

    def add(self, rank: int, contribution: np.ndarray, borrowed: bool = False) -> np.ndarray | None:
        """Combine ``contribution`` (``nbytes`` bytes: a pooled buffer, now owned by the piece;
        or, ``borrowed``, memory valid during the call only) from ``rank``.

        Returns the reduced piece (a pooled buffer in the workers' dtype) once every rank
        has contributed, else None.
        """
        with self.lock:
            if rank in self.ranks_in:
                raise ProtocolError(f"rank {rank} contributed to the same piece twice")
            self.ranks_in.add(rank)
            self.arrived += 1
            if not self.ordered:
                self._combine(contribution, borrowed)
            else:
                if borrowed and rank != self.next_rank:  # kept until its turn: copied
                    own = self.pool.take(self.nbytes)
                    own[:] = contribution
                    contribution, borrowed = own, False
                self.waiting[rank] = contribution
                while self.next_rank in self.waiting:
                    self._combine(self.waiting.pop(self.next_rank), borrowed and self.next_rank == rank)
                    self.next_rank += 1
            if self.arrived < self.world:
                return None
            acc, self.acc = self.acc, None
            assert acc is not None
            if acc.dtype == self.dtype and self.op is not ops.ReduceOp.AVG:
                return acc.view(np.uint8)  # already the result: finalize would copy it onto itself
            out_buf = self.pool.take(self.nbytes)
            ops.finalize(acc, self.op, self.world, out_buf.view(self.dtype))
            self.pool.give(acc)
            return out_buf

    def _combine(self, buf: np.ndarray, borrowed: bool) -> None:
        x = buf.view(self.dtype)
        if self.acc is None:
            if self._ufunc is None:  # 16-bit contributions: widened into the accumulator
                wide = ops.accum_dtype(self.dtype)
                self.acc = ops.init_acc(x, self.pool.take(self.count * wide.itemsize).view(wide))
            elif borrowed:
                self.acc = self.pool.take(self.nbytes).view(self.dtype)
                ops.copy(self.acc, x)
            else:
                self.acc = x  # the first contribution becomes the accumulator: no copy
                return
        elif self._ufunc is not None:
            self._ufunc(self.acc, x, out=self.acc)
        else:
            ops.combine(self.acc, x, self.op)
        if not borrowed:
            self.pool.give(buf)

    def release(self) -> None:
        """Give back what an aborted piece holds."""
        with self.lock:
            for buf in self.waiting.values():
                self.pool.give(buf)
            self.waiting.clear()
            if self.acc is not None:
                self.pool.give(self.acc)
                self.acc = None


@dataclass
class Round:
    """One all-reduce call of one job at this server."""

    job: int
    op_seq: int
    world: int
    signature: tuple  # what every rank must agree on
    pieces: dict[int, Piece]
    started: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)
    contributors: set[int] = field(default_factory=set)  # ranks that announced it
    done_pieces: int = 0
    # How long the round may go without progress: the shortest of this server's timeout and
    # those its workers announced (each waits that long for its results).
    timeout_s: float = float("inf")

    def missing_ranks(self) -> list[int]:
        """Ranks that have not announced the round, or are behind the others on a piece.

        A piece that nobody has sent names nobody: past the credit window every rank waits
        for results that need the missing one, so blaming its absentees blames everyone."""
        everyone = set(range(self.world))
        missing = everyone - self.contributors
        for piece in self.pieces.values():
            if 0 < piece.arrived < self.world:
                missing |= everyone - piece.ranks_in
        return sorted(missing)
