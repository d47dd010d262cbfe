"""Tensors on the wire: raw little-endian bytes plus dtype and shape, moved in chunks.

Senders expose a tensor's memory as a byte view (no copy) and cut it into chunks; receivers
reassemble chunks into buffers allocated once per part (or straight into destination tensors),
checking order, bounds and completeness, and then view the bytes as a tensor without copying.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
import dataclasses
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pswire.dtypes import BFLOAT16, FLOAT16, DType, dtype_from_wire, dtype_name, dtype_of, dtype_to_wire
from pswire.errors import InvalidArgumentError
from pswire.v1 import ps_pb2

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "WIRE_DTYPES",
    "ChunkAssembler",
    "Part",
    "array_bytes",
    "dtype_from_wire",
    "dtype_name",
    "dtype_to_wire",
    "iter_chunks",
    "on_wire",
    "wire_dtype_from_proto",
]

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("pswire sends raw little-endian tensor bytes and needs a little-endian host")

DEFAULT_CHUNK_BYTES = 1 << 20
"""Chunk size on the wire: large enough to amortise per-message cost, far below gRPC's 4 MiB."""

@dataclass(frozen=True)
class Part:
    """A row range ``[row_start, row_end)`` of a model variable, as one shard holds it.

    Scalars and unsplit variables are one part covering every row (a scalar counts as one row).
    """

    name: str
    full_shape: tuple[int, ...]
    dtype: DType
    row_start: int
    row_end: int

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):  # a torch or numpy dtype, or a name
            object.__setattr__(self, "dtype", dtype_of(self.dtype))

    @cached_property
    def rows(self) -> int:
        """Rows of the whole variable (1 for a scalar)."""
        return self.full_shape[0] if self.full_shape else 1

    @cached_property
    def is_whole(self) -> bool:
        return self.row_start == 0 and self.row_end == self.rows

    @cached_property
    def shape(self) -> tuple[int, ...]:
        if not self.full_shape:
            return ()
        return (self.row_end - self.row_start, *self.full_shape[1:])

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @cached_property
    def key(self) -> str:
        """Shard-local identity, also used in pull version maps and error messages."""
        return self.name if self.is_whole else f"{self.name}[{self.row_start}:{self.row_end}]"

    @cached_property
    def spec(self) -> ps_pb2.PartSpec:
        """``to_proto()``, made once: shared, so read it or copy it (a repeated field's
        assignment copies), never change it."""
        return self.to_proto()

    def to_proto(self) -> ps_pb2.PartSpec:
        return ps_pb2.PartSpec(
            name=self.name,
            full_shape=list(self.full_shape),
            dtype=dtype_to_wire(self.dtype),
            row_start=self.row_start,
            row_end=self.row_end,
        )

    @classmethod
    def from_proto(cls, msg: ps_pb2.PartSpec) -> "Part":
        """Parse and validate; raises ``InvalidArgumentError`` naming what is wrong."""
        shape = tuple(int(d) for d in msg.full_shape)
        if not msg.name:
            raise InvalidArgumentError("variable name is empty")
        if any(d < 0 for d in shape):
            raise InvalidArgumentError(f"variable {msg.name!r} has a negative dimension: {shape}")
        part = cls(msg.name, shape, dtype_from_wire(msg.dtype), int(msg.row_start), int(msg.row_end))
        if not 0 <= part.row_start <= part.row_end <= part.rows:
            raise InvalidArgumentError(
                f"variable {msg.name!r}: rows [{part.row_start}:{part.row_end}) "
                f"outside its {part.rows} rows"
            )
        return part

    @classmethod
    def parsed(cls, msg: ps_pb2.PartSpec) -> "Part":
        """``from_proto``, remembered: workers and shards name the same few parts in every push
        and pull (a bounded table, emptied when full)."""
        key = msg.SerializeToString()
        part = _PARSED.get(key)
        if part is None:
            part = cls.from_proto(msg)
            if len(_PARSED) >= _PARSED_MAX:
                _PARSED.clear()
            _PARSED[key] = part
        return part

    def describe(self) -> str:
        return f"{self.key} {dtype_name(self.dtype)}{list(self.shape)}"


_PARSED: dict[bytes, Part] = {}
_PARSED_MAX = 4096


def array_bytes(array: np.ndarray) -> memoryview:
    """The raw bytes of a C-contiguous array as a flat writable-if-the-array-is memoryview,
    without copying. Raises ``ValueError`` for a non-contiguous array, where a view is impossible
    and a silent copy would hide a cost."""
    if not array.flags.c_contiguous:
        raise ValueError("array must be contiguous to be sent without a copy")
    if array.size == 0:
        return memoryview(b"")
    return memoryview(array.reshape(-1).view(np.uint8))


def iter_chunks(
    buffers: Sequence[memoryview], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[ps_pb2.TensorChunk]:
    """Cut each buffer into in-order chunks of at most ``chunk_bytes`` (empty buffers send none)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    for index, buf in enumerate(buffers):
        for offset in range(0, len(buf), chunk_bytes):
            yield ps_pb2.TensorChunk(
                part_index=index, offset=offset, data=bytes(buf[offset : offset + chunk_bytes])
            )


class ChunkAssembler:
    """Reassembles in-order chunks of several parts into preallocated buffers.

    ``destinations`` may supply a writable byte view per part to receive the bytes directly (a
    worker's pull writes straight into model parameters, a shard's push into pooled buffers);
    otherwise an array is allocated per part, and :meth:`finish` returns the arrays.
    """

    def __init__(self, parts: Sequence[Part], destinations: Sequence[memoryview] | None = None) -> None:
        self.parts = list(parts)
        self._arrays: list[np.ndarray] = []
        if destinations is None:
            self._arrays = [np.empty(p.shape, dtype=p.dtype.numpy) for p in self.parts]
            destinations = [array_bytes(a) for a in self._arrays]
        for part, dest in zip(self.parts, destinations, strict=True):
            if dest.nbytes != part.nbytes or dest.readonly:
                raise ValueError(f"destination for {part.describe()} is {dest.nbytes} bytes, "
                                 f"{'read-only' if dest.readonly else 'writable'}")
        self._views = [d.cast("B") if d.format != "B" else d for d in destinations]
        self._received = [0] * len(self.parts)

    def add(self, chunk: ps_pb2.TensorChunk) -> None:
        """Copy one chunk into place; raises ``InvalidArgumentError`` for out-of-order,
        out-of-range or overflowing chunks."""
        index = chunk.part_index
        if not 0 <= index < len(self.parts):
            raise InvalidArgumentError(
                f"chunk names part {index}, but the header lists {len(self.parts)} parts"
            )
        part = self.parts[index]
        expected = self._received[index]
        if chunk.offset != expected:
            raise InvalidArgumentError(
                f"chunk of {part.key!r} at byte {chunk.offset}, expected byte {expected} "
                "(chunks must arrive in order without gaps)"
            )
        end = expected + len(chunk.data)
        if end > part.nbytes:
            raise InvalidArgumentError(
                f"byte length of {part.key!r} exceeds {part.nbytes} bytes "
                f"({part.describe()}); got at least {end}"
            )
        self._views[index][expected:end] = chunk.data
        self._received[index] = end

    def finish(self) -> list[np.ndarray]:
        """The arrays it allocated (none when given destinations); raises
        ``InvalidArgumentError`` if any part is incomplete."""
        for part, got in zip(self.parts, self._received):
            if got != part.nbytes:
                raise InvalidArgumentError(
                    f"byte length of {part.key!r} is {got}, expected {part.nbytes} ({part.describe()})"
                )
        return self._arrays


WIRE_DTYPES = {"fp16": FLOAT16, "bf16": BFLOAT16}
"""Wire compression settings (``--wire-dtype``): the dtypes floating-point parts may travel in."""


def wire_dtype_from_proto(value: int) -> DType | None:
    """The compression a header or request asks for: None for the parts' own dtypes. Raises
    ``InvalidArgumentError`` for anything but FLOAT16 or BFLOAT16."""
    if value == ps_pb2.DTYPE_UNSPECIFIED:
        return None
    dtype = dtype_from_wire(value)
    if dtype not in WIRE_DTYPES.values():
        raise InvalidArgumentError(f"wire dtype must be float16 or bfloat16, got {dtype_name(dtype)}")
    return dtype


def on_wire(part: Part, wire_dtype: DType | None) -> Part:
    """``part`` as its bytes travel: in ``wire_dtype`` when it is floating point (and wider)."""
    if wire_dtype is None or not part.dtype.is_floating_point or part.dtype.itemsize <= wire_dtype.itemsize:
        return part
    return dataclasses.replace(part, dtype=wire_dtype)
