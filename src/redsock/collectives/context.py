"""What an algorithm sees of the communicator while it runs one collective call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..bootstrap import PeerTable
from ..transport import Handle


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


def flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)
