"""A 1 GiB float32 tensor registers, pulls and pushes exactly across two shard processes."""

import pytest
import torch

from pswire.optim import OptimizerConfig
from pswire.placement import model_spec
from psworker.client import ClientOptions, PSClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

GIB = 1 << 30


def test_one_gib_tensor_round_trip_is_exact(shards):
    a, b = shards(2)
    rows, cols = GIB // 4 // 4096, 4096
    # Small integers and halves are exact in float32, so the SGD update is exact too.
    value = (torch.arange(rows * cols, dtype=torch.int32) % 1024).to(torch.float32).reshape(rows, cols)
    spec = model_spec([("embedding", value)])
    with PSClient([a.address, b.address], ClientOptions(timeout=120)) as client:
        client.wait_connected()
        assert client.register(spec, OptimizerConfig(name="sgd", lr=1.0), worker_name="big",
                               initial_values={"embedding": value})
        assert client.placement.shard_bytes() == [GIB // 2, GIB // 2]
        pulled = torch.empty_like(value)
        client.pull({"embedding": pulled}, skip_unchanged=False)
        assert torch.equal(pulled, value)

        grad = torch.full_like(value, 0.5)
        responses = client.push({"embedding": grad})
        assert [r.version for r in responses] == [1, 1]
        del grad
        value.sub_(0.5)
        client.pull({"embedding": pulled}, skip_unchanged=False)
        assert torch.equal(pulled, value)
        status = client.status()
        assert [s.bytes_held for s in status] == [GIB // 2, GIB // 2]
