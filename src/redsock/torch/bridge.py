"""Tensors <-> the numpy buffers the collectives work on.

* A contiguous CPU tensor is handed over **without a copy**: ``tensor.numpy()``
  shares its storage (bfloat16, which numpy lacks, is reinterpreted as int16 and
  viewed as ``ml_dtypes.bfloat16``: the same bits).
* A non-contiguous CPU tensor cannot be sent in place (the transport sends flat
  byte ranges), so it goes through a contiguous temporary that is copied back
  after the operation: one extra copy each way, only for such tensors.
* A CUDA tensor is staged through pinned host memory: device-to-host copy
  (non-blocking, then the stream is synchronised so the bytes are there before
  the collective reads them), and host-to-device after the operation.  This is
  the only CUDA-dependent code and it only runs for ``tensor.is_cuda``.

Errors are :class:`~redsock.errors.ConfigError` naming the dtype or layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import ml_dtypes
import numpy as np
import torch

from ..errors import ConfigError

# torch dtype -> numpy dtype, for the dtypes the reduction kernels know (redsock.ops).
_NUMPY_DTYPE: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.int8: np.dtype(np.int8),
    torch.uint8: np.dtype(np.uint8),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
}
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(_NUMPY_DTYPE)
_SUPPORTED_NAMES = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)


def check_tensor(t: object, what: str) -> torch.Tensor:
    """``t`` if redsock can communicate it, else a :class:`ConfigError` saying why."""
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"redsock {what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ConfigError(f"redsock {what}: {t.layout} tensors are not supported (only dense tensors)")
    if t.dtype not in _NUMPY_DTYPE:
        raise ConfigError(f"redsock {what}: dtype {t.dtype} is not supported (supported: {_SUPPORTED_NAMES})")
    if not (t.is_cpu or t.is_cuda):
        raise ConfigError(f"redsock {what}: tensors on {t.device} are not supported (cpu or cuda only)")
    return t


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A flat, C-contiguous numpy view of the contiguous CPU tensor ``t`` (shares memory)."""
    flat = t.detach().reshape(-1)  # a view, since t is contiguous; 1-D is C-contiguous for numpy too
    if t.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return flat.numpy()


class Staged:
    """One tensor as a numpy array for one operation, and how to put the result back.

    ``read``: the operation reads the tensor (its current values must be in the
    array); ``write``: the operation writes it (the array's values must end up in
    the tensor — :meth:`finish`).  Without a copy for contiguous CPU tensors.
    """

    __slots__ = ("tensor", "host", "array", "write")

    def __init__(self, tensor: torch.Tensor, *, read: bool, write: bool, what: str):
        t = check_tensor(tensor, what)
        self.tensor, self.write = t, write
        if t.is_cuda:
            # Pinned memory so the copies are real DMA transfers that can overlap.
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            if read:
                self.host.copy_(t, non_blocking=True)  # ordered after t's producers on the current stream
        elif t.is_contiguous():
            self.host = t
        else:
            self.host = t.contiguous() if read else torch.empty(t.shape, dtype=t.dtype)
        self.array = as_numpy(self.host)

    @property
    def copied(self) -> bool:
        return self.host is not self.tensor

    def finish(self) -> None:
        """Copy the result back into the tensor, if it went through a temporary."""
        if self.write and self.copied:
            copy_into(self.tensor, self.host)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; for a CUDA side, non-blocking then synchronised, so the bytes
    are in place when the operation's future completes."""
    if dst.is_cuda or src.is_cuda:
        dev = dst.device if dst.is_cuda else src.device
        dst.copy_(src, non_blocking=True)
        torch.cuda.current_stream(dev).synchronize()
    else:
        dst.copy_(src)


def sync_devices(tensors: Iterable[torch.Tensor]) -> None:
    """Wait for the device-to-host copies issued by :class:`Staged` (one sync per device)."""
    seen: set[torch.device] = set()
    for t in tensors:
        if t.is_cuda and t.device not in seen:
            seen.add(t.device)
            torch.cuda.current_stream(t.device).synchronize()


def cuda_devices(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The CUDA devices among ``tensors`` (a torch Future holding CUDA tensors must name them)."""
    devs: list[torch.device] = []
    for t in tensors:
        if t.is_cuda and t.device not in devs:
            devs.append(t.device)
    return devs


def host_buffer(like: torch.Tensor, numel: int) -> torch.Tensor:
    """A flat temporary on the host for ``numel`` elements of ``like``'s dtype (pinned when
    ``like`` lives on a GPU, so copies to/from it are asynchronous DMA)."""
    return torch.empty(numel, dtype=like.dtype, pin_memory=like.is_cuda)


def same_numel(tensors: Sequence[torch.Tensor], numel: int, what: str) -> None:
    for i, t in enumerate(tensors):
        if t.numel() != numel:
            raise ConfigError(f"redsock {what}: tensor {i} has {t.numel()} elements, expected {numel} "
                              "(every tensor of the list must have the same size)")


def same_dtype(tensors: Sequence[torch.Tensor], dtype: torch.dtype, what: str) -> None:
    for i, t in enumerate(tensors):
        if t.dtype != dtype:
            raise ConfigError(f"redsock {what}: tensor {i} is {t.dtype}, expected {dtype}")
