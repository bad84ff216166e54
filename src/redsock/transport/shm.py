"""Shared memory among the ranks of one host: an arena of step counters and data regions.

One local rank creates a file in /dev/shm, every local rank maps it, and the creator unlinks
it as soon as all have attached: from then on the memory lives only in the mappings, so no
exit (normal, exception or kill -9) leaves anything behind.

Layout: a header with one cache line per local rank (its step counter and the signature of
its current call) and a failure note, then, from half a page further (``DATA_SKEW``), two
halves of ``region_bytes`` per local rank (a collective alternates between the halves, so a
rank may write its next piece while its peers still read the previous one), then one region
of ``region_bytes`` for a result any rank may leave for the others (:meth:`LocalGroup.result`).

Synchronisation is by step counters: :meth:`LocalGroup.sync` sets this rank's counter to the
next step and waits until every local rank's counter has reached it.  Waiting spins briefly,
yielding the CPU, then blocks in a futex on the counter of a peer that has not arrived (the
kernel compares the counter with the value seen and sleeps in one step; a sleeper first
says whose counter it sleeps on, and an arriving rank wakes the futex only when someone
sleeps on its counter: one wake-up per sleeper instead of one system call per rank and step).  Every ``DEATH_CHECK_S`` of sleep, and on
every wake-up, a waiter polls the pidfds of its peers: one that died becomes
:class:`PeerFailure` naming it.  Counters and data are plain stores on x86's total store
order: data first, then the counter.

Large buffers need not pass through the arena: with cross-memory attach (Linux
``process_vm_readv``/``writev``, which the kernel allows between processes of one user unless
ptrace is restricted, as in some containers) a rank publishes its buffer's address in its
line and its peers copy straight from and to it (:meth:`LocalGroup.read_from`,
:meth:`LocalGroup.write_to`), one copy where the arena takes two.  Whether every local rank
may do so is probed once at attach (:attr:`LocalGroup.cma`).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import secrets
import select
import threading
import time
from typing import Any

import numpy as np

from ..errors import PeerFailure, ProtocolError, Timeout, TransportError
from .connection import RELAY_GRACE_S

ARENA_DIR = "/dev/shm"
ARENA_PREFIX = "redsock-"
# One 64-byte cache line per local rank: [step, signature at odd steps, at even steps,
# 1 + the local rank whose counter this rank sleeps on (0: awake), the address of its buffer
# in the current call (cross-memory attach), its probe token, its probe's outcome, and one
# word of a table any rank may write for the others (:meth:`LocalGroup.tell`)]
# (a rank may run one step ahead of a slower peer, which must still read its signature).
_LINE_WORDS = 8
_SLEEP, _ADDR, _TOKEN, _CMA_OK, _TOLD = 3, 4, 5, 6, 7
MAX_LOCAL_RANKS = 48
#: Slots of the table of :meth:`LocalGroup.tell` (one word in each rank's line, whether a rank uses it or not).
TOLD_SLOTS = MAX_LOCAL_RANKS
_FAIL_WORD = MAX_LOCAL_RANKS * _LINE_WORDS  # 1 once a rank wrote its failure note
_NOTE_LEN_WORD = _FAIL_WORD + 1
_RESULT_STEP_WORD = _NOTE_LEN_WORD + 1  # the step whose result the result region holds
_NOTE_OFFSET = (_RESULT_STEP_WORD + 1) * 8
HEADER_BYTES = 4096
#: The regions start half a page past a page boundary: buffers that numpy, torch or the pools
#: allocate start within a few bytes of one, and copies between two addresses a few bytes
#: apart modulo a page are memcpy's slow case on AMD (see :func:`redsock.ops.copy`).
DATA_SKEW = 2048
_NOTE_MAX = HEADER_BYTES - _NOTE_OFFSET
#: How many arrays of region views :meth:`LocalGroup.rows` keeps (a training loop's few shapes).
_VIEWS_KEPT = 64
#: Longest futex sleep before a waiter looks at its peers' pidfds again.
DEATH_CHECK_S = 0.05
#: How often a rank waiting for its local peers to attach looks at the store again.
ATTACH_POLL_S = 0.02

# x86-64 only: the counters rely on its total store order (data stores land before the counter's).
_SYS_FUTEX = {"x86_64": 202}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE: the words are shared between processes
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_wait(addr: int, seen: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``addr`` still holds ``seen`` (at most ``timeout_s``)."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(seen & 0xFFFFFFFF),
                  ctypes.byref(ts), None, 0)  # EAGAIN (changed), ETIMEDOUT, EINTR: the caller re-checks


def _futex_wake(addr: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, ctypes.c_int(1 << 30), None, None, 0)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _vm_call(name: str) -> Any:
    """libc's ``process_vm_readv`` or ``process_vm_writev`` (None where libc lacks it)."""
    fn = getattr(_libc, name, None)
    if fn is not None:
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                       ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


_vm_readv, _vm_writev = _vm_call("process_vm_readv"), _vm_call("process_vm_writev")


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal or a tracer (state T or t)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def available() -> bool:
    """Whether this system can run the transport (Linux on x86-64, pidfds, /dev/shm)."""
    return _SYS_FUTEX is not None and hasattr(os, "pidfd_open") and os.path.isdir(ARENA_DIR)


class LocalGroup:
    """The shared arena of the ranks of one host (``ranks``: their global ranks, in local order).

    Raises :class:`TransportError` if the arena cannot be created or attached,
    :class:`PeerFailure` when a local peer dies, :class:`Timeout` when one does not arrive
    within ``timeout_s``.
    """

    def __init__(self, store: Any, key: str, ranks: tuple[int, ...], local_rank: int, pids: tuple[int, ...],
                 *, region_bytes: int, timeout_s: float, spin_us: int, cma: bool = True):
        if len(ranks) > MAX_LOCAL_RANKS:
            raise TransportError(f"{len(ranks)} ranks on one host: shared memory takes at most "
                                 f"{MAX_LOCAL_RANKS} (set REDSOCK_SHM=off)", op="shared-memory attach")
        self.ranks, self.me, self.size, self.pids = ranks, local_rank, len(ranks), pids
        #: Whether every local rank may read and write every other's memory (cross-memory attach).
        self.cma = False
        self.region_bytes = -(-region_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.timeout_s, self.spin_s = timeout_s, spin_us / 1e6
        self.step = 0  # the last step this rank arrived at (the same sequence on every local rank)
        self._line = local_rank * _LINE_WORDS  # this rank's words in the header
        self._sleeping_on_me = local_rank + 1  # a sleep word's value while its rank waits for this one
        self._half = 0
        self._half_owner: object = None  # (half_for: the plan that moved the last piece, if it asked)
        self._closed = False
        self._result_offset = HEADER_BYTES + DATA_SKEW + 2 * self.size * self.region_bytes
        nbytes = self._result_offset + self.region_bytes
        self._views: dict[tuple[int, np.dtype, int], np.ndarray] = {}  # rows() of recent calls
        self._pidfds: dict[int, int] = {}
        self._pids = tuple(pids)
        try:
            # The peers' pidfds first: waiting for them to attach, a rank that died is named at once.
            self._poll = select.poll()
            for lr, pid in enumerate(pids):
                if lr != self.me:
                    try:
                        fd = os.pidfd_open(pid)
                    except ProcessLookupError:
                        raise PeerFailure(f"rank {ranks[lr]} (pid {pid}) exited before attaching shared memory",
                                          ranks=(ranks[lr],)) from None
                    self._pidfds[fd] = lr
                    self._poll.register(fd, select.POLLIN)
            self._mm, path = self._map(store, key, nbytes)
            self._words = memoryview(self._mm)[:HEADER_BYTES].cast("Q")
            self._bytes = np.frombuffer(self._mm, np.uint8)
            base = self._bytes.ctypes.data
            self._step_addr = [base + lr * _LINE_WORDS * 8 for lr in range(self.size)]
            self._fence = threading.Lock()
            # The two iovecs of a cross-memory copy, made once (a copy costs microseconds; the
            # arena serves one call at a time, so one pair serves them all).
            self._iov = (_IoVec(), _IoVec())
            self._iov_refs = (ctypes.byref(self._iov[0]), ctypes.byref(self._iov[1]))
            # Every rank's counter, signatures and sleep word, as strided views (read in C, not a Python loop).
            self._steps = self._words[0:self.size * _LINE_WORDS:_LINE_WORDS]
            self._signatures = [self._words[w:self.size * _LINE_WORDS:_LINE_WORDS] for w in (1, 2)]
            self._sleeps = self._words[_SLEEP:self.size * _LINE_WORDS:_LINE_WORDS]
            #: ``result_step[0]``: the step whose result :meth:`result`'s region holds (0: none yet).
            self.result_step = self._words[_RESULT_STEP_WORD:_RESULT_STEP_WORD + 1]
            self.sync()  # every rank has mapped the arena (and its pidfds) before anyone relies on it
            self.cma = self._probe_cma(cma)
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
                        self._store_get(store, f"{key}/attached/{lr}")
                finally:
                    os.close(fd)
                    os.unlink(path)
                return mm, path
            value = self._store_get(store, key)
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
        except PeerFailure:
            raise
        except Exception as e:  # the store timed out: a local peer never came
            raise PeerFailure(f"rank {self.ranks[self.me]}: a rank of this host never attached the shared "
                              f"memory: {e}", ranks=()) from e

    def _store_get(self, store: Any, key: str) -> Any:
        """``store.get(key)`` once a local peer has set it, watching the peers' pidfds meanwhile:
        one that dies before it attaches is named at once, not at the store's timeout."""
        check = getattr(store, "check", None)
        deadline = time.monotonic() + self.timeout_s
        while check is not None and not check([key]):
            self._raise_if_a_peer_died(ATTACH_POLL_S, "before the ranks of this host attached the shared memory")
            if time.monotonic() >= deadline:
                raise Timeout(f"store key {key!r} not set within {self.timeout_s:g}s", op="shared-memory attach")
        return store.get(key)

    def _raise_if_a_peer_died(self, wait_s: float, when: str) -> None:
        """Raise :class:`PeerFailure` naming a local peer whose process has exited (its pidfd
        is readable), waiting up to ``wait_s`` for one.  A peer that gave up (another rank
        failed) wrote its word before it exited: that word, naming the failed rank, is raised
        instead, so a host-mate that only passed the failure on is never the one blamed."""
        for fd, _ in self._poll.poll(int(wait_s * 1000)):
            self._check_failure()
            dead = self.ranks[self._pidfds[fd]]
            raise PeerFailure(f"rank {self.ranks[self.me]}: rank {dead} died (its process exited) {when}",
                              ranks=(dead,))

    def _probe_cma(self, wanted: bool) -> bool:
        """Whether every local rank can read every other's memory (ptrace scope, seccomp and
        containers may refuse it): each publishes a token, reads its peers' and says whether
        it saw them; all decide alike from what all said."""
        w, line = self._words, self.me * _LINE_WORDS
        token = np.array([secrets.randbits(63) | 1], np.uint64)
        w[line + _ADDR], w[line + _TOKEN] = token.ctypes.data, int(token[0])
        self.sync()
        ok = wanted and _vm_readv is not None
        seen = np.zeros(1, np.uint64)
        for lr in range(self.size):
            if ok and lr != self.me:
                try:
                    self.read_from(lr, 0, seen)
                except TransportError:
                    ok = False
                ok = ok and int(seen[0]) == w[lr * _LINE_WORDS + _TOKEN]
        w[line + _CMA_OK] = 1 if ok else 2
        self.sync()  # (the token stays alive until every peer has read it)
        return all(w[lr * _LINE_WORDS + _CMA_OK] == 1 for lr in range(self.size))

    # -- data --------------------------------------------------------------------------

    def publish(self, buf: np.ndarray) -> None:
        """Say where this rank's (contiguous) buffer of the current call is: peers read and
        write it with :meth:`read_from` / :meth:`write_to` after the next sync."""
        self._words[self.me * _LINE_WORDS + _ADDR] = buf.ctypes.data

    def tell(self, slot: int, word: int) -> None:
        """Write ``word`` (a 64-bit unsigned integer) into slot ``slot`` (0 <= slot <
        :data:`TOLD_SLOTS`) of a table in the arena: the peers read it with :meth:`told` once
        it has passed a sync after this call.  Who writes which slot is the caller's convention."""
        self._words[slot * _LINE_WORDS + _TOLD] = word

    def told(self, slot: int) -> int:
        """The word in slot ``slot`` (:meth:`tell`; 0 until one is written)."""
        return self._words[slot * _LINE_WORDS + _TOLD]

    def read_from(self, lr: int, offset: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes from local rank ``lr``'s published buffer, ``offset``
        bytes in, into ``out`` (contiguous).  Raises :class:`PeerFailure` if ``lr`` died,
        :class:`TransportError` if the kernel refuses."""
        self._move(_vm_readv, lr, offset, out)

    def write_to(self, lr: int, offset: int, src: np.ndarray) -> None:
        """Copy ``src`` (contiguous) into local rank ``lr``'s published buffer, ``offset`` bytes in."""
        self._move(_vm_writev, lr, offset, src)

    def _move(self, fn: Any, lr: int, offset: int, local: np.ndarray) -> None:
        size, done = local.nbytes, 0
        here, there = local.ctypes.data, self._words[lr * _LINE_WORDS + _ADDR] + offset
        mine, theirs = self._iov
        while done < size:  # (the kernel may stop at a page boundary)
            mine.iov_base, theirs.iov_base = here + done, there + done
            mine.iov_len = theirs.iov_len = size - done
            moved = fn(self.pids[lr], self._iov_refs[0], 1, self._iov_refs[1], 1, 0)
            if moved > 0:
                done += moved
                continue
            err = ctypes.get_errno() if moved < 0 else errno.EIO
            if err == errno.EINTR:
                continue
            when = "while this rank copied its memory (cross-memory attach)"
            self._raise_if_a_peer_died(0, when)
            if err == errno.ESRCH:
                raise PeerFailure(f"rank {self.ranks[self.me]}: rank {self.ranks[lr]} died (its process exited) "
                                  f"{when}", ranks=(self.ranks[lr],))
            raise TransportError(f"rank {self.ranks[self.me]}: cross-memory attach to rank {self.ranks[lr]} "
                                 f"(pid {self.pids[lr]}): {os.strerror(err)}", peer=f"rank {self.ranks[lr]}",
                                 op="shared-memory copy")


    def next_half(self) -> int:
        """The half of every region the next piece goes through (all local ranks alternate alike)."""
        self._half ^= 1
        self._half_owner = None
        return self._half

    def half_for(self, owner: object) -> int:
        """The half for a piece that ``owner`` moves: the last piece's again where ``owner``
        moved that one too (no other piece in between), else the next (:meth:`next_half`).
        For a caller whose ranks, in its next piece, write before its first sync only what no
        rank reads after the last one (:meth:`Hierarchy._reduce_sharded` in one piece): one
        half then stays in the caches instead of two.  Alike on every local rank, which make
        the same calls in the same order."""
        if self._half_owner is not owner:
            self._half ^= 1
            self._half_owner = owner
        return self._half

    def rows(self, half: int, dtype: np.dtype, count: int) -> np.ndarray:
        """Every local rank's region (one half) at once: row ``lr`` is ``local_rank``'s
        first ``count`` elements, viewed as ``dtype``."""
        key = (half, dtype, count)
        view = self._views.get(key)
        if view is None:  # (making one costs more than a small collective's copy and reduction)
            if len(self._views) >= _VIEWS_KEPT:
                self._views.clear()
            view = self._views[key] = np.ndarray((self.size, count), dtype, buffer=self._mm,
                                                 offset=HEADER_BYTES + DATA_SKEW + half * self.region_bytes,
                                                 strides=(2 * self.region_bytes, dtype.itemsize))
        return view

    def result(self, dtype: np.dtype, count: int) -> np.ndarray:
        """The result region's first ``count`` elements, viewed as ``dtype``: between a sync
        and its next one, a rank that computed what every local rank computes alike from what
        they all wrote before it (the same bits) may leave it there and then write the sync's
        step (:attr:`step`) into :attr:`result_step`; a peer that reads that step there, in the
        same interval, may copy the result instead of computing it (x86 orders the stores).  Two
        ranks may write it at once: the same bytes.  No rank writes it for a later step before
        every rank has arrived there, so done with this one's.  (A new view: callers keep it.)"""
        return np.ndarray((count,), dtype, buffer=self._mm, offset=self._result_offset)

    # -- synchronisation ---------------------------------------------------------------

    def sync(self, signature: int | None = None, spin_us: int | None = None, timeout_s: float | None = None) -> None:
        """Arrive at the next step and wait for every local rank to arrive there too.

        With ``signature`` (the call's, nonzero), check that every local rank arrived in
        the same call: a mismatch raises :class:`ProtocolError` on every rank alike.
        ``spin_us``: how long to spin before sleeping; ``timeout_s``: how long to wait for
        the others (defaults: the group's).
        """
        # (Every line counts: a small collective is little more than this, and runs cold after
        # the process switch of an oversubscribed host.)
        step = self.step = self.step + 1
        w, line = self._words, self._line
        if signature is not None:
            w[line + 1 + step % 2] = signature  # (two signature words, by the step's parity)
        w[line] = step
        with self._fence:  # a locked instruction orders the store above before the loads below
            pass
        if self._sleeping_on_me in self._sleeps:
            _futex_wake(self._step_addr[self.me])
        if min(self._steps) < step:
            self._wait(step, self.spin_s if spin_us is None else spin_us / 1e6, timeout_s or self.timeout_s)
        if signature is not None:
            if self._signatures[step % 2].tolist().count(signature) != self.size:
                raise ProtocolError(f"rank {self.ranks[self.me]}: the ranks of this host called different "
                                    "collectives (the ranks called different collectives, or with different "
                                    "dtype, size or op)", peer="local ranks", op="shared-memory collective")

    def _missing(self, step: int) -> list[int]:
        w = self._words
        return [lr for lr in range(self.size) if w[lr * _LINE_WORDS] < step]

    def _wait(self, step: int, spin_s: float, timeout_s: float) -> None:
        now = time.monotonic()
        spin_end, deadline = now + spin_s, now + timeout_s
        steps = self._steps
        while True:  # (yield first: sync has just looked)
            os.sched_yield()
            if min(steps) >= step:
                return
            if time.monotonic() >= spin_end:
                break
        w = self._words
        sleep_word = self.me * _LINE_WORDS + _SLEEP
        graced = False
        while True:
            self._check_failure()
            missing = self._missing(step)
            if not missing:
                return
            self._raise_if_a_peer_died(0, "during a shared-memory collective")  # it never arrives: say who
            left = deadline - time.monotonic()
            if left <= 0 and not graced and not any(_stopped(self._pids[lr]) for lr in missing):
                # The missing ranks are alive (their pidfds say so) and running, so each is held
                # up elsewhere (its inter-host step): if a remote rank failed there, its diagnosis
                # reaches us as a failure note within the relay grace.  Not another whole timeout
                # (no stacking); a stopped one (SIGSTOP) is not held up by anybody: named now.
                graced = True
                deadline += min(timeout_s, RELAY_GRACE_S)  # (as a socket's wait: a 1 s call waits 2 s)
                left = deadline - time.monotonic()
            if left <= 0:
                names = [self.ranks[lr] for lr in missing]
                raise Timeout(f"rank {self.ranks[self.me]}: local rank(s) {names} did not arrive at a "
                              f"shared-memory step within {deadline - now:g}s",
                              peer=f"rank {names[0]}", op="shared-memory wait")
            lr = missing[0]
            w[sleep_word] = lr + 1  # the futex system call below is a full barrier
            seen = w[lr * _LINE_WORDS]
            if seen < step and not w[_FAIL_WORD]:
                _futex_wait(self._step_addr[lr], seen, min(left, DEATH_CHECK_S))
            w[sleep_word] = 0

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
        for addr in self._step_addr:  # a waiter sleeps on some rank's counter: wake them all
            _futex_wake(addr)

    def _check_failure(self) -> None:
        """Raise the word a local rank that gave up left in the arena (none before it is mapped)."""
        if hasattr(self, "_words") and self._words[_FAIL_WORD]:
            n = self._words[_NOTE_LEN_WORD]
            note = bytes(self._mm[_NOTE_OFFSET:_NOTE_OFFSET + n]).decode(errors="replace")
            raise TransportError(note, peer="local ranks", op="shared-memory wait")

    def close(self) -> None:
        """Unmap the arena and close the sockets.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        for fd in getattr(self, "_pidfds", {}):
            os.close(fd)
        self._pidfds = {}
        if hasattr(self, "_words"):
            self._views.clear()
            for view in (self._steps, self._sleeps, *self._signatures, self.result_step):
                view.release()
            self._words.release()
            del self._bytes
            try:
                self._mm.close()
            except BufferError:  # a view is still referenced somewhere: the mapping goes with it
                pass
