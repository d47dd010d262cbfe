"""The wire contract shared by shards and workers: generated protobuf stubs (``pswire.v1``),
the tensor codec, the placement function and the domain errors."""

WIRE_VERSION = "pswire.v1"
