"""What an algorithm sees of the communicator while it runs one collective call."""

from __future__ import annotations

import contextvars
import functools
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..bootstrap import PeerTable
from ..transport import Handle

#: A deadline for the calls started in this context (seconds), instead of the communicator's.
_CALL_TIMEOUT: contextvars.ContextVar[float | None] = contextvars.ContextVar("redsock_call_timeout_s", default=None)


class call_timeout:  # noqa: N801 - used as a function: ``with call_timeout(s):``
    """Collectives started inside ``with call_timeout(s):`` fail with
    :class:`~redsock.errors.Timeout` when any of their waits makes no progress for ``s``
    seconds (as the communicator's ``timeout_s`` does for every other call, and as gloo
    applies a per-call timeout).  ``None`` or a value <= 0: the communicator's own.

    A class, not a generator: the torch backend enters one per operation, and a
    ``contextlib.contextmanager`` costs a small call about 2 us more."""

    __slots__ = ("_seconds", "_token")

    def __init__(self, seconds: float | None):
        self._seconds = seconds if seconds is not None and seconds > 0 else None

    def __enter__(self) -> None:
        self._token = _CALL_TIMEOUT.set(self._seconds)

    def __exit__(self, *exc: object) -> None:
        _CALL_TIMEOUT.reset(self._token)


def timeout_for_call(default_s: float) -> float:
    """The deadline of a call started now: :func:`call_timeout`'s, else ``default_s``."""
    return _CALL_TIMEOUT.get() or default_s


#: What an algorithm may leave to do after it returns: wait for its last results (the
#: communicator runs it on its drain thread, so the next call can start meanwhile).
Finish = Callable[[], None]


class ScratchPool:
    """Reusable receive buffers.  A fresh np.empty of tens of MiB costs a page fault
    per 4 KiB on first touch — more than the copy into it — so buffers are kept."""

    def __init__(self, keep: int = 4):
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._keep = keep

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:  # (by index: list.remove would compare arrays elementwise)
                return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        return np.empty(max(nbytes, 1), np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self._keep:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].nbytes))


@dataclass
class CallContext:
    """One collective call: who I am, a tag no other call uses, and the call's signature.

    Every message of the call carries ``tag`` (so concurrent calls never mix) and
    ``check`` (so ranks that called different collectives, dtypes or sizes fail
    with a clear error instead of reducing mismatched bytes).
    """

    peers: PeerTable
    rank: int
    world: int
    tag: int
    check: int
    timeout_s: float
    pool: ScratchPool = field(default_factory=ScratchPool)
    seq: int = 0  # the call's number (the same on every rank)
    servers: Any = None  # the rank's ServerGroup, when reduction servers are configured
    taken: list[np.ndarray] = field(default_factory=list)

    def scratch(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A temporary array for this call, returned to the pool by :meth:`release`."""
        buf = self.pool.take(count * np.dtype(dtype).itemsize)
        self.taken.append(buf)
        return buf[: count * np.dtype(dtype).itemsize].view(dtype)

    def release(self) -> None:
        for buf in self.taken:
            self.pool.give(buf)
        self.taken.clear()

    def isend(self, peer: int, buf: Any) -> Handle:
        return self.peers.get(peer).isend(buf, self.tag, self.check)

    def irecv(self, peer: int, buf: Any) -> Handle:
        return self.peers.get(peer).irecv(buf, self.tag, self.check)

    def wait(self, handle: Handle) -> None:
        handle.wait(self.timeout_s)

    def wait_all(self, handles: list[Handle]) -> None:
        for h in handles:
            h.wait(self.timeout_s)


def partition(n: int, parts: int) -> list[tuple[int, int]]:
    """``n`` elements in ``parts`` contiguous ranges, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def chunks(start: int, end: int, per_chunk: int) -> list[tuple[int, int]]:
    """Split [start, end) into pieces of at most ``per_chunk`` elements (one empty piece if empty)."""
    if end <= start:
        return [(start, start)]
    return [(s, min(s + per_chunk, end)) for s in range(start, end, per_chunk)]


def ramped_chunks(start: int, end: int, largest: int, smallest: int) -> list[tuple[int, int]]:
    """Split [start, end) into pieces that double from ``smallest`` up to ``largest`` elements
    and halve back down at the end (the middle in equal pieces of at most ``largest``): a
    pipeline then fills and drains on small pieces and runs on large ones."""
    n = end - start
    ramp: list[int] = []
    size = smallest
    while size < largest and 2 * (sum(ramp) + size) <= n:  # a ramp up and one down both fit
        ramp.append(size)
        size *= 2
    middle = n - 2 * sum(ramp)
    body = [b - a for a, b in partition(middle, -(-middle // largest))] if middle else []
    bounds, lo = [], start
    for size in ramp + body + ramp[::-1]:
        bounds.append((lo, lo + size))
        lo += size
    return bounds or [(start, start)]


@functools.lru_cache(maxsize=4096)
def signature_check(name: str, signature: tuple) -> int:
    """16 bits every message of a call carries; ranks that disagree on the call differ here."""
    return zlib.crc32(repr((name, *[str(s) for s in signature])).encode()) & 0xFFFF


def flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)
