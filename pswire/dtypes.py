"""The element types tensors may have on the wire, independent of any tensor library.

A shard holds variables as numpy arrays and never imports torch; a worker holds them as torch
tensors. Both name a dtype by the same :class:`DType`, and :func:`dtype_of` accepts a numpy dtype,
a torch dtype (recognised by its name, so torch is never imported here) or a name.

numpy has no bfloat16; ``ml_dtypes`` (the one JAX and TensorFlow use) supplies it, with the
conversions and arithmetic ufuncs numpy's own float16 has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from pswire.errors import InvalidArgumentError
from pswire.v1 import ps_pb2

__all__ = [
    "BFLOAT16", "FLOAT16", "FLOAT32", "FLOAT64", "INT8", "INT32", "INT64", "UINT8",
    "DType", "dtype_from_safetensors", "dtype_from_wire", "dtype_name", "dtype_of", "dtype_to_wire",
]


@dataclass(frozen=True)
class DType:
    """One element type: its name (as torch spells it), wire enum, numpy dtype and safetensors code."""

    name: str
    wire: int
    numpy: np.dtype = field(compare=False)
    safetensors: str = field(compare=False)

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @property
    def is_floating_point(self) -> bool:
        return self.name.startswith(("float", "bfloat"))

    def __str__(self) -> str:
        return self.name


FLOAT32 = DType("float32", ps_pb2.FLOAT32, np.dtype(np.float32), "F32")
FLOAT64 = DType("float64", ps_pb2.FLOAT64, np.dtype(np.float64), "F64")
FLOAT16 = DType("float16", ps_pb2.FLOAT16, np.dtype(np.float16), "F16")
BFLOAT16 = DType("bfloat16", ps_pb2.BFLOAT16, np.dtype(ml_dtypes.bfloat16), "BF16")
INT64 = DType("int64", ps_pb2.INT64, np.dtype(np.int64), "I64")
INT32 = DType("int32", ps_pb2.INT32, np.dtype(np.int32), "I32")
INT8 = DType("int8", ps_pb2.INT8, np.dtype(np.int8), "I8")
UINT8 = DType("uint8", ps_pb2.UINT8, np.dtype(np.uint8), "U8")

_ALL = (FLOAT32, FLOAT64, FLOAT16, BFLOAT16, INT64, INT32, INT8, UINT8)
_BY_NAME = {d.name: d for d in _ALL}
_BY_WIRE = {d.wire: d for d in _ALL}
_BY_SAFETENSORS = {d.safetensors: d for d in _ALL}


def _supported() -> str:
    return ", ".join(_BY_NAME)


def _lookup(table: dict[Any, DType], key: Any, what: str) -> DType:
    try:
        return table[key]
    except KeyError:
        raise InvalidArgumentError(f"{what} (supported: {_supported()})") from None


def dtype_of(dtype: Any) -> DType:
    """The :class:`DType` of a DType, a numpy dtype (or scalar type), a torch dtype or a name such
    as ``"float32"``. Raises ``InvalidArgumentError`` naming the dtype if the wire cannot carry it."""
    if isinstance(dtype, DType):
        return dtype
    if type(dtype).__module__ == "torch":  # every part of every step: looked up once per dtype
        known = _BY_TORCH.get(dtype)
        if known is None:  # torch.dtype prints as "torch.float32"
            known = _BY_TORCH[dtype] = _lookup(_BY_NAME, str(dtype).removeprefix("torch."),
                                               f"dtype {dtype} cannot be sent")
        return known
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    return _lookup(_BY_NAME, name, f"dtype {dtype} cannot be sent")


_BY_TORCH: dict[Any, DType] = {}
"""torch dtypes seen, by object (this module never imports torch)."""


def dtype_from_safetensors(code: str) -> DType:
    """The DType of a safetensors dtype code (``"F32"``); raises ``InvalidArgumentError``."""
    return _lookup(_BY_SAFETENSORS, code, f"safetensors dtype {code!r} is not one a shard holds")


def dtype_to_wire(dtype: Any) -> int:
    """Wire enum of anything :func:`dtype_of` accepts; raises ``InvalidArgumentError`` for unsupported dtypes."""
    return dtype_of(dtype).wire


def dtype_from_wire(value: int) -> DType:
    """DType of a wire enum; raises ``InvalidArgumentError`` for unknown values."""
    return _lookup(_BY_WIRE, value, f"unknown wire dtype {value}")


def dtype_name(dtype: Any) -> str:
    return dtype_of(dtype).name
