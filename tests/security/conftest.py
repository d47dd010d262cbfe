"""The service tier's in-process shard fixtures, for the security tests that drive one shard."""

from tests.service.shard_harness import make_shard, open_stub, ready, shard, stub  # noqa: F401
