"""A shard's C heap under training (``psserver.buffers.settle_heap``): glibc's malloc keeps the
memory of each call's temporaries for the next call instead of giving it back to the system and
faulting it in again page by page, and a heap the user configured is left as configured.

Counted in page faults of a real ``psserver`` process (``/proc/<pid>/stat``), which do not
depend on the machine's speed. A shard started with glibc's own bounds set in its environment
(``MALLOC_TRIM_THRESHOLD_=131072``, the default value, which also turns glibc's adaptation off)
is the control: it shows what the rows path costs a heap that returns its memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import psworker
from pswire.optim import OptimizerConfig
from psserver.buffers import USER_MALLOC_SETTINGS, settle_heap
from psworker.client import ClientOptions

pytestmark = pytest.mark.timeout(180)

ROWS, DIM, FEATURES, BATCH = 20_000, 64, 4, 512
"""A batch touches about 1,800 distinct rows: 450 KiB of rows per array the shard computes."""
WARM, MEASURED = 15, 60
WAIT = 30.0


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = psworker.ShardedEmbedding(ROWS, DIM, init_scale=0.1, seed=3)
        self.top = nn.Linear(DIM * FEATURES, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.top(self.emb(ids).flatten(1))


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # field 10, minflt


def _faults_per_step(shard, name: str) -> float:
    """Train ``WARM`` steps, then the shard's page faults per step over ``MEASURED`` more."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(11)
    session = psworker.connect(shard.address, worker_name=name,
                               options=ClientOptions(timeout=WAIT, connect_timeout=WAIT))
    try:
        model, optimizer = session.prepare(_Model(), OptimizerConfig(name="adagrad", lr=0.05))
        before = 0
        for step in range(WARM + MEASURED):
            if step == WARM:
                before = _minor_faults(shard.popen.pid)
            ids = torch.randint(0, ROWS, (BATCH, FEATURES), generator=g)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(ids), torch.zeros(BATCH, 1)).backward()
            optimizer.step()
        return (_minor_faults(shard.popen.pid) - before) / MEASURED
    finally:
        session.close()


def test_a_shard_serving_rows_keeps_its_heap_between_calls(shards, monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    control = shards(1)[0]
    for name in (*USER_MALLOC_SETTINGS, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    settled = shards(1)[0]
    returned = _faults_per_step(control, "control")
    kept = _faults_per_step(settled, "settled")
    # Each step pulls its rows and pushes their gradients. The control maps and faults in the
    # memory of both calls' temporaries again (about 3,000 pages a step here); a shard on glibc's
    # defaults without settle_heap, about 670; the settled shard only the table's pages that it
    # touches for the first time, next to none after the warm-up.
    assert returned > 100, f"the control shard faulted only {returned:.0f} pages a step: the test shows nothing"
    assert kept < 25, f"{kept:.1f} page faults a step on the settled shard ({returned:.0f} on the control)"


@pytest.mark.parametrize("name, value", [*((n, "131072") for n in USER_MALLOC_SETTINGS),
                                         ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")])
def test_a_heap_configured_in_the_environment_is_left_as_it_is(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert settle_heap() is False


def test_the_heap_is_settled_where_nothing_configures_it(monkeypatch):
    for name in (*USER_MALLOC_SETTINGS, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    assert settle_heap() is True
