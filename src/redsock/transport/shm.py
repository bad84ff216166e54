"""Shared memory among the ranks of one host: an arena of step counters and data regions.

One local rank creates a file in /dev/shm, every local rank maps it, and the creator unlinks
it as soon as all have attached: from then on the memory lives only in the mappings, so no
exit (normal, exception or kill -9) leaves anything behind.

Layout: a header with one cache line per local rank (its step counter and the signature of
its current call) and a failure note, then two halves of ``region_bytes`` per local rank
(a collective alternates between the halves, so a rank may write its next piece while its
peers still read the previous one).

Synchronisation is by step counters: :meth:`LocalGroup.sync` sets this rank's counter to the
next step and waits until every local rank's counter has reached it.  Waiting spins briefly,
then blocks in ``poll`` on an abstract-namespace datagram socket (a peer that arrives sends a
wake-up to each of the others; a wake-up queued after the counters were checked still ends
the poll, so none is lost) and on a pidfd of every peer (a peer that dies wakes the waiters
at once and becomes :class:`PeerFailure` naming it).  Counters and data are plain stores on
x86's total store order: data first, then the counter.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import select
import socket
import time
from typing import Any

import numpy as np

from ..errors import PeerFailure, ProtocolError, Timeout, TransportError

ARENA_DIR = "/dev/shm"
ARENA_PREFIX = "redsock-"
# One 64-byte cache line per local rank: [step, signature at odd steps, at even steps, unused...]
# (a rank may run one step ahead of a slower peer, which must still read its signature).
_LINE_WORDS = 8
MAX_LOCAL_RANKS = 48
_FAIL_WORD = MAX_LOCAL_RANKS * _LINE_WORDS  # 1 once a rank wrote its failure note
_NOTE_LEN_WORD = _FAIL_WORD + 1
_NOTE_OFFSET = (_NOTE_LEN_WORD + 1) * 8
HEADER_BYTES = 4096
_NOTE_MAX = HEADER_BYTES - _NOTE_OFFSET


def available() -> bool:
    """Whether this system can run the transport (Linux with pidfds and /dev/shm)."""
    return hasattr(os, "pidfd_open") and os.path.isdir(ARENA_DIR)


class LocalGroup:
    """The shared arena of the ranks of one host (``ranks``: their global ranks, in local order).

    Raises :class:`TransportError` if the arena cannot be created or attached,
    :class:`PeerFailure` when a local peer dies, :class:`Timeout` when one does not arrive
    within ``timeout_s``.
    """

    def __init__(self, store: Any, key: str, ranks: tuple[int, ...], local_rank: int, pids: tuple[int, ...],
                 *, region_bytes: int, timeout_s: float, spin_us: int):
        if len(ranks) > MAX_LOCAL_RANKS:
            raise TransportError(f"{len(ranks)} ranks on one host: shared memory takes at most "
                                 f"{MAX_LOCAL_RANKS} (set REDSOCK_SHM=off)", op="shared-memory attach")
        self.ranks, self.me, self.size = ranks, local_rank, len(ranks)
        self.region_bytes = -(-region_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.timeout_s, self.spin_s = timeout_s, spin_us / 1e6
        self.step = 0  # the last step this rank arrived at (the same sequence on every local rank)
        self._half = 0
        self._closed = False
        nbytes = HEADER_BYTES + 2 * self.size * self.region_bytes
        self._mm, path = self._map(store, key, nbytes)
        self._words = memoryview(self._mm)[:HEADER_BYTES].cast("Q")
        self._bytes = np.frombuffer(self._mm, np.uint8)
        token = os.path.basename(path)
        self._addrs = [f"\0{token}-{lr}".encode() for lr in range(self.size)]
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        self._pidfds: dict[int, int] = {}
        try:
            self._sock.bind(self._addrs[self.me])
            self._poll = select.poll()
            self._poll.register(self._sock, select.POLLIN)
            for lr, pid in enumerate(pids):
                if lr != self.me:
                    try:
                        fd = os.pidfd_open(pid)
                    except ProcessLookupError:
                        raise PeerFailure(f"rank {ranks[lr]} (pid {pid}) exited before attaching shared memory",
                                          ranks=(ranks[lr],)) from None
                    self._pidfds[fd] = lr
                    self._poll.register(fd, select.POLLIN)
            self.sync()  # every rank bound its socket before anyone waits on it
        except BaseException:
            self.close()
            raise

    def _map(self, store: Any, key: str, nbytes: int) -> tuple[mmap.mmap, str]:
        """Create (local rank 0) or attach the arena; the creator unlinks it once all attached."""
        try:
            if self.me == 0:
                path = os.path.join(ARENA_DIR, f"{ARENA_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    os.ftruncate(fd, nbytes)
                    mm = mmap.mmap(fd, nbytes)
                    store.set(key, path)
                    for lr in range(1, self.size):
                        store.get(f"{key}/attached/{lr}")
                finally:
                    os.close(fd)
                    os.unlink(path)
                return mm, path
            value = store.get(key)
            path = value.decode() if isinstance(value, bytes) else str(value)
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            try:
                mm = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
            store.set(f"{key}/attached/{self.me}", "1")
            return mm, path
        except OSError as e:
            raise TransportError(f"rank {self.ranks[self.me]}: shared memory of size {nbytes}: {e.strerror or e} "
                                 f"(set REDSOCK_SHM=off to go without)", op="shared-memory attach") from e
        except Exception as e:  # the store timed out: a local peer never came
            raise PeerFailure(f"rank {self.ranks[self.me]}: a rank of this host never attached the shared "
                              f"memory: {e}", ranks=()) from e

    # -- data --------------------------------------------------------------------------

    def next_half(self) -> int:
        """The half of every region the next piece goes through (all local ranks alternate alike)."""
        self._half ^= 1
        return self._half

    def region(self, local_rank: int, half: int, dtype: np.dtype, count: int) -> np.ndarray:
        """``count`` elements of ``local_rank``'s region (one half), viewed as ``dtype``."""
        off = HEADER_BYTES + (2 * local_rank + half) * self.region_bytes
        return self._bytes[off:off + count * dtype.itemsize].view(dtype)

    # -- synchronisation ---------------------------------------------------------------

    def sync(self, signature: int | None = None) -> None:
        """Arrive at the next step and wait for every local rank to arrive there too.

        With ``signature`` (the call's, nonzero), check that every local rank arrived in
        the same call: a mismatch raises :class:`ProtocolError` on every rank alike.
        """
        self.step += 1
        w = self._words
        sig_word = 1 + self.step % 2
        if signature is not None:
            w[self.me * _LINE_WORDS + sig_word] = signature
        w[self.me * _LINE_WORDS] = self.step
        for lr, addr in enumerate(self._addrs):
            if lr != self.me:
                try:
                    self._sock.sendto(b"!", addr)
                except OSError:  # a full queue already holds a wake-up; a dead peer's pidfd speaks
                    pass
        self._wait(self.step)
        if signature is not None:
            others = {w[lr * _LINE_WORDS + sig_word] for lr in range(self.size)}
            if len(others) > 1:
                raise ProtocolError(f"rank {self.ranks[self.me]}: the ranks of this host called different "
                                    "collectives (the ranks called different collectives, or with different "
                                    "dtype, size or op)", peer="local ranks", op="shared-memory collective")

    def _missing(self, step: int) -> list[int]:
        w = self._words
        return [lr for lr in range(self.size) if w[lr * _LINE_WORDS] < step]

    def _arrived(self, step: int) -> bool:
        w = self._words
        for lr in range(self.size):
            if w[lr * _LINE_WORDS] < step:
                return False
        return True

    def _wait(self, step: int) -> None:
        if self._arrived(step):
            return
        now = time.monotonic()
        spin_end, deadline = now + self.spin_s, now + self.timeout_s
        while time.monotonic() < spin_end:
            if self._arrived(step):
                return
        while True:
            while True:  # drain wake-ups: one queued after the check below still ends the poll
                try:
                    self._sock.recv(16)
                except BlockingIOError:
                    break
                except OSError as e:
                    if e.errno != errno.EINTR:
                        raise TransportError(f"shared-memory wake-up socket: {e.strerror}",
                                             op="shared-memory wait") from e
            self._check_failure()
            if self._arrived(step):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [self.ranks[lr] for lr in self._missing(step)]
                raise Timeout(f"rank {self.ranks[self.me]}: local rank(s) {missing} did not arrive at a "
                              f"shared-memory step within {self.timeout_s:g}s",
                              peer=f"rank {missing[0]}", op="shared-memory wait")
            for fd, _ in self._poll.poll(max(1, int(left * 1000))):
                if fd in self._pidfds and not self._arrived(step):
                    dead = self.ranks[self._pidfds[fd]]
                    raise PeerFailure(f"rank {dead} died (its process exited) during a shared-memory "
                                      f"collective", ranks=(dead,))

    # -- failure and shutdown ------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Tell every local rank that this one gives up (their waits raise with ``reason``)."""
        if self._closed:
            return
        note = reason.encode(errors="replace")[:_NOTE_MAX]
        if not self._words[_FAIL_WORD]:
            self._mm[_NOTE_OFFSET:_NOTE_OFFSET + len(note)] = note
            self._words[_NOTE_LEN_WORD] = len(note)
            self._words[_FAIL_WORD] = 1
        for lr, addr in enumerate(self._addrs):
            if lr != self.me:
                try:
                    self._sock.sendto(b"!", addr)
                except OSError:
                    pass

    def _check_failure(self) -> None:
        if self._words[_FAIL_WORD]:
            n = self._words[_NOTE_LEN_WORD]
            note = bytes(self._mm[_NOTE_OFFSET:_NOTE_OFFSET + n]).decode(errors="replace")
            raise TransportError(note, peer="local ranks", op="shared-memory wait")

    def close(self) -> None:
        """Unmap the arena and close the sockets.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "_sock"):
            self._sock.close()
        for fd in getattr(self, "_pidfds", {}):
            os.close(fd)
        self._pidfds = {}
        if hasattr(self, "_words"):
            self._words.release()
            del self._bytes
            try:
                self._mm.close()
            except BufferError:  # a view is still referenced somewhere: the mapping goes with it
                pass
