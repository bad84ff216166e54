"""``ProcessGroupRedsock``: the ``redsock`` torch.distributed backend.

Every group (the default one and each ``new_group``) gets its own
:class:`~redsock.collectives.Communicator`, bootstrapped through the store torch
hands the creator (already prefixed with the group's name, so groups never
share keys).

How operations run:

* Collectives are submitted to the communicator with ``async_op=True`` from the
  caller's thread.  The communicator numbers calls as they are submitted and starts
  them in that order on its own thread, so every rank runs them in the same
  order and the caller only waits for what it must (staging CUDA tensors); an
  all-reduce through reduction servers finishes on a second thread, so the next
  call (DDP's next bucket) starts while its results come back.  A collective that
  c10d waits for at once (``async_op=False``, which it passes in ``opts.asyncOp``)
  runs in the caller's thread instead, numbered in the same sequence.
* Point-to-point operations (send/recv, and alltoall, gather and scatter, which
  are built from them) run on *lanes*: one thread per (direction, peer, tag).
  Messages with the same tag are matched in order, and each lane keeps that
  order; separate lanes make ``irecv`` then ``isend`` between two ranks (or an
  alltoall, where everyone sends and receives at once) free of deadlock.
  A send never waits for its receive: the transport buffers early messages.
* Each operation returns a :class:`~redsock.torch.work.RedsockWork`, kept alive
  by the group until it completes; its future's value is the output tensors.

Tensors are handed over without copies when they are contiguous CPU tensors
(see :mod:`redsock.torch.bridge` for non-contiguous and CUDA tensors).
"""

from __future__ import annotations

import contextvars
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..api import init as redsock_init
from ..collectives import Communicator, call_timeout
from ..errors import ConfigError, PeerFailure, RedsockError
from .bridge import (
    Staged,
    as_numpy,
    check_tensor,
    copy_into,
    cuda_devices,
    host_buffer,
    same_dtype,
    same_numel,
    sync_devices,
)
from .name import BACKEND_NAME
from .work import RedsockWork, Tracker, done_future

_RedOp = dist.ReduceOp.RedOpType
_REDUCE_OPS: dict[Any, str] = {
    _RedOp.SUM: "sum", _RedOp.AVG: "avg", _RedOp.MIN: "min", _RedOp.MAX: "max", _RedOp.PRODUCT: "prod",
}

# Point-to-point tag spaces.  torch's user tags are C++ ints (< 2**31); the communicator
# accepts tags < 2**61, so the internal uses sit above every user tag.
_MAX_USER_TAG = 1 << 31
_ALLTOALL_TAG = 1 << 40
_GATHER_TAG = (1 << 40) + 1
_SCATTER_TAG = (1 << 40) + 2
_MONITORED_TAG = (1 << 40) + 3
_ANY_SOURCE = -1  # the lane of receives from any peer


class BarrierFailure(PeerFailure, RuntimeError):
    """``monitored_barrier`` found ranks missing (a RuntimeError, as torch's backends raise)."""


class Options:
    """``pg_options`` for the redsock backend: option overrides for one group.

    ``dist.new_group(backend="redsock", pg_options=redsock.torch.Options(algo="ring", nsocks=8))``
    Keys are :class:`~redsock.config.Config` fields; they win over ``REDSOCK_*``.  Without
    ``timeout_s`` here, the group's torch timeout (``timeout=`` of init_process_group /
    new_group) becomes the communicator's ``timeout_s``.
    """

    def __init__(self, **options: Any):
        self.options: dict[str, Any] = dict(options)

    def __repr__(self) -> str:
        return f"redsock.torch.Options({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


# -- creating communicators ----------------------------------------------------------------

def new_communicator(rank: int, size: int, store: Any, **options: Any) -> Communicator:
    """A Communicator for one torch group, bootstrapped through its store.

    torch calls the creator only on a group's members, so per-process numbering of
    communicators would drift between ranks; the store is already private to the
    group (torch prefixes it with the group's name), so one namespace per generation of
    workers suffices.
    """
    # torchrun's agent store outlives a generation of workers (elastic restarts): the keys of a
    # dead generation (its addresses, its job id, its "failed" mark) must not reach the next.
    generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return redsock_init(rank, size, store, namespace=f"torch/{generation}", **options)


def _options_of(pg_options: Any) -> dict[str, Any]:
    if pg_options is None:
        return {}
    if isinstance(pg_options, Options):
        return dict(pg_options.options)
    if isinstance(pg_options, Mapping):
        return dict(pg_options)
    raise ConfigError(f"redsock: pg_options must be redsock.torch.Options or a dict of redsock options, "
                      f"got {type(pg_options).__name__}")


def create_process_group(dist_opts: Any, pg_options: Any = None) -> "ProcessGroupRedsock":
    """The creator torch calls (``extended_api=True``) for every redsock group this rank is in."""
    options = _options_of(pg_options)
    timeout = dist_opts.timeout
    if isinstance(timeout, timedelta) and "timeout_s" not in options:
        options["timeout_s"] = timeout.total_seconds()
    comm = new_communicator(dist_opts.group_rank, dist_opts.group_size, dist_opts.store, **options)
    return ProcessGroupRedsock(comm, group_id=str(dist_opts.group_id),
                               global_ranks=list(dist_opts.global_ranks_in_group))


# -- point-to-point lanes -------------------------------------------------------------------

class _Lanes:
    """One single-thread executor per (direction, peer, tag): order within a lane, no
    head-of-line blocking between lanes.  Lanes are created on first use and live as
    long as the group (a program uses few distinct tags)."""

    def __init__(self, label: str):
        self._label = label
        self._lanes: dict[tuple[str, int, int], ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def submit(self, direction: str, peer: int, tag: int, fn: Callable[[], None], part: Future) -> None:
        """Run ``fn`` on its lane and settle ``part`` there (cancel it if the lane is shut down first)."""
        key = (direction, peer, tag)
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = ThreadPoolExecutor(max_workers=1,
                                          thread_name_prefix=f"redsock-{self._label}-{direction}{peer}-t{tag}")
                self._lanes[key] = lane
            job = lane.submit(contextvars.copy_context().run, _settle, fn, part)  # (keeps call_timeout)
        job.add_done_callback(lambda j: part.cancel() if j.cancelled() else None)

    def shutdown(self) -> None:
        with self._lock:
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.shutdown(wait=False, cancel_futures=True)


def _settle(fn: Callable[[], None], part: Future) -> None:
    try:
        fn()
    except BaseException as e:  # the part carries it to the work (Work.wait raises it)
        part.set_exception(e)
    else:
        part.set_result(None)


# -- the process group ----------------------------------------------------------------------

def _reduce_op(op: Any, what: str) -> str:
    kind = getattr(op, "op", op)  # a dist.ReduceOp, or its RedOpType
    name = _REDUCE_OPS.get(kind)
    if name is None:
        label = getattr(kind, "name", str(kind))
        raise ConfigError(f"redsock {what}: reduce op {label} is not supported "
                          "(supported: SUM, AVG, MIN, MAX, PRODUCT)")
    return name


def _as_list(tensors: Any) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _options_timeout(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run an operation under its options' ``timeout`` (torch's per-call timeout: every
    wait of the call then fails after that long without progress, as gloo does); unset
    (negative, torch's default) leaves the group's timeout."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        opts = kwargs.get("opts", args[-1] if args else None)
        timeout = getattr(opts, "timeout", None)
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else None
        with call_timeout(seconds):
            return method(self, *args, **kwargs)

    return run


class ProcessGroupRedsock(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on a redsock Communicator."""

    def __init__(self, comm: Communicator, *, group_id: str = "", global_ranks: Sequence[int] = ()):
        super().__init__(comm.rank, comm.world_size)
        self.comm = comm
        self.group_id = group_id
        self.global_ranks = list(global_ranks)
        self._tracker = Tracker(f"redsock-r{comm.rank}")
        self._lanes = _Lanes(f"r{comm.rank}")
        self._shut = False
        self._group_name = group_id
        self._group_desc = ""

    def getBackendName(self) -> str:  # noqa: N802 - torch's names
        return BACKEND_NAME

    # The base class keeps the group's name and description in its C++ backends, which a
    # Python group has none of: keep them here (torch sets them right after the creator).
    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def __repr__(self) -> str:
        return f"ProcessGroupRedsock(group={self.group_id!r}, rank={self.comm.rank}, size={self.comm.world_size})"

    # -- machinery ---------------------------------------------------------------------

    @property
    def _world(self) -> int:
        return self.comm.world_size

    @property
    def _me(self) -> int:
        return self.comm.rank

    def _new_work(self, what: str, tensors: Sequence[torch.Tensor],
                  inputs: Sequence[torch.Tensor] | None = None) -> RedsockWork:
        """``what``: torch's name of the operation (the profiler shows ``redsock:<what>``, as
        gloo's ``gloo:<what>``); ``inputs``: the tensors the profiler records (default ``tensors``)."""
        if self._shut:
            raise ConfigError(f"redsock {what}: the process group was shut down")
        return RedsockWork(what, cuda_devices(tensors), tensors if inputs is None else inputs)

    def _collective(self, what: str, tensors: Sequence[torch.Tensor], staged: Sequence[Staged],
                    submit: Callable[[bool], list[Any]], finish: Callable[[], Any], opts: Any,
                    keep: Any = None, inputs: Sequence[torch.Tensor] | None = None) -> RedsockWork:
        """Run ``submit(async_op)`` (communicator calls, returning their Works when async) and
        complete a Work with ``finish()`` when they are all done.

        A call that c10d waits for at once (``async_op=False``: ``opts.asyncOp`` says so) runs
        in the caller's thread, as the communicator's synchronous calls do: no hop to its
        thread and back, which costs a small call more than the call itself.  Every other
        call (DDP's buckets, ``async_op=True``, options made without it) starts on the
        communicator's thread and overlaps what the caller does next."""
        work = self._new_work(what, tensors, inputs)
        sync_devices(s.tensor for s in staged)  # device-to-host staging copies must have landed

        def done() -> Any:
            for s in staged:
                s.finish()
            return finish()

        def run_here() -> Any:
            submit(False)
            return done()

        if getattr(opts, "asyncOp", True) is False:
            return self._tracker.complete_here(work, run_here)
        parts = [w.get_future() for w in submit(True)]
        return self._tracker.complete_when_done(work, parts, done, keep=(staged, keep))

    def _p2p(self, what: str, tensors: Sequence[torch.Tensor], staged: Sequence[Staged],
             jobs: list[tuple[str, int, int, Callable[[], None]]], finish: Callable[[], Any],
             keep: Any = None, inputs: Sequence[torch.Tensor] | None = None) -> RedsockWork:
        """Run ``jobs`` (direction, peer, tag, fn) on their lanes; complete when all are done."""
        work = self._new_work(what, tensors, inputs)
        sync_devices(s.tensor for s in staged)

        def done() -> Any:
            for s in staged:
                s.finish()
            return finish()

        # Tracked before the jobs start, so the work completes on a lane thread even when a
        # job is done at once (as gloo's works complete on its threads: the profiler shows
        # an async event, and the caller never runs completion callbacks itself).
        parts: list[Future] = [Future() for _ in jobs]
        self._tracker.complete_when_done(work, parts, done, keep=(staged, keep))
        for (direction, peer, tag, fn), part in zip(jobs, parts):
            self._lanes.submit(direction, peer, tag, fn, part)
        return work

    def _check_peer(self, peer: int, what: str) -> int:
        if not isinstance(peer, int) or not 0 <= peer < self._world or peer == self._me:
            raise ConfigError(f"redsock {what}: {peer!r} is not another rank of this group "
                              f"(rank {self._me} of {self._world})")
        return peer

    # -- all-reduce ----------------------------------------------------------------------

    @_options_timeout
    def allreduce(self, tensors: Any, opts: Any = None) -> RedsockWork:
        tensors = _as_list(tensors)
        op = _reduce_op(opts.reduceOp if opts is not None else _RedOp.SUM, "allreduce")
        if any(t.is_sparse for t in tensors):  # (sparse COO: the layout, read cheaply)
            return self._allreduce_sparse(tensors, op)
        staged = [Staged(t, read=True, write=True, what="allreduce") for t in tensors]
        return self._collective(
            "all_reduce", tensors, staged,
            lambda async_op: [self.comm.all_reduce(s.array, op, async_op=async_op) for s in staged],
            lambda: tensors, opts)

    def _allreduce_sparse(self, tensors: list[torch.Tensor], op: str) -> RedsockWork:
        """The sum of sparse COO tensors (as gloo): every rank's indices and values are gathered,
        counts first, and every rank sums them in rank order, so all end with the same tensor.
        Runs before it returns: the counts must be known before the data can move."""
        if op != "sum" or len(tensors) != 1:
            raise ConfigError("redsock allreduce: sparse tensors are reduced with SUM, one tensor per call")
        t = tensors[0]
        work = self._new_work("all_reduce", tensors)
        mine = t.coalesce()
        idx, val = mine.indices(), mine.values()
        counts = torch.empty(self._world, dtype=torch.int64)
        self.comm.all_gather(as_numpy(torch.tensor([idx.shape[1]])), as_numpy(counts))
        most = int(counts.max())
        # Padded to the largest count: all_gather moves equal-sized parts.
        pidx = torch.zeros(idx.shape[0], most, dtype=torch.int64)
        pval = torch.zeros(most, *val.shape[1:], dtype=val.dtype)
        pidx[:, :idx.shape[1]], pval[:val.shape[0]] = idx, val
        all_idx = torch.empty(self._world, *pidx.shape, dtype=pidx.dtype)
        all_val = torch.empty(self._world, *pval.shape, dtype=pval.dtype)
        self.comm.all_gather(as_numpy(pidx), as_numpy(all_idx))
        self.comm.all_gather(as_numpy(check_tensor(pval, "allreduce")), as_numpy(all_val))
        n = counts.tolist()
        total = torch.sparse_coo_tensor(torch.cat([all_idx[r, :, :n[r]] for r in range(self._world)], dim=1),
                                        torch.cat([all_val[r, :n[r]] for r in range(self._world)]),
                                        t.shape).coalesce()
        t.copy_(total)
        return self._tracker.complete_when_done(work, [], lambda: tensors)

    @_options_timeout
    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> RedsockWork:
        return self.allreduce(tensors, opts)

    # -- broadcast -------------------------------------------------------------------------

    @_options_timeout
    def broadcast(self, tensors: Any, opts: Any = None) -> RedsockWork:
        tensors = _as_list(tensors)
        root = opts.rootRank if opts is not None else 0
        if not 0 <= root < self._world:
            raise ConfigError(f"redsock broadcast: root {root} is not a rank of a group of {self._world}")
        is_root = root == self._me
        staged = [Staged(t, read=is_root, write=not is_root, what="broadcast") for t in tensors]
        return self._collective(
            "broadcast", tensors, staged,
            lambda async_op: [self.comm.broadcast(s.array, root, async_op=async_op) for s in staged],
            lambda: tensors, opts)

    # -- all-gather ------------------------------------------------------------------------

    @_options_timeout
    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> RedsockWork:
        """List form: ``output_tensors[i][r]`` = rank r's ``input_tensors[i]``."""
        inputs = _as_list(input_tensors)
        outputs = [list(o) for o in output_tensors]
        if len(outputs) != len(inputs):
            raise ConfigError(f"redsock allgather: {len(outputs)} output lists for {len(inputs)} inputs")
        srcs, temps = [], []
        for outs, inp in zip(outputs, inputs):
            check_tensor(inp, "allgather")
            if len(outs) != self._world:
                raise ConfigError(f"redsock allgather: {len(outs)} output tensors, expected one per rank "
                                  f"({self._world})")
            same_numel(outs, inp.numel(), "allgather output")
            same_dtype(outs, inp.dtype, "allgather output")
            srcs.append(Staged(inp, read=True, write=False, what="allgather"))
            temps.append(host_buffer(outs[0] if outs else inp, self._world * inp.numel()))
        flat_outs = [t for outs in outputs for t in outs]

        def finish() -> Any:
            for outs, tmp in zip(outputs, temps):
                n = tmp.numel() // self._world
                for r, o in enumerate(outs):
                    copy_into(o, tmp[r * n:(r + 1) * n].view(o.shape))
            return flat_outs  # as gloo: the output tensors, flattened

        return self._collective(
            "all_gather", [*inputs, *flat_outs], srcs,
            lambda async_op: [self.comm.all_gather(s.array, as_numpy(tmp), async_op=async_op)
                              for s, tmp in zip(srcs, temps)],
            finish, opts, keep=temps, inputs=inputs)

    @_options_timeout
    def allgather_coalesced(self, output_lists: Any, input_tensors: Any, opts: Any = None) -> RedsockWork:
        """``output_lists[r][i]`` = rank r's ``input_tensors[i]`` (the C++ base class would look
        for a C++ backend)."""
        inputs = _as_list(input_tensors)
        lists = [list(o) for o in output_lists]
        if len(lists) != self._world or any(len(o) != len(inputs) for o in lists):
            raise ConfigError(f"redsock allgather_coalesced: expected {self._world} output lists of "
                              f"{len(inputs)} tensors (one per rank, one tensor per input)")
        return self.allgather([[lists[r][i] for r in range(self._world)] for i in range(len(inputs))], inputs, opts)

    @_options_timeout
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> RedsockWork:
        """``output`` (world × input's elements) = every rank's ``input``, in rank order."""
        return self._gather_into_tensors([output], [input], opts, "all_gather_into_tensor")

    _allgather_base = all_gather_single

    @_options_timeout
    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> RedsockWork:
        return self._gather_into_tensors(_as_list(outputs), _as_list(inputs), opts,
                                         "all_gather_into_tensor_coalesced")

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _gather_into_tensors(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any,
                             what: str) -> RedsockWork:
        return self._paired(outputs, inputs, opts, what, output_is_whole=True,
                            start=lambda i, o, async_op: self.comm.all_gather(i, o, async_op=async_op))

    def _paired(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any, what: str, *,
                output_is_whole: bool, start: Callable[[Any, Any, bool], Any]) -> RedsockWork:
        """Tensor-pair collectives where one side of each pair holds world × the other's elements
        (all-gather: the output; reduce-scatter: the input)."""
        if len(outputs) != len(inputs):
            raise ConfigError(f"redsock {what}: {len(outputs)} outputs for {len(inputs)} inputs")
        staged_in, staged_out = [], []
        for out, inp in zip(outputs, inputs):
            check_tensor(out, what)
            check_tensor(inp, what)
            whole, part, names = ((out, inp, ("output", "input")) if output_is_whole
                                  else (inp, out, ("input", "output")))
            if whole.numel() != self._world * part.numel():
                raise ConfigError(f"redsock {what}: {names[0]} has {whole.numel()} elements, expected world size × "
                                  f"{names[1]} = {self._world} × {part.numel()}")
            same_dtype([out], inp.dtype, what)
            staged_in.append(Staged(inp, read=True, write=False, what=what))
            staged_out.append(Staged(out, read=False, write=True, what=what))
        return self._collective(
            what, [*outputs, *inputs], [*staged_in, *staged_out],
            lambda async_op: [start(i.array, o.array, async_op) for i, o in zip(staged_in, staged_out)],
            lambda: outputs, opts, inputs=inputs)

    # -- reduce-scatter --------------------------------------------------------------------

    @_options_timeout
    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> RedsockWork:
        """List form: ``output_tensors[i]`` = reduction over ranks of ``input_tensors[i][rank]``."""
        outputs = _as_list(output_tensors)
        input_lists = [list(x) for x in input_tensors]
        op = _reduce_op(opts.reduceOp if opts is not None else _RedOp.SUM, "reduce_scatter")
        if len(outputs) != len(input_lists):
            raise ConfigError(f"redsock reduce_scatter: {len(outputs)} outputs for {len(input_lists)} input lists")
        staged_in, staged_out = [], []
        for out, ins in zip(outputs, input_lists):
            check_tensor(out, "reduce_scatter")
            if len(ins) != self._world:
                raise ConfigError(f"redsock reduce_scatter: {len(ins)} input tensors, expected one per rank "
                                  f"({self._world})")
            for t in ins:
                check_tensor(t, "reduce_scatter")
            same_numel(ins, out.numel(), "reduce_scatter input")
            same_dtype(ins, out.dtype, "reduce_scatter input")
            if len({t.device for t in ins}) > 1:
                raise ConfigError("redsock reduce_scatter: input tensors are on different devices")
            # The collective reduces one flat buffer: the list is concatenated once (a copy).
            flat = torch.cat([t.detach().reshape(-1) for t in ins])
            staged_in.append(Staged(flat, read=True, write=False, what="reduce_scatter"))
            staged_out.append(Staged(out, read=False, write=True, what="reduce_scatter"))
        return self._collective(
            "reduce_scatter", [*outputs, *(t for ins in input_lists for t in ins)], [*staged_in, *staged_out],
            lambda async_op: [self.comm.reduce_scatter(i.array, o.array, op, async_op=async_op)
                              for i, o in zip(staged_in, staged_out)],
            lambda: outputs, opts)

    @_options_timeout
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> RedsockWork:
        """``output`` = the reduction over ranks of segment ``rank`` of ``input`` (world × output)."""
        return self._scatter_into_tensors([output], [input], opts, "reduce_scatter_tensor")

    _reduce_scatter_base = reduce_scatter_single

    @_options_timeout
    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> RedsockWork:
        return self._scatter_into_tensors(_as_list(outputs), _as_list(inputs), opts,
                                          "reduce_scatter_tensor_coalesced")

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _scatter_into_tensors(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any,
                              what: str) -> RedsockWork:
        op = _reduce_op(opts.reduceOp if opts is not None else _RedOp.SUM, what)
        return self._paired(outputs, inputs, opts, what, output_is_whole=False,
                            start=lambda i, o, async_op: self.comm.reduce_scatter(i, o, op, async_op=async_op))

    # -- reduce (built on all-reduce) ----------------------------------------------------------

    @_options_timeout
    def reduce(self, tensors: Any, opts: Any = None) -> RedsockWork:
        """Only the root's tensor receives the result; other ranks reduce a copy (left unchanged)."""
        tensors = _as_list(tensors)
        op = _reduce_op(opts.reduceOp if opts is not None else _RedOp.SUM, "reduce")
        root = opts.rootRank if opts is not None else 0
        if not 0 <= root < self._world:
            raise ConfigError(f"redsock reduce: root {root} is not a rank of a group of {self._world}")
        if root == self._me:
            staged = [Staged(t, read=True, write=True, what="reduce") for t in tensors]
        else:
            for t in tensors:
                check_tensor(t, "reduce")
            staged = [Staged(t.detach().clone(), read=True, write=False, what="reduce") for t in tensors]
        return self._collective(
            "reduce", tensors, staged,
            lambda async_op: [self.comm.all_reduce(s.array, op, async_op=async_op) for s in staged],
            lambda: tensors, opts)

    # -- barrier ---------------------------------------------------------------------------

    @_options_timeout
    def barrier(self, opts: Any = None) -> RedsockWork:
        """Done when every rank entered it and this rank's earlier operations are complete."""
        work = self._new_work("barrier", ())
        earlier = [done_future(w) for w in self._tracker.pending()]
        token = np.zeros(1, np.uint8)
        # On the communicator's thread, after every collective submitted before it.
        part = self.comm.all_reduce(token, "sum", algorithm="small", async_op=True).get_future()
        return self._tracker.complete_when_done(work, [*earlier, part], lambda: [], keep=token)

    def monitored_barrier(self, timeout: timedelta | float | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not reach it (gloo's semantics): every rank
        reports to rank 0, which waits for all of them until ``timeout`` (default: the group's),
        then releases them.  Rank 0 raises naming the first missing rank (``wait_all_ranks``:
        all of them); the others raise if rank 0 does not release them in time."""
        seconds = (timeout.total_seconds() if isinstance(timeout, timedelta)
                   else self.comm.config.timeout_s if timeout is None else float(timeout))
        ms = int(seconds * 1000)
        token = np.zeros(1, np.uint8)
        if self._me != 0:
            try:
                self.comm.send(token, 0, _MONITORED_TAG)
                self.comm.recv(token, 0, _MONITORED_TAG, timeout=seconds)
            except RedsockError as e:
                raise BarrierFailure(f"Rank {self._me} successfully reached monitoredBarrier, but received errors "
                                     f"while waiting for send/recv from rank 0: {e}") from e
            return
        if seconds <= 0:
            raise BarrierFailure(f"Rank 0 timed out in monitoredBarrier after {ms} ms")
        deadline = time.monotonic() + seconds
        arrived: set[int] = set()
        try:
            while len(arrived) < self._world - 1:
                arrived.add(self.comm.recv(token, None, _MONITORED_TAG,
                                           timeout=max(0.0, deadline - time.monotonic())))
        except RedsockError as e:
            missing = [r for r in range(1, self._world) if r not in arrived]
            if wait_all_ranks:
                who = f"Ranks {', '.join(map(str, missing))}"
            else:
                who = f"Rank {missing[0]}"
            raise BarrierFailure(f"{who} failed to pass monitoredBarrier in {ms} ms: {e}") from e
        for r in range(1, self._world):
            self.comm.send(token, r, _MONITORED_TAG)

    # -- point-to-point ------------------------------------------------------------------------

    def send(self, tensors: Any, dstRank: int, tag: int = 0) -> RedsockWork:  # noqa: N803 - torch's names
        tensors = _as_list(tensors)
        dst = self._check_peer(dstRank, "send")
        tag = _user_tag(tag, "send")
        staged = [Staged(t, read=True, write=False, what="send") for t in tensors]
        jobs = [("send", dst, tag, _sender(self.comm, s.array, dst, tag)) for s in staged]
        return self._p2p("send", tensors, staged, jobs, lambda: tensors)

    def recv(self, tensors: Any, srcRank: int, tag: int = 0) -> RedsockWork:  # noqa: N803
        tensors = _as_list(tensors)
        src = self._check_peer(srcRank, "recv")
        tag = _user_tag(tag, "recv")
        staged = [Staged(t, read=False, write=True, what="recv") for t in tensors]
        jobs = [("recv", src, tag, _receiver(self.comm, s.array, src, tag)) for s in staged]
        work = self._p2p("recv", tensors, staged, jobs, lambda: tensors)
        work.senders.append(src)
        return work

    def recv_anysource(self, tensors: Any, tag: int = 0) -> RedsockWork:
        """``recv`` from whichever rank's message with ``tag`` arrives first (``dist.recv``
        without ``src``); the work's ``source_rank()`` names that rank."""
        tensors = _as_list(tensors)
        if len(tensors) != 1:
            raise ConfigError(f"redsock recv: expected one tensor, got {len(tensors)}")
        tag = _user_tag(tag, "recv")
        staged = Staged(tensors[0], read=False, write=True, what="recv")
        senders: list[int] = []
        # Its own lane: it waits on every peer, so it must not queue behind a receive from one.
        jobs = [("recv", _ANY_SOURCE, tag, lambda: senders.append(self.comm.recv(staged.array, None, tag)))]
        work = self._p2p("recvAnySource", tensors, [staged], jobs, lambda: tensors)
        work.senders = senders  # filled before the work completes
        return work

    # -- all-to-all --------------------------------------------------------------------------

    @_options_timeout
    def alltoall(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> RedsockWork:
        """List form: ``output_tensors[j]`` = rank j's ``input_tensors[rank]``."""
        outputs, inputs = _as_list(output_tensors), _as_list(input_tensors)
        if len(outputs) != self._world or len(inputs) != self._world:
            raise ConfigError(f"redsock alltoall: expected {self._world} input and output tensors, "
                              f"got {len(inputs)} and {len(outputs)}")
        staged_in = [Staged(t, read=True, write=False, what="alltoall") for t in inputs]
        staged_out = [Staged(t, read=False, write=True, what="alltoall") for t in outputs]
        me = self._me
        if staged_in[me].array.nbytes != staged_out[me].array.nbytes or inputs[me].dtype != outputs[me].dtype:
            raise ConfigError("redsock alltoall: input and output tensors for this rank differ in size or dtype")
        sync_devices(inputs)  # (CUDA: the staged copy must have landed before we read it)
        staged_out[me].array[...] = staged_in[me].array
        jobs = self._exchange([s.array for s in staged_in], [s.array for s in staged_out], _ALLTOALL_TAG)
        return self._p2p("all_to_all", [*outputs, *inputs], [*staged_in, *staged_out], jobs, lambda: outputs,
                         inputs=inputs)

    @_options_timeout
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                          input_split_sizes: Sequence[int], opts: Any = None) -> RedsockWork:
        """Rows (dim 0) ``input_split_sizes[j]`` go to rank j; rank j's rows land at
        ``output_split_sizes[j]``.  Empty split lists mean equal splits."""
        check_tensor(output, "alltoall_base")
        check_tensor(input, "alltoall_base")
        if output.dtype != input.dtype:
            raise ConfigError(f"redsock alltoall_base: input is {input.dtype} but output is {output.dtype}")
        in_splits = _splits(input, input_split_sizes, self._world, "input")
        out_splits = _splits(output, output_split_sizes, self._world, "output")
        row_in, row_out = _row_numel(input), _row_numel(output)
        if row_in != row_out and input.numel() and output.numel():
            raise ConfigError(f"redsock alltoall_base: rows of input ({row_in} elements) and output "
                              f"({row_out}) differ")
        src = Staged(input, read=True, write=False, what="alltoall_base")
        dst = Staged(output, read=False, write=True, what="alltoall_base")
        sends = _segments(src.array, in_splits, row_in)
        recvs = _segments(dst.array, out_splits, row_out)
        me = self._me
        if sends[me].size != recvs[me].size:
            raise ConfigError(f"redsock alltoall_base: this rank sends itself {sends[me].size} elements "
                              f"but expects {recvs[me].size}")
        sync_devices([input])
        recvs[me][...] = sends[me]
        jobs = self._exchange(sends, recvs, _ALLTOALL_TAG)
        return self._p2p("all_to_all", [output, input], [src, dst], jobs, lambda: [output], inputs=[input])

    alltoall_base = all_to_all_single

    def _exchange(self, sends: list[np.ndarray], recvs: list[np.ndarray],
                  tag: int) -> list[tuple[str, int, int, Callable[[], None]]]:
        """Send/recv jobs with every other rank, shifted (to rank+i, from rank-i) so no rank
        is everyone's first peer; each (direction, peer) has its own lane, so no job waits
        behind another and the pattern cannot deadlock."""
        jobs = []
        world, me = self._world, self._me
        for i in range(1, world):
            to, frm = (me + i) % world, (me - i) % world
            jobs.append(("send", to, tag, _sender(self.comm, sends[to], to, tag)))
            jobs.append(("recv", frm, tag, _receiver(self.comm, recvs[frm], frm, tag)))
        return jobs

    # -- gather / scatter (point-to-point to or from the root) ---------------------------------

    @_options_timeout
    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> RedsockWork:
        inputs = _as_list(input_tensors)
        root = opts.rootRank if opts is not None else 0
        if len(inputs) != 1:
            raise ConfigError(f"redsock gather: expected one input tensor, got {len(inputs)}")
        src = Staged(inputs[0], read=True, write=False, what="gather")
        if root != self._me:
            self._check_peer(root, "gather root")
            jobs = [("send", root, _GATHER_TAG, _sender(self.comm, src.array, root, _GATHER_TAG))]
            return self._p2p("gather", inputs, [src], jobs, lambda: [])
        outs, staged = self._root_tensors("gather", output_tensors, src, "output", "input", write=True)
        sync_devices(inputs)
        staged[self._me].array[...] = src.array
        jobs = [("recv", r, _GATHER_TAG, _receiver(self.comm, s.array, r, _GATHER_TAG))
                for r, s in enumerate(staged) if r != self._me]
        return self._p2p("gather", [*inputs, *outs], [src, *staged], jobs, lambda: outs, inputs=inputs)

    @_options_timeout
    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> RedsockWork:
        outputs = _as_list(output_tensors)
        root = opts.rootRank if opts is not None else 0
        if len(outputs) != 1:
            raise ConfigError(f"redsock scatter: expected one output tensor, got {len(outputs)}")
        dst = Staged(outputs[0], read=False, write=True, what="scatter")
        if root != self._me:
            self._check_peer(root, "scatter root")
            jobs = [("recv", root, _SCATTER_TAG, _receiver(self.comm, dst.array, root, _SCATTER_TAG))]
            return self._p2p("scatter", outputs, [dst], jobs, lambda: outputs)
        ins, staged = self._root_tensors("scatter", input_tensors, dst, "input", "output", write=False)
        sync_devices(ins)
        dst.array[...] = staged[self._me].array
        jobs = [("send", r, _SCATTER_TAG, _sender(self.comm, s.array, r, _SCATTER_TAG))
                for r, s in enumerate(staged) if r != self._me]
        return self._p2p("scatter", [*outputs, *ins], [dst, *staged], jobs, lambda: outputs, inputs=outputs)

    def _root_tensors(self, what: str, tensor_lists: Any, mine: Staged, kind: str, other: str,
                      write: bool) -> tuple[list[Any], list[Staged]]:
        """The root's one list of world-size tensors for gather (outputs) or scatter (inputs),
        staged, each the size and dtype of this rank's own ``other`` tensor."""
        lists = [list(t) for t in tensor_lists]
        if len(lists) != 1 or len(lists[0]) != self._world:
            raise ConfigError(f"redsock {what}: the root needs one list of {self._world} {kind} tensors")
        staged = [Staged(t, read=not write, write=write, what=what) for t in lists[0]]
        for r, s in enumerate(staged):
            if s.array.nbytes != mine.array.nbytes or s.tensor.dtype != mine.tensor.dtype:
                raise ConfigError(f"redsock {what}: {kind} tensor {r} differs from the {other} in size or dtype")
        return lists[0], staged

    # -- coalescing (torch's _coalescing_manager) ---------------------------------------------

    def start_coalescing(self, device: Any = None) -> None:
        # Operations already run asynchronously; coalescing only groups their Works.
        self._tracker.start_coalescing()

    def end_coalescing(self, device: Any = None) -> RedsockWork:
        works = self._tracker.end_coalescing()
        work = self._new_work("coalesced", ())
        return self._tracker.complete_when_done(work, [done_future(w) for w in works], lambda: [])

    # torch 2.13's _coalescing_manager calls these bindings directly (its C++ side does not
    # dispatch them to Python); newer versions reach start_/end_coalescing above.
    _start_coalescing = start_coalescing
    _end_coalescing = end_coalescing

    # -- lifetime ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Close the communicator (``dist.destroy_process_group``); operations still queued fail."""
        if self._shut:
            return
        self._shut = True
        self._lanes.shutdown()
        self.comm.close()
        self._tracker.close()

    def abort(self) -> None:
        self.shutdown()


def _user_tag(tag: int, what: str) -> int:
    if not isinstance(tag, int) or not 0 <= tag < _MAX_USER_TAG:
        raise ConfigError(f"redsock {what}: tag must be an integer in [0, 2**31), got {tag!r}")
    return tag


def _sender(comm: Communicator, array: np.ndarray, dst: int, tag: int) -> Callable[[], None]:
    return lambda: comm.send(array, dst, tag)


def _receiver(comm: Communicator, array: np.ndarray, src: int, tag: int) -> Callable[[], None]:
    return lambda: comm.recv(array, src, tag)


def _row_numel(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) if t.dim() > 0 else 1


def _splits(t: torch.Tensor, sizes: Sequence[int], world: int, what: str) -> list[int]:
    rows = t.shape[0] if t.dim() > 0 else 1
    if not sizes:
        if rows % world:
            raise ConfigError(f"redsock alltoall_base: {what} has {rows} rows, not divisible by the world "
                              f"size {world}; pass {what}_split_sizes")
        return [rows // world] * world
    sizes = [int(s) for s in sizes]
    if len(sizes) != world or any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise ConfigError(f"redsock alltoall_base: {what}_split_sizes {sizes} must be {world} non-negative "
                          f"row counts summing to {rows}")
    return sizes


def _segments(flat: np.ndarray, splits: list[int], row: int) -> list[np.ndarray]:
    out, start = [], 0
    for s in splits:
        out.append(flat[start:start + s * row])
        start += s * row
    return out
