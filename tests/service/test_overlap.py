"""Service tier: ``psworker.connect(..., overlap=True)`` against one real in-process shard.

A step's push and pull run in the background while the next step computes; the model then
lags its own last gradient by exactly one step, and nothing is lost: after ``synchronize`` the
weights hold every push. Values are exact in float32 (lr 0.5, power-of-two gradients).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import psworker
from psserver.config import ServerConfig
from psserver.server import create_server
from pswire.consistency import Consistency, Mode
from psworker.client import ClientOptions

pytestmark = pytest.mark.timeout(120)

OPTIONS = ClientOptions(timeout=10.0, connect_timeout=10.0)
SCALE = torch.tensor([1.0, 2.0, 4.0, 0.5])
"""The loss is (w * SCALE).sum(), so every step's gradient is SCALE whatever w is."""


@pytest.fixture
def shard():
    started = create_server(ServerConfig(port=0))
    yield started
    started.stop(grace=0)


def _model() -> nn.Module:
    model = nn.Module()
    model.w = nn.Parameter(torch.tensor([8.0, 4.0, -2.0, 1.0]))
    return model


@pytest.mark.parametrize("set_to_none", [True, False])
def test_overlapped_steps_lag_one_step_and_lose_nothing(shard, set_to_none):
    model = _model()
    start = model.w.detach().clone()
    with psworker.connect(shard.address, worker_name="w0", options=OPTIONS, overlap=True) as session:
        model, optimizer = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
        for step in range(1, 6):
            optimizer.zero_grad(set_to_none=set_to_none)  # in place when False: the push has a copy
            (model.w * SCALE).sum().backward()
            optimizer.step()
            # Loaded now: the weights after the previous step's push, not this one's (in flight).
            assert torch.equal(model.w.detach(), start - 0.5 * (step - 1) * SCALE)
        session.synchronize()
        assert torch.equal(model.w.detach(), start - 0.5 * 5 * SCALE)
        (status,) = session.status()
        assert status.pushes_applied == 5 and status.max_staleness == 1


def test_overlap_is_refused_for_ssp_and_sync(shard):
    model = _model()
    with psworker.connect(shard.address, worker_name="w0", options=OPTIONS, overlap=True) as session:
        with pytest.raises(ValueError, match="async"):
            session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5),
                            consistency=Consistency(mode=Mode.SSP, staleness=2))
