"""``dist.Work`` objects for redsock operations, completed off the communicator's threads.

Where user code runs: a Work's future runs its ``then()`` callbacks (DDP's comm hooks,
torch's PowerSGD, user code) when it is set, and such a callback may start another
collective of the same group and wait for it.  So an operation that finishes on one of the
communicator's threads opens the Work's ``wait()`` there (no user code) and sets the future
on the Tracker's delivery threads, never on a thread the nested collective needs (as gloo
and NCCL complete theirs on threads of their own).  A synchronous call completes in the
caller's thread, as before: that thread is the user's anyway.

Which delivery thread: the futures of operations started by the program itself are set
one after another, in the order they finish, on one thread — so callbacks that start
collectives start them in the same order on every rank (a collective's order must agree
across ranks).  An operation started *inside* a callback is delivered on a side thread at
once: the callback that waits for it holds the in-order thread.  (So a callback may wait
for collectives it starts, not for the future of a later top-level operation.)

Why not ``_create_work_from_future``: in torch 2.13 the Work it returns reports
success from ``wait()`` even when the future failed, and a Python
``Future.set_exception`` only marks the *Python* wrapper as failed — C++
consumers such as DDP's reducer would read the exception object as a value.
So each operation completes a private future, and the future handed out is
``private.then(_unwrap)``: a callback that raises turns into a real C++-level
error, which both ``Future.wait()`` and DDP see.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Executor, Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError, PeerFailure, Timeout


class _Failed:
    """What the private future carries when the operation failed."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def _unwrap(fut: torch.futures.Future) -> Any:
    value = fut.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class RedsockWork(dist.Work):
    """Handle of one redsock operation: ``wait()`` raises the operation's error (e.g.
    :class:`~redsock.errors.PeerFailure`), ``get_future()`` is what DDP chains on."""

    def __init__(self, what: str, devices: Sequence[torch.device] = (), inputs: Sequence[torch.Tensor] = ()):
        super().__init__()
        self.what = what
        # Under a profiler, like gloo's works: an async "redsock:<op>" event with the input
        # shapes, from the call until the operation completes (on another thread).
        self._record = (torch.autograd._record_function_with_args_enter(f"redsock:{what}", *inputs)
                        if torch._C._autograd._profiler_enabled() else None)
        self._caller = threading.get_ident()
        self.nested = getattr(_delivery, "active", False)  # started by a callback (see the module's docstring)
        # A future that holds CUDA tensors must name their devices (torch checks on completion).
        self._private = torch.futures.Future(devices=list(devices)) if devices else torch.futures.Future()
        self._future: torch.futures.Future | None = None  # made by get_future(): most Works are only waited on
        # Held until the operation completes: a released lock is the cheapest latch (an
        # Event builds a Condition, several microseconds of a small call's budget).
        self._latch = threading.Lock()
        self._latch.acquire()
        self._completed = False
        self._error: BaseException | None = None
        self._keep: Any = None  # buffers that must outlive the operation (staged copies, temporaries)
        self.senders: list[int] = []  # a receive's source rank, known once it completes

    # -- dist.Work API ------------------------------------------------------------

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until the operation is done; raise its error if it failed.  ``timeout``
        (a timedelta or seconds; 0/None: no limit) raises :class:`~redsock.errors.Timeout`."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if not self._completed:
            if not self._latch.acquire(timeout=seconds or -1):
                raise Timeout(f"redsock {self.what} not complete after {seconds:g}s", op=self.what)
            self._latch.release()  # (for every other waiter)
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        future = self._future
        if future is None:  # (two threads racing here get two futures, both settled alike)
            future = self._future = self._private.then(_unwrap)
        return future

    def result(self) -> list[torch.Tensor]:
        """The output tensors (after :meth:`wait`)."""
        self.wait()
        value = self.get_future().wait()  # set just after wait() returns, maybe on another thread
        return list(value) if isinstance(value, (list, tuple)) else [value]

    def source_rank(self) -> int:
        """The rank a receive came from (``dist.recv`` without ``src`` returns it)."""
        self.wait()
        if not self.senders:
            raise ConfigError(f"redsock {self.what}: source_rank() is defined for receives only")
        return self.senders[0]

    _source_rank = source_rank

    def is_completed(self) -> bool:
        return self._completed

    def is_success(self) -> bool:
        return self._completed and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def synchronize(self) -> None:
        # Results are already in place (CPU, or copied back and synchronised) when done.
        self.wait()

    # -- completion (see the module's docstring for which thread) -------------------

    def _set_result(self, value: Any, deliver: Executor | None = None) -> None:
        self._settle(value, deliver)

    def _set_error(self, error: BaseException, deliver: Executor | None = None) -> None:
        self._error = error  # before the latch opens: a woken wait() raises it
        self._settle(_Failed(error), deliver)

    def _settle(self, value: Any, deliver: Executor | None) -> None:
        """Open ``wait()`` here, and set the future (which runs its callbacks) here or, with
        ``deliver``, on one of its threads."""
        self._end_record()
        self._keep = None
        self._completed = True
        self._latch.release()
        if deliver is not None:
            try:
                deliver.submit(self._private.set_result, value)
                return
            except RuntimeError:  # shut down with the group: nothing of it can wait on us now
                pass
        self._private.set_result(value)

    def _end_record(self) -> None:
        record, self._record = self._record, None
        if record is None:
            return
        if threading.get_ident() != self._caller:
            torch.autograd._record_function_with_args_exit(record)
            return
        # Completed on the caller's thread (run there, or done before the caller had tracked
        # it): end the event from another thread, as every other operation's, so the profiler
        # shows the same async event for each (profiling only).
        ender = threading.Thread(target=torch.autograd._record_function_with_args_exit, args=(record,))
        ender.start()
        ender.join()


#: The most side threads (operations started inside callbacks) a process group may have.
#: They are made only when such a Work completes while every existing one is busy in a
#: callback: one more per level of callbacks that wait for a nested collective.
SIDE_THREADS = 16

_delivery = threading.local()  # .active: this thread runs future callbacks


def _mark_delivery_thread() -> None:
    _delivery.active = True


class Tracker:
    """Operations in flight of one process group: keeps each Work (and its buffers)
    alive until complete, and completes it when all its parts are done.

    Locks: ``_lock`` guards the in-flight table and the coalescing list; a Work is never
    completed under it (completing runs user callbacks)."""

    def __init__(self, name: str = "redsock") -> None:
        self._inflight: dict[int, RedsockWork] = {}
        self._lock = threading.Lock()
        self._coalescing: list[RedsockWork] | None = None
        self._in_order = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-deliver",
                                            initializer=_mark_delivery_thread)
        self._side = ThreadPoolExecutor(max_workers=SIDE_THREADS, thread_name_prefix=f"{name}-nested",
                                        initializer=_mark_delivery_thread)

    def complete_when_done(self, work: RedsockWork, parts: Sequence[Future], finish: Callable[[], Any],
                           keep: Any = None) -> RedsockWork:
        """Complete ``work`` with ``finish()`` (copy-backs; returns the future's value) once
        every future in ``parts`` is done, or with the first error among them."""
        if not parts:
            return self.complete_here(work, finish)
        work._keep = keep
        with self._lock:
            self._inflight[id(work)] = work
            if self._coalescing is not None:
                self._coalescing.append(work)
        state = {"left": len(parts), "error": None}
        lock = threading.Lock()

        deliver = self._side if work.nested else self._in_order

        def settle() -> None:  # on whichever communicator thread finished the last part
            with self._lock:
                self._inflight.pop(id(work), None)
            if state["error"] is not None:
                work._set_error(state["error"], deliver)
                return
            try:
                value = finish()
            except BaseException as e:  # a failed copy-back must fail the Work, not vanish in a callback
                work._set_error(e, deliver)
                return
            work._set_result(value, deliver)

        def part_done(f: Future) -> None:
            try:
                err = f.exception()
            except CancelledError:
                err = PeerFailure(f"redsock {work.what} cancelled: the process group was shut down")
            with lock:
                if err is not None and state["error"] is None:
                    state["error"] = err
                state["left"] -= 1
                last = state["left"] == 0
            if last:
                settle()

        for f in parts:
            f.add_done_callback(part_done)
        return work

    def complete_here(self, work: RedsockWork, run: Callable[[], Any]) -> RedsockWork:
        """Complete ``work`` with ``run()`` (the operation and its copy-backs; returns the
        future's value) in this thread, or with its error: what :meth:`complete_when_done`
        does once nothing is left to wait for."""
        if self._coalescing is not None:
            with self._lock:
                if self._coalescing is not None:
                    self._coalescing.append(work)
        try:
            value = run()
        except BaseException as e:  # the Work carries it (wait() raises it), as when run elsewhere
            work._set_error(e)
        else:
            work._set_result(value)
        return work

    def close(self) -> None:
        """No more completions after those under way (the process group is gone)."""
        self._in_order.shutdown(wait=False)
        self._side.shutdown(wait=False)

    def pending(self) -> list[RedsockWork]:
        with self._lock:
            return list(self._inflight.values())

    def start_coalescing(self) -> None:
        with self._lock:
            self._coalescing = []

    def end_coalescing(self) -> list[RedsockWork]:
        with self._lock:
            works, self._coalescing = self._coalescing or [], None
        return works


def done_future(work: RedsockWork) -> Future:
    """A concurrent Future that completes (or fails) with ``work``."""
    f: Future = Future()
    work.get_future().add_done_callback(lambda _: f.set_exception(work._error) if work._error is not None
                                        else f.set_result(None))
    return f
