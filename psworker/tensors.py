"""Torch tensors at the wire's edge: their bytes without a copy, and their dtypes as pswire names them.

pswire and the shards work with numpy arrays and :class:`pswire.dtypes.DType`; a worker's model
is torch, and these functions are where the two meet.
"""

from __future__ import annotations

import ctypes

import torch

from pswire.codec import array_bytes
from pswire.dtypes import DType

__all__ = ["tensor_bytes", "torch_dtype", "write_bytes"]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor as a flat memoryview, without copying.

    Raises ``ValueError`` for tensors that are not on the CPU or not contiguous, where a view is
    impossible and a silent copy would hide a cost.
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor must be on the CPU to be sent, got {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous to be sent without a copy")
    if tensor.dtype in _NUMPY_VIEWABLE and tensor.numel():  # one view, not three (every part of every step)
        return memoryview(tensor.detach().numpy()).cast("B")
    return array_bytes(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def write_bytes(tensor: torch.Tensor, data: bytes) -> None:
    """Copy ``data`` into a contiguous CPU tensor of exactly as many bytes (a pull's inline
    reply into its destination). Raises ``ValueError`` for any other tensor or byte count."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("tensor must be a contiguous CPU tensor to be written in place")
    nbytes = tensor.numel() * tensor.element_size()
    if len(data) != nbytes:
        raise ValueError(f"{len(data)} bytes for a tensor of {nbytes}")
    if type(data) is bytes and nbytes:
        ctypes.memmove(tensor.data_ptr(), data, nbytes)  # checked above: same size, contiguous
    else:
        tensor_bytes(tensor)[:] = data


_NUMPY_VIEWABLE = frozenset({
    torch.float32, torch.float64, torch.float16, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
    torch.bool,
})
"""Dtypes whose numpy view ``memoryview`` casts to bytes (numpy has no bfloat16)."""


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype of a pswire dtype (they share names)."""
    return getattr(torch, dtype.name)
