"""Torch tensors at the wire's edge: their bytes without a copy, and their dtypes as pswire names them.

pswire and the shards work with numpy arrays and :class:`pswire.dtypes.DType`; a worker's model
is torch, and these two functions are where the two meet.
"""

from __future__ import annotations

import torch

from pswire.codec import array_bytes
from pswire.dtypes import DType

__all__ = ["tensor_bytes", "torch_dtype"]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor as a flat memoryview, without copying.

    Raises ``ValueError`` for tensors that are not on the CPU or not contiguous, where a view is
    impossible and a silent copy would hide a cost.
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor must be on the CPU to be sent, got {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous to be sent without a copy")
    return array_bytes(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype of a pswire dtype (they share names)."""
    return getattr(torch, dtype.name)
