import ml_dtypes
import numpy as np
import pytest
import torch

from psworker.tensors import tensor_bytes, torch_dtype
from pswire.codec import ChunkAssembler, Part, array_bytes, dtype_from_wire, dtype_to_wire, iter_chunks
from pswire.dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, INT8, INT32, INT64, UINT8, DType, dtype_of
from pswire.errors import InvalidArgumentError
from pswire.v1 import ps_pb2

pytestmark = pytest.mark.timeout(60)

DTYPES = [FLOAT32, FLOAT16, BFLOAT16, INT64, FLOAT64, INT32, INT8, UINT8]


def _sample(dtype: DType, shape) -> np.ndarray:
    rng = np.random.default_rng(7)
    if dtype.is_floating_point:
        return (rng.standard_normal(shape) * 1e3).astype(dtype.numpy)
    return rng.integers(-(2**31), 2**31, shape, dtype=np.int64).astype(dtype.numpy)


def _part_of(array: np.ndarray) -> Part:
    return Part("v", tuple(array.shape), dtype_of(array.dtype), 0, array.shape[0] if array.ndim else 1)


def _round_trip(array: np.ndarray, chunk_bytes: int) -> np.ndarray:
    assembler = ChunkAssembler([_part_of(array)])
    for chunk in iter_chunks([array_bytes(array)], chunk_bytes):
        # Through the real wire encoding, not just the Python object.
        assembler.add(ps_pb2.TensorChunk.FromString(chunk.SerializeToString()))
    return assembler.finish()[0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (1,), (7, 3), (1000, 33)])
def test_round_trip_is_bit_exact(dtype, shape):
    array = _sample(dtype, shape)
    out = _round_trip(array, 1024)
    assert out.dtype == dtype.numpy and out.shape == shape
    assert out.tobytes() == array.tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_tensor_round_trips_into_a_torch_destination(dtype):
    """A worker sends a tensor's bytes and receives straight into another tensor: bit exact."""
    src = torch.from_numpy(_sample(dtype, (1000, 33)).view(np.uint8)).view(torch_dtype(dtype)).reshape(1000, 33)
    dest = torch.zeros_like(src)
    assembler = ChunkAssembler([Part("v", (1000, 33), dtype, 0, 1000)], [tensor_bytes(dest)])
    for chunk in iter_chunks([tensor_bytes(src)], 1024):
        assembler.add(ps_pb2.TensorChunk.FromString(chunk.SerializeToString()))
    assert assembler.finish() == []
    assert torch.equal(dest.view(torch.uint8), src.view(torch.uint8))


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_chunk_boundaries(extra):
    chunk = 1024
    array = (np.arange(3 * chunk + extra) % 251).astype(np.uint8)
    nbytes = array.size
    chunks = list(iter_chunks([array_bytes(array)], chunk))
    assert [len(c.data) for c in chunks[:-1]] == [chunk] * (len(chunks) - 1)
    assert sum(len(c.data) for c in chunks) == nbytes
    assert [c.offset for c in chunks] == list(range(0, nbytes, chunk))
    np.testing.assert_array_equal(_round_trip(array, chunk), array)


def test_wire_bytes_are_little_endian_raw():
    raw = b"\x00\x00\x80\x3f\x00\x00\x00\xc0"
    assert bytes(array_bytes(np.array([1.0, -2.0], dtype=np.float32))) == raw
    assert bytes(tensor_bytes(torch.tensor([1.0, -2.0], dtype=torch.float32))) == raw
    # bfloat16 is the upper half of a float32, the same in numpy (ml_dtypes) and torch.
    assert bytes(array_bytes(np.array([1.0, -2.0], dtype=BFLOAT16.numpy))) == b"\x80\x3f\x00\xc0"
    assert bytes(tensor_bytes(torch.tensor([1.0, -2.0], dtype=torch.bfloat16))) == b"\x80\x3f\x00\xc0"


def test_empty_tensor_sends_no_chunks():
    assert list(iter_chunks([array_bytes(np.empty((0, 5), dtype=np.float32))])) == []
    assert list(iter_chunks([tensor_bytes(torch.empty(0, 5))])) == []


def test_assembler_refuses_gaps_overflow_and_short_parts():
    part = Part("w", (4,), FLOAT32, 0, 4)
    a = ChunkAssembler([part])
    with pytest.raises(InvalidArgumentError, match="expected byte 0"):
        a.add(ps_pb2.TensorChunk(part_index=0, offset=4, data=b"\0" * 4))
    with pytest.raises(InvalidArgumentError, match="exceeds 16 bytes"):
        a.add(ps_pb2.TensorChunk(part_index=0, offset=0, data=b"\0" * 20))
    with pytest.raises(InvalidArgumentError, match="header lists 1 parts"):
        a.add(ps_pb2.TensorChunk(part_index=3, offset=0, data=b"\0"))
    a.add(ps_pb2.TensorChunk(part_index=0, offset=0, data=b"\0" * 8))
    with pytest.raises(InvalidArgumentError, match="byte length of 'w' is 8, expected 16"):
        a.finish()
    # Also when writing into given destinations.
    b = ChunkAssembler([part], [array_bytes(np.zeros(4, dtype=np.float32))])
    b.add(ps_pb2.TensorChunk(part_index=0, offset=0, data=b"\0" * 8))
    with pytest.raises(InvalidArgumentError, match="byte length of 'w' is 8, expected 16"):
        b.finish()


def test_assembler_writes_into_numpy_destination_without_copy():
    dest = np.zeros((2, 3), dtype=np.float32)
    part = Part("w", (4, 3), FLOAT32, 2, 4)
    a = ChunkAssembler([part], [array_bytes(dest)])
    src = np.arange(6, dtype=np.float32).reshape(2, 3)
    for c in iter_chunks([array_bytes(src)], 1024):
        a.add(c)
    assert a.finish() == []  # nothing allocated: the bytes are in dest itself
    np.testing.assert_array_equal(dest, src)


def test_assembler_writes_into_torch_destination_without_copy():
    dest = torch.zeros(2, 3)
    ptr = dest.data_ptr()
    part = Part("w", (4, 3), FLOAT32, 2, 4)
    a = ChunkAssembler([part], [tensor_bytes(dest)])
    src = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    for c in iter_chunks([tensor_bytes(src)], 1024):
        a.add(c)
    assert a.finish() == []
    assert dest.data_ptr() == ptr and torch.equal(dest, src)


def test_assembler_refuses_destinations_of_wrong_size_or_read_only():
    part = Part("w", (4, 3), FLOAT32, 0, 4)
    with pytest.raises(ValueError, match=r"destination for w float32\[4, 3\] is 32 bytes"):
        ChunkAssembler([part], [array_bytes(np.zeros((4, 2), dtype=np.float32))])
    with pytest.raises(ValueError, match="read-only"):
        ChunkAssembler([part], [memoryview(bytes(48))])
    frozen = np.zeros((4, 3), dtype=np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ChunkAssembler([part], [array_bytes(frozen)])
    with pytest.raises(ValueError):  # one destination per part
        ChunkAssembler([part, Part("b", (4,), FLOAT32, 0, 4)], [array_bytes(np.zeros((4, 3), dtype=np.float32))])


def test_dtype_mapping_round_trips_and_rejects_unknown():
    for dtype in DTYPES:
        assert dtype_from_wire(dtype_to_wire(dtype)) == dtype
        assert dtype_to_wire(torch_dtype(dtype)) == dtype_to_wire(dtype.numpy) == dtype.wire
    with pytest.raises(InvalidArgumentError, match="unknown wire dtype"):
        dtype_from_wire(99)
    with pytest.raises(InvalidArgumentError, match="cannot be sent"):
        dtype_to_wire(torch.complex64)


TORCH_DTYPES = {FLOAT32: torch.float32, FLOAT16: torch.float16, BFLOAT16: torch.bfloat16, INT64: torch.int64,
                FLOAT64: torch.float64, INT32: torch.int32, INT8: torch.int8, UINT8: torch.uint8}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_of_accepts_torch_numpy_and_names(dtype):
    """One DType per element type, however it is named; torch and numpy agree on its size."""
    torch_d = TORCH_DTYPES[dtype]
    assert dtype_of(torch_d) is dtype and torch_dtype(dtype) is torch_d
    assert dtype_of(dtype.numpy) is dtype and dtype_of(dtype.numpy.type) is dtype
    assert dtype_of(dtype.name) is dtype and dtype_of(dtype) is dtype
    assert dtype_of(np.zeros(1, dtype=dtype.numpy).dtype) is dtype
    assert dtype.itemsize == torch_d.itemsize and dtype.is_floating_point == torch_d.is_floating_point
    assert str(dtype) == dtype.name == str(torch_d).removeprefix("torch.")


def test_bfloat16_is_ml_dtypes_bfloat16():
    assert BFLOAT16.numpy == np.dtype(ml_dtypes.bfloat16) and dtype_of(ml_dtypes.bfloat16) is BFLOAT16
    assert FLOAT16.numpy == np.dtype(np.float16)


@pytest.mark.parametrize("unsupported, name", [(torch.complex64, "complex64"), (torch.bool, "bool"),
                                               (np.complex64, "complex64"), (np.dtype(np.uint16), "uint16"),
                                               (np.dtype(ml_dtypes.float8_e4m3fn), "float8_e4m3fn"),
                                               ("float128", "float128")],
                         ids=str)
def test_dtype_of_refuses_unsupported_dtypes_naming_them(unsupported, name):
    with pytest.raises(InvalidArgumentError, match=rf"dtype .*{name}.* cannot be sent \(supported: float32"):
        dtype_of(unsupported)


def test_tensor_bytes_are_a_view_and_refuse_what_would_need_a_copy():
    """psworker.tensors.tensor_bytes: a flat byte view of the tensor's own memory, never a copy."""
    t = torch.zeros(2, 3)
    view = tensor_bytes(t)
    assert view.format == "B" and view.nbytes == 24 and not view.readonly
    view[4:8] = np.array([1.5], dtype=np.float32).tobytes()
    assert t[0, 1].item() == 1.5
    with pytest.raises(ValueError, match="contiguous"):
        tensor_bytes(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="CPU"):
        tensor_bytes(torch.zeros(4, device="meta"))


def test_array_bytes_are_a_view_and_refuse_what_would_need_a_copy():
    """pswire.codec.array_bytes: a flat byte view of the array's own memory, never a copy."""
    a = np.zeros((2, 3), dtype=np.float32)
    view = array_bytes(a)
    assert view.format == "B" and view.nbytes == 24 and not view.readonly
    view[4:8] = np.array([1.5], dtype=np.float32).tobytes()
    assert a[0, 1] == 1.5
    assert array_bytes(np.zeros((4, 4))[1:3]).nbytes == 64  # contiguous rows of a larger array: still a view
    with pytest.raises(ValueError, match="contiguous"):
        array_bytes(np.zeros((4, 4)).T)
    with pytest.raises(ValueError, match="contiguous"):
        array_bytes(np.zeros(8)[::2])
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    assert array_bytes(frozen).readonly  # writable only if the array is


def test_part_from_proto_validates_rows():
    msg = Part("w", (4, 2), FLOAT32, 0, 4).to_proto()
    assert Part.from_proto(msg).key == "w" and Part.from_proto(msg).dtype is FLOAT32
    msg.row_end = 9
    with pytest.raises(InvalidArgumentError, match="outside its 4 rows"):
        Part.from_proto(msg)
    split = Part("w", (4, 2), FLOAT32, 2, 4)
    assert split.key == "w[2:4]" and split.shape == (2, 2) and split.nbytes == 16
