import pytest
import torch

from pswire.codec import ChunkAssembler, Part, dtype_from_wire, dtype_to_wire, iter_chunks, tensor_bytes
from pswire.errors import InvalidArgumentError
from pswire.v1 import ps_pb2

pytestmark = pytest.mark.timeout(60)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.float64, torch.int32]


def _sample(dtype: torch.dtype, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 1e3).to(dtype)
    return torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int64).to(dtype)


def _round_trip(tensor: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    part = Part("v", tuple(tensor.shape), tensor.dtype, 0, tensor.shape[0] if tensor.dim() else 1)
    assembler = ChunkAssembler([part])
    for chunk in iter_chunks([tensor_bytes(tensor)], chunk_bytes):
        # Through the real wire encoding, not just the Python object.
        assembler.add(ps_pb2.TensorChunk.FromString(chunk.SerializeToString()))
    return assembler.finish()[0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (1,), (7, 3), (1000, 33)])
def test_round_trip_is_bit_exact(dtype, shape):
    tensor = _sample(dtype, shape)
    out = _round_trip(tensor, 1024)
    assert out.dtype == dtype and tuple(out.shape) == shape
    assert torch.equal(out.view(torch.uint8) if out.dim() else out, tensor.view(torch.uint8) if tensor.dim() else tensor)


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_chunk_boundaries(extra):
    chunk = 1024
    tensor = (torch.arange(3 * chunk + extra) % 251).to(torch.uint8)
    nbytes = tensor.numel()
    chunks = list(iter_chunks([tensor_bytes(tensor)], chunk))
    assert [len(c.data) for c in chunks[:-1]] == [chunk] * (len(chunks) - 1)
    assert sum(len(c.data) for c in chunks) == nbytes
    assert [c.offset for c in chunks] == list(range(0, nbytes, chunk))
    assert torch.equal(_round_trip(tensor, chunk), tensor)


def test_wire_bytes_are_little_endian_raw():
    tensor = torch.tensor([1.0, -2.0], dtype=torch.float32)
    assert bytes(tensor_bytes(tensor)) == b"\x00\x00\x80\x3f\x00\x00\x00\xc0"


def test_empty_tensor_sends_no_chunks():
    assert list(iter_chunks([tensor_bytes(torch.empty(0, 5))])) == []


def test_assembler_refuses_gaps_overflow_and_short_parts():
    part = Part("w", (4,), torch.float32, 0, 4)
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


def test_assembler_writes_into_destination_without_copy():
    dest = torch.zeros(2, 3)
    part = Part("w", (4, 3), torch.float32, 2, 4)
    a = ChunkAssembler([part], [dest])
    src = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    for c in iter_chunks([tensor_bytes(src)], 1024):
        a.add(c)
    (out,) = a.finish()
    assert out.data_ptr() == dest.data_ptr() and torch.equal(dest, src)


def test_dtype_mapping_round_trips_and_rejects_unknown():
    for dtype in DTYPES:
        assert dtype_from_wire(dtype_to_wire(dtype)) == dtype
    with pytest.raises(InvalidArgumentError, match="unknown wire dtype"):
        dtype_from_wire(99)
    with pytest.raises(InvalidArgumentError, match="cannot be sent"):
        dtype_to_wire(torch.complex64)


def test_tensor_bytes_refuses_views_that_would_need_a_copy():
    with pytest.raises(ValueError, match="contiguous"):
        tensor_bytes(torch.zeros(4, 4).t())


def test_part_from_proto_validates_rows():
    msg = Part("w", (4, 2), torch.float32, 0, 4).to_proto()
    assert Part.from_proto(msg).key == "w"
    msg.row_end = 9
    with pytest.raises(InvalidArgumentError, match="outside its 4 rows"):
        Part.from_proto(msg)
    split = Part("w", (4, 2), torch.float32, 2, 4)
    assert split.key == "w[2:4]" and split.shape == (2, 2) and split.nbytes == 16
