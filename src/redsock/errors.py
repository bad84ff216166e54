"""One exception hierarchy for everything redsock raises.

Socket-level ``OSError``s are translated into these at one boundary
(:func:`redsock.transport.streams.translate_oserror`), always naming the peer
and the operation so that a failure in a 16-rank job says *who* and *what*.
"""

from __future__ import annotations


class RedsockError(Exception):
    """Base class of every error raised by redsock."""


class ConfigError(RedsockError, ValueError):
    """Bad option value, bad argument or unusable environment."""


class TransportError(RedsockError):
    """A connection failed: the peer closed, reset or could not be reached."""

    def __init__(self, message: str, *, peer: str | None = None, op: str | None = None):
        super().__init__(message)
        self.peer = peer
        self.op = op


class Timeout(TransportError):
    """An operation made no progress within its deadline (``REDSOCK_TIMEOUT_S``)."""


class ProtocolError(TransportError):
    """The peer sent bytes that do not follow the redsock wire format."""


class AuthError(ProtocolError):
    """The peer failed (or refused) the shared-secret challenge."""


class PeerFailure(RedsockError):
    """A collective could not complete because one or more ranks failed.

    ``ranks`` holds the ranks known to have failed (may be empty when unknown).
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)


class WireOverflow(RedsockError, ArithmeticError):
    """A float32 all-reduce on the fp16 wire produced a value fp16 cannot hold (beyond
    65504: an input, or the sum rounded for the way back), or an input was not finite.

    Raised on every rank alike (they hold the same bits); the result is written anyway and
    ``count`` says how many elements are not finite.  The bf16 wire has float32's range.
    """

    def __init__(self, message: str, *, count: int = 0):
        super().__init__(message)
        self.count = count
