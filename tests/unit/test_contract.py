"""The generated code matches proto/, and the public surfaces are what they claim."""

import pytest

import psworker
from pswire import gen
from psworker import client, shard

pytestmark = pytest.mark.timeout(120)


def test_generated_code_matches_proto():
    assert gen.check() == [], "run python -m pswire.gen and commit the result"


def test_psworker_public_surface():
    for name in psworker.__all__:
        assert hasattr(psworker, name), name
    assert set(psworker.__all__) >= {"connect", "Session", "DistributedOptimizer", "Task", "load_task"}


def test_client_and_shard_public_surface():
    for module in (client, shard):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"
    assert set(client.__all__) == {"ClientOptions", "PSClient", "ShardClient", "parse_addresses"}
    assert set(shard.__all__) >= {"ClientOptions", "ShardClient", "parse_addresses"}
    for name in set(client.__all__) & set(shard.__all__):  # re-exported, not copies
        assert getattr(client, name) is getattr(shard, name), name
