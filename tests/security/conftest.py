"""The service tier's in-process shard fixtures, for the security tests that drive one shard, and
the bulk port's live sessions (``lane_harness.sessions``), for the tests of the bulk port."""

from tests.security.lane_harness import sessions  # noqa: F401
from tests.service.shard_harness import make_shard, open_stub, ready, shard, stub  # noqa: F401
