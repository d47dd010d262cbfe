"""``psworker.ElasticSampler`` in ordinary DataLoader loops.

Two copies of ``examples/elastic_sampler.py`` against real shards share the job's data exactly
and learn; and, against one in-process shard, a loop that breaks early has exactly the examples
its optimizer stepped counted as trained (``lag`` covering a DataLoader that fetches ahead),
while ``session.close()`` hands the rest back for another worker to train.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import psworker
from psserver.config import ServerConfig
from psserver.server import create_server
from psworker.client import ClientOptions, PSClient
from psworker.elastic import epoch_order
from tests.conftest import ROOT, child_env, terminate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

OPTIONS = ClientOptions(timeout=10.0, connect_timeout=30.0)

# examples/elastic_sampler.py's job: 3 epochs of 4096 examples in tasks of 256.
EXAMPLE_TOTAL = 3 * 4096
EXAMPLE_TASKS = EXAMPLE_TOTAL // 256
TRAINED = re.compile(r"^(\S+) trained (\d+) examples in (\d+) tasks of the job's (\d+)$", re.M)
ACCURACY = re.compile(r"^(\S+) final accuracy (\S+)$", re.M)


def _queue(ps: str):
    with PSClient(ps, OPTIONS) as client:
        return client.status()[0].data


def test_two_copies_of_the_example_share_the_job_exactly_and_learn(shards):
    a, b = shards(2)
    ps = f"{a.address},{b.address}"
    copies = [
        subprocess.Popen([sys.executable, "-m", "examples.elastic_sampler", ps], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT)
        for _ in range(2)
    ]
    try:
        outputs = [copy.communicate(timeout=240) for copy in copies]
    finally:
        for copy in copies:
            terminate(copy)
    for copy, (out, err) in zip(copies, outputs):
        assert copy.returncode == 0, err[-3000:]
    trained = [TRAINED.search(out) for out, _ in outputs]
    assert all(trained), outputs
    names = [m.group(1) for m in trained]
    assert len(set(names)) == 2, names  # host-pid: distinct workers
    # What the two loops trained adds up to the job: no example skipped, none trained twice.
    assert {int(m.group(4)) for m in trained} == {EXAMPLE_TOTAL}
    assert sum(int(m.group(2)) for m in trained) == EXAMPLE_TOTAL, outputs
    assert sum(int(m.group(3)) for m in trained) == EXAMPLE_TASKS, outputs
    queue = _queue(ps)
    assert queue.finished and queue.examples_total == EXAMPLE_TOTAL, queue
    assert queue.examples_done == EXAMPLE_TOTAL and queue.tasks_done == EXAMPLE_TASKS, queue
    assert queue.tasks_leased == 0 and queue.tasks_requeued == 0, queue
    # Both evaluate the job's final weights (every step was in before the job's data was done).
    accuracies = [float(ACCURACY.search(out).group(2)) for out, _ in outputs]
    assert accuracies[0] == accuracies[1], accuracies
    assert accuracies[0] > 0.85, outputs  # untrained: about 0.5 (the largest class); one task: 0.66


# -- the sampler's accounting, against one in-process shard ------------------------------------

SIZE = 64
TASK = 16
BATCH = 6
"""Not a divisor of TASK: batches straddle tasks, so the count is per example, not per batch."""
STEPS = 5
"""Steps the first worker takes before its loop breaks (with one more batch in hand, unstepped)."""


@pytest.fixture
def shard():
    started = create_server(ServerConfig(port=0))
    yield started
    started.stop(grace=0)


def _dataset() -> TensorDataset:
    index = torch.arange(SIZE)
    x = (index.float() / SIZE).unsqueeze(1)
    return TensorDataset(x, 2 * x + 1, index)  # the third column says which example a row is


def _worker(address: str, name: str):
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    session = psworker.connect(address, worker_name=name, options=OPTIONS)
    model, optimizer = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return session, model, optimizer


def _train(loader, model, optimizer, steps: int | None = None) -> list[int]:
    """Step through ``loader``; with ``steps``, break once that many steps are done, holding the
    next batch unstepped. Returns the examples stepped, in order."""
    stepped: list[int] = []
    for number, (x, y, index) in enumerate(loader):
        if number == steps:
            break
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        stepped += index.tolist()
    return stepped


@pytest.mark.parametrize(("loader_kw", "lag", "counted"), [
    pytest.param({}, 0, STEPS * BATCH, id="in-process-loader"),
    # A lag beyond the loader's lookahead is safe: the last 2 batches stepped go back (trained twice).
    pytest.param({}, 2, (STEPS - 2) * BATCH, id="in-process-loader-lag-2"),
    # One loader process fetching 2 batches ahead: lag 1 * 2 counts exactly the batches stepped.
    pytest.param({"num_workers": 1, "prefetch_factor": 2, "multiprocessing_context": "spawn"}, 2, STEPS * BATCH,
                 id="prefetching-loader"),
])
def test_a_loop_that_breaks_early_hands_back_what_it_did_not_train(shard, loader_kw, lag, counted):
    dataset = _dataset()
    session, model, optimizer = _worker(shard.address, "first")
    sampler = psworker.ElasticSampler(session, SIZE, seed=3, task_size=TASK, lag=lag)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, **loader_kw)
    stepped = _train(loader, model, optimizer, steps=STEPS)
    assert len(stepped) == STEPS * BATCH
    session.close()  # reports what was trained of the task in hand, hands back the rest

    queue = _queue(shard.address)
    assert queue.examples_done == counted and sampler.feed.examples == counted, queue
    assert queue.tasks_done == counted // TASK and queue.tasks_leased == 0 and not queue.finished, queue
    # The rest is queued, not done: the task in hand's remainder, the tasks taken or prefetched, the uncut.
    assert queue.tasks_queued == SIZE // TASK - counted // TASK, queue

    # A second worker, its loader fetching ahead, trains exactly the rest: together every example
    # once, beside the batches the first stepped beyond what its lag let it count. Its batches do
    # not divide a task: the last one is part-filled when the job's data runs out.
    session, model, optimizer = _worker(shard.address, "second")
    sampler = psworker.ElasticSampler(session, SIZE, seed=3, task_size=TASK, lag=2)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=1, prefetch_factor=2,
                        multiprocessing_context="spawn")
    rest: list[int] = []
    while not sampler.finished:
        rest += _train(loader, model, optimizer)
    session.close()
    assert Counter(stepped[:counted] + rest) == Counter(range(SIZE))
    assert stepped[:counted] == epoch_order(SIZE, 3, 0)[:counted].tolist()  # the job's order, task by task
    queue = _queue(shard.address)
    assert queue.finished and queue.examples_done == SIZE and queue.tasks_leased == 0, queue


def test_a_task_that_went_back_on_a_re_registration_is_not_yielded_further(shard):
    """Fenced and registered again (as ``DistributedOptimizer.step`` does), the worker's tasks went
    back to the queue: the sampler stops yielding the old task and goes on with a fresh lease."""
    session, _, _ = _worker(shard.address, "fenced")
    sampler = psworker.ElasticSampler(session, SIZE, seed=3, task_size=TASK, prefetch=0)
    taken = iter(sampler)
    first = [next(taken) for _ in range(4)]
    session.rejoin()
    after = next(taken)
    order = epoch_order(SIZE, 3, 0).tolist()
    assert first == order[:4] and after != order[4]
    # The old task's rest went back whole and was leased again, first: the new lease starts it over.
    assert after == order[0]
    session.close()
    queue = _queue(shard.address)
    assert queue.examples_done == 0 and queue.tasks_leased == 0, queue
