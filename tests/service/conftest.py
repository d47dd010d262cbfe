"""The service tier's fixtures: a real shard in-process on port 0 and its stubs
(``tests/service/shard_harness.py``)."""

from tests.service.shard_harness import make_shard, open_stub, ready, shard, stub  # noqa: F401
