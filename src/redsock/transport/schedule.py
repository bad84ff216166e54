"""Which data stream sends which slice of which message (no I/O).

Streams *pull* work: a stream's sender thread asks for its next slice only once
the kernel has taken the previous one (and, with ``TCP_NOTSENT_LOWAT``, nearly
sent it).  So a slow stream is simply a stream that asks less often — the
dynamic balancing of Fast Socket, where a socket with a full queue is skipped.

* :class:`DynamicSchedule` — one shared FIFO of messages; every stream takes
  the next slice of the oldest unfinished message.  Slices are ``chunk`` bytes,
  or smaller so that each stream gets several of every message (see
  :meth:`DynamicSchedule.slice_bytes`): balancing needs more slices than streams.
* :class:`StaticSchedule` — what NCCL's socket transport does: each message is
  split into at most one equal piece per stream (>= 64 KiB), stream *i* sends
  piece *i*; the message finishes when the slowest piece does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

STATIC_MIN_PIECE = 64 * 1024
MIN_SLICE = 64 * 1024
SLICES_PER_STREAM = 4


@dataclass(eq=False)
class SendJob:
    """A message on its way out over the data streams."""

    tag: int
    seq: int
    view: memoryview
    handle: Any = None  # completed by the connection once every slice is out
    check: int = 0
    next_offset: int = 0
    done_bytes: int = 0
    writing: int = 0  # slices a stream thread is writing now: their outcome is the thread's to report

    @property
    def total(self) -> int:
        return self.view.nbytes


@dataclass
class Slice:
    job: SendJob
    offset: int
    length: int


class DynamicSchedule:
    def __init__(self, nstreams: int, chunk: int):
        self.nstreams, self.chunk = nstreams, chunk
        self._jobs: deque[SendJob] = deque()

    def add(self, job: SendJob) -> None:
        self._jobs.append(job)

    def next_slice(self, stream: int) -> Slice | None:
        if not self._jobs:
            return None
        job = self._jobs[0]
        off = job.next_offset
        n = min(self.slice_bytes(job.total), job.total - off)
        job.next_offset = off + n
        if job.next_offset >= job.total:
            self._jobs.popleft()
        return Slice(job, off, n)

    def has_work(self, stream: int | None = None) -> bool:
        """Whether ``stream`` (None: any stream) has a slice to take."""
        return bool(self._jobs)

    def slice_bytes(self, total: int) -> int:
        """``chunk``, or smaller so that every stream gets SLICES_PER_STREAM slices of the
        message (>= MIN_SLICE): a stream that falls behind then only delays a small slice
        while the others take the rest, instead of holding up a large share of the message."""
        if self.nstreams == 1:  # nothing to balance: fewer, larger slices cost fewer system calls
            return self.chunk
        return min(self.chunk, max(MIN_SLICE, -(-total // (self.nstreams * SLICES_PER_STREAM))))

    def drain(self) -> list[SendJob]:
        jobs = list(self._jobs)
        self._jobs.clear()
        return jobs


@dataclass
class _Piece:
    job: SendJob
    cursor: int
    end: int


class StaticSchedule:
    def __init__(self, nstreams: int, chunk: int):
        self.nstreams, self.chunk = nstreams, chunk
        self._queues: list[deque[_Piece]] = [deque() for _ in range(nstreams)]
        self._rr = 0  # messages too small for every stream start on the next one

    def add(self, job: SendJob) -> None:
        pieces = max(1, min(self.nstreams, job.total // STATIC_MIN_PIECE))
        size = -(-job.total // pieces)
        for i in range(pieces):
            start, end = i * size, min(job.total, (i + 1) * size)
            if start < end:
                self._queues[(self._rr + i) % self.nstreams].append(_Piece(job, start, end))
        self._rr = (self._rr + pieces) % self.nstreams

    def next_slice(self, stream: int) -> Slice | None:
        q = self._queues[stream]
        if not q:
            return None
        piece = q[0]
        off = piece.cursor
        n = min(self.chunk, piece.end - off)
        piece.cursor = off + n
        if piece.cursor >= piece.end:
            q.popleft()
        return Slice(piece.job, off, n)

    def has_work(self, stream: int | None = None) -> bool:
        return any(self._queues) if stream is None else bool(self._queues[stream])

    def drain(self) -> list[SendJob]:
        jobs = {id(p.job): p.job for q in self._queues for p in q}
        for q in self._queues:
            q.clear()
        return list(jobs.values())


def make_schedule(balance: str, nstreams: int, chunk: int) -> DynamicSchedule | StaticSchedule:
    return (StaticSchedule if balance == "static" else DynamicSchedule)(nstreams, chunk)
