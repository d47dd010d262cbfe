"""Chunk messages encoded and decoded by hand, byte-compatible with ``ps.proto``.

A chunk is ``TensorMessage{chunk: TensorChunk{part_index, offset, data}}`` (``PullMessage`` has
the same layout). Going through protobuf costs three copies of every byte on each side: into
the message, into its serialisation, and out of the parsed message. Here a chunk is written
straight from the tensor's memory into the bytes gRPC sends (one copy), and read as a
``memoryview`` of the bytes gRPC received (no copy) that the assembler copies into place. The
bytes on the wire are exactly what protobuf would produce, so any client built from
``ps.proto`` in any language talks to these servers and they to it; a message that does not
have the plain shape this decoder expects is handed to protobuf instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

from google.protobuf.message import Message

__all__ = ["Chunk", "decoder", "encode_chunk", "serialize"]

M = TypeVar("M", bound=Message)

_HEADER_TAG = 0x0A  # field 1 (header), length-delimited
_CHUNK_TAG = 0x12  # field 2 (chunk), length-delimited


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk as the assembler reads it; ``data`` may be a view into a received message."""

    part_index: int
    offset: int
    data: bytes | memoryview


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def encode_chunk(part_index: int, offset: int, data: memoryview) -> bytes:
    """The serialised message for one chunk, built with a single copy of ``data``."""
    if part_index < 0 or offset < 0:
        raise ValueError("part_index and offset must be >= 0")
    fields = b"".join((
        b"\x08" + _varint(part_index) if part_index else b"",
        b"\x10" + _varint(offset) if offset else b"",
        b"\x1a" + _varint(len(data)) if len(data) else b"",  # proto3 leaves defaults out
    ))
    prefix = bytes((_CHUNK_TAG,)) + _varint(len(fields) + len(data)) + fields
    return b"".join((prefix, data))


def serialize(message: Message | bytes) -> bytes:
    """gRPC request/response serialiser: messages through protobuf, encoded chunks as they are."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def _parse_chunk(body: memoryview) -> Chunk | None:
    """The fields of a ``TensorChunk``, or None if it is not in the plain shape (each field at
    most once, no unknown fields): protobuf then decides."""
    part_index = offset = 0
    data: memoryview | None = None
    seen = set()
    pos = 0
    while pos < len(body):
        tag, pos = _read_varint(body, pos)
        if tag in seen or tag not in (0x08, 0x10, 0x1A):
            return None
        seen.add(tag)
        if tag == 0x1A:
            length, pos = _read_varint(body, pos)
            if pos + length > len(body):
                raise ValueError("chunk data runs past the end of the message")
            data, pos = body[pos : pos + length], pos + length
        else:
            value, pos = _read_varint(body, pos)
            if value >= 1 << 63:
                return None  # a negative int: protobuf reports it
            if tag == 0x08:
                part_index = value
            else:
                offset = value
    return Chunk(part_index, offset, data if data is not None else b"")


def decoder(message_type: type[M]) -> Callable[[bytes], M | Chunk]:
    """A gRPC deserialiser for ``TensorMessage`` or ``PullMessage``: a chunk comes back as a
    :class:`Chunk` viewing the received bytes, anything else as the parsed message.

    Malformed input raises ``google.protobuf.message.DecodeError`` (gRPC then fails the call
    with ``INTERNAL``, as for any message protobuf cannot parse)."""

    def decode(raw: bytes) -> M | Chunk:
        buf = memoryview(raw)
        if len(buf) > 1 and buf[0] == _CHUNK_TAG:
            try:
                length, pos = _read_varint(buf, 1)
                if pos + length == len(buf):
                    chunk = _parse_chunk(buf[pos:])
                    if chunk is not None:
                        return chunk
            except ValueError:
                pass  # protobuf produces the error message
        message = message_type.FromString(raw)
        if message.WhichOneof("kind") == "chunk":
            c = message.chunk
            return Chunk(c.part_index, c.offset, c.data)
        return message

    return decode
