"""The hand-made chunk codec produces protobuf's exact bytes and reads anything protobuf writes."""

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from pswire import frames
from pswire.v1 import ps_pb2

indices = st.integers(min_value=0, max_value=2**31 - 1)
offsets = st.integers(min_value=0, max_value=2**62)
payloads = st.binary(max_size=3000)


@given(indices, offsets, payloads)
def test_encoded_chunk_is_what_protobuf_writes(part_index, offset, data):
    expected = ps_pb2.TensorMessage(
        chunk=ps_pb2.TensorChunk(part_index=part_index, offset=offset, data=data)
    ).SerializeToString(deterministic=True)
    assert frames.encode_chunk(part_index, offset, memoryview(data)) == expected


@pytest.mark.parametrize("message_type", [ps_pb2.TensorMessage, ps_pb2.PullMessage])
@given(part_index=indices, offset=offsets, data=payloads)
def test_decoder_reads_protobuf_chunks_as_views(message_type, part_index, offset, data):
    raw = message_type(chunk=ps_pb2.TensorChunk(part_index=part_index, offset=offset, data=data)).SerializeToString()
    chunk = frames.decoder(message_type)(raw)
    assert isinstance(chunk, frames.Chunk)
    assert (chunk.part_index, chunk.offset, bytes(chunk.data)) == (part_index, offset, data)


def test_headers_and_empty_messages_come_back_as_messages():
    header = ps_pb2.TensorMessage(header=ps_pb2.TensorHeader(worker_id=7, sequence=3))
    decoded = frames.decoder(ps_pb2.TensorMessage)(header.SerializeToString())
    assert decoded == header
    empty = frames.decoder(ps_pb2.TensorMessage)(b"")
    assert isinstance(empty, ps_pb2.TensorMessage) and empty.WhichOneof("kind") is None


def test_unusual_but_valid_encodings_go_through_protobuf():
    chunk = ps_pb2.TensorChunk(part_index=1, offset=4, data=b"abcd")
    inner = chunk.SerializeToString()
    # The data field twice (the last one wins) and an unknown field 9: not the plain shape.
    for body in (inner + b"\x1a\x02xy", inner + b"\x48\x01"):
        raw = b"\x12" + bytes([len(body)]) + body
        expected = ps_pb2.TensorMessage.FromString(raw).chunk
        decoded = frames.decoder(ps_pb2.TensorMessage)(raw)
        assert (decoded.part_index, decoded.offset, bytes(decoded.data)) == (
            expected.part_index, expected.offset, expected.data)


@pytest.mark.parametrize("raw", [
    b"\x12\x05\x1a\x09abc",     # data longer than the message
    b"\x12\x80",                # truncated length
    b"\x12\x03\x08\x01",        # chunk longer than the buffer
])
def test_malformed_chunks_are_refused(raw):
    with pytest.raises(DecodeError):
        frames.decoder(ps_pb2.TensorMessage)(raw)


def test_serialize_passes_encoded_chunks_through():
    encoded = frames.encode_chunk(0, 0, memoryview(b"xyz"))
    assert frames.serialize(encoded) is encoded
    message = ps_pb2.TensorMessage(header=ps_pb2.TensorHeader(worker_id=1))
    assert frames.serialize(message) == message.SerializeToString()
