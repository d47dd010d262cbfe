"""Embedding tables on real shards: one sync worker matches local ``nn.Embedding(sparse=True)``
training to rounding, rows are placed and read as documented, bad row traffic is refused with
the state unchanged, and status shows the tables."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch import nn

import psworker
from pswire import errors
from pswire.consistency import Consistency
from pswire.optim import OptimizerConfig
from pswire.placement import model_spec
from pswire.tables import TableSpec, initial_rows
from pswire.v1 import ps_pb2
from pswire.wire import rows_to_proto
from psworker.client import ClientOptions, PSClient
from psworker.embedding import ShardedEmbedding, localize

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROWS, DIM, FEATURES = 3000, 8, 3


class _Model(nn.Module):
    def __init__(self, optimizer: OptimizerConfig | None = None) -> None:
        super().__init__()
        self.emb = ShardedEmbedding(ROWS, DIM, init_scale=0.1, seed=7, optimizer=optimizer)
        self.top = nn.Linear(DIM * FEATURES, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.top(self.emb(ids).flatten(1))


def _batches(steps: int, batch: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    # Skewed ids with repeats inside a batch: the rows a step touches repeat, as real ones do.
    ranks = (torch.rand(steps, batch, FEATURES, generator=g) ** 3 * ROWS).long()
    targets = torch.randn(steps, batch, 1, generator=g)
    return list(zip(ranks, targets))


@contextlib.contextmanager
def _prepared(address: str, model: nn.Module | None = None, optimizer: OptimizerConfig | None = None,
              name: str = "w0", **prepare):
    """A session of one worker with ``model`` (default ``_Model()`` from seed 0) prepared:
    ``(session, model, optimizer)``; closed (the worker leaves) afterwards."""
    torch.manual_seed(0)
    session = psworker.connect(address, worker_name=name, options=ClientOptions(timeout=30))
    try:
        model, opt = session.prepare(model or _Model(), optimizer or OptimizerConfig(name="adagrad", lr=0.05),
                                     **prepare)
        yield session, model, opt
    finally:
        session.close()


def _local_run(table_opt: str, steps: int) -> tuple[list[float], torch.Tensor, dict]:
    torch.manual_seed(0)
    model = localize(_Model())
    sparse = [model.emb.weight]
    dense = [p for n, p in model.named_parameters() if n != "emb.weight"]
    if table_opt == "adagrad":
        opts = [torch.optim.Adagrad(sparse, lr=0.05, eps=1e-10), torch.optim.Adagrad(dense, lr=0.05, eps=1e-10)]
    else:
        opts = [torch.optim.SparseAdam(sparse, lr=0.01), torch.optim.Adam(dense, lr=0.01)]
    # torch's own scheduler at the rates the shards run over their updates (step t: lr_factor(t)).
    schedule = _SCHEDULED.get(table_opt)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda epoch: schedule.lr_factor(epoch + 1))
                  for o in opts] if schedule else []
    losses = []
    for ids, y in _batches(steps):
        for o in opts:
            o.zero_grad()
        loss = nn.functional.mse_loss(model(ids), y)
        loss.backward()
        for o in opts:
            o.step()
        for scheduler in schedulers:
            scheduler.step()
        losses.append(loss.item())
    return losses, model.emb.weight.detach().clone(), {n: p.detach().clone() for n, p in model.named_parameters()}


def _sharded_run(address: str, table_opt: str, steps: int) -> tuple[list[float], torch.Tensor, dict, list]:
    torch.manual_seed(0)
    if table_opt == "adagrad":
        job_opt = OptimizerConfig(name="adagrad", lr=0.05, eps=1e-10)
        model = _Model()
    else:
        job_opt = _SCHEDULED.get(table_opt, OptimizerConfig(name="adam", lr=0.01))
        model = _Model(job_opt)
    session = psworker.connect(address, worker_name="w0", options=ClientOptions(timeout=30))
    try:
        model, optimizer = session.prepare(model, job_opt, consistency=Consistency(mode="sync"))
        losses = []
        for ids, y in _batches(steps):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(ids), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        table = session.client.pull_rows({"emb": np.arange(ROWS)}, wait=False)["emb"]
        statuses = session.status()
    finally:
        session.close()
    return losses, torch.from_numpy(table), {n: p.detach().clone() for n, p in model.named_parameters()}, statuses


# Table and dense rates on a schedule: warm-up, then cosine decay over the run's 200 updates.
_SCHEDULED = {"sparse_adam_scheduled": OptimizerConfig(name="adam", lr=0.01, warmup_steps=20, decay_steps=200,
                                                       min_lr_ratio=0.1)}


@pytest.mark.parametrize("table_opt", ["adagrad", "sparse_adam", "sparse_adam_scheduled"])
def test_one_sync_worker_matches_local_sparse_training(shards, table_opt):
    a, b = shards(2)
    steps = 200
    local_losses, local_table, local_params = _local_run(table_opt, steps)
    losses, table, params, statuses = _sharded_run(f"{a.address},{b.address}", table_opt, steps)
    assert len(losses) == steps
    np.testing.assert_allclose(losses, local_losses, rtol=1e-5, atol=1e-7)
    # Rounding: torch sums a row's repeated ids in a different order than the worker's lookup
    # (index backward), so over 200 steps a few elements drift by a few float32 ulps of the
    # larger values they were updated with.
    torch.testing.assert_close(table, local_table, rtol=1e-4, atol=1e-5)
    for name, value in params.items():
        torch.testing.assert_close(value, local_params[name], rtol=1e-4, atol=1e-5)
    assert not torch.equal(table, torch.from_numpy(initial_rows(
        ShardedEmbedding(ROWS, DIM, init_scale=0.1, seed=7).spec_for(OptimizerConfig(), "emb"), np.arange(ROWS))))
    # Rows are split by id modulo the shard count, and every shard counted every step.
    for index, status in enumerate(statuses):
        (t,) = status.tables
        assert t.spec.name == "emb" and t.rows_held == len(range(index, ROWS, 2))
        assert t.step == steps and 0 < t.rows_written <= t.rows_held


def test_rows_start_at_their_initial_values_and_bad_row_traffic_is_refused(shards):
    a, b = shards(2)
    ps = f"{a.address},{b.address}"
    torch.manual_seed(0)
    session = psworker.connect(ps, worker_name="w0", options=ClientOptions(timeout=30))
    try:
        model, optimizer = session.prepare(_Model(), OptimizerConfig(name="adagrad", lr=0.05))
        spec = session.client.tables["emb"]
        ids = np.array([0, 1, 2, 2999, 1500])
        before = session.client.pull_rows({"emb": ids}, wait=False)["emb"]
        np.testing.assert_array_equal(before, initial_rows(spec, ids))

        shard0 = session.client._require_sessions()[0]
        client = shard0.client

        def push(block: ps_pb2.RowBlock, **header) -> None:
            shard0.sequence += 1
            h = ps_pb2.TensorHeader(worker_id=shard0.worker_id, generation=shard0.generation, session=shard0.secret,
                                    sequence=shard0.sequence, base_version=shard0.version, clock=shard0.clock,
                                    base_clock=shard0.base_clock, rows=[block], **header)
            client.push(h, [])

        cases = [
            (rows_to_proto("emb", np.array([1]), np.zeros((1, DIM))), "lives on shard 1"),
            (rows_to_proto("emb", np.array([3000]), np.zeros((1, DIM))), "outside the table"),
            (rows_to_proto("emb", np.array([-2]), np.zeros((1, DIM))), "outside the table"),
            (rows_to_proto("emb", np.array([2, 2]), np.zeros((2, DIM))), "given twice"),
            (rows_to_proto("nope", np.array([2]), np.zeros((1, DIM))), "unknown table"),
            (ps_pb2.RowBlock(table="emb", ids=b"\x00" * 8, values=b"\x00" * 4), "bytes of values"),
            (ps_pb2.RowBlock(table="emb", ids=b"\x00" * 7), "not a whole number"),
            (rows_to_proto("emb", np.array([2]), np.full((1, DIM), np.nan)), "NaN"),
        ]
        for block, message in cases:
            with pytest.raises(errors.InvalidArgumentError, match=message):
                push(block)
        with pytest.raises(errors.InvalidArgumentError, match="outside the table"):
            session.client.pull_rows({"emb": np.array([5000])}, wait=False)
        with pytest.raises(ValueError, match="unknown table"):
            session.client.pull_rows({"other": np.array([1])}, wait=False)
        # A read of more rows than a reply may carry is refused before any row is read.
        huge = ps_pb2.PullRowsRequest(clock=-1, rows=[rows_to_proto("emb", np.zeros(1_100_000, dtype=np.int64))])
        with pytest.raises(errors.TooLargeError, match="ask in pieces"):
            client.pull_rows(huge, 1 << 20, may_wait=False)
        after = session.client.pull_rows({"emb": ids}, wait=False)["emb"]
        np.testing.assert_array_equal(after, before)  # nothing refused changed a row
        statuses = session.status()
        assert all(t.rows_written == 0 and t.step == 0 for s in statuses for t in s.tables)

        # A good step still trains: only the rows it touched change.
        out = model(torch.tensor([[0, 2, 4]]))
        out.sum().backward()
        optimizer.step()
        changed = session.client.pull_rows({"emb": np.arange(6)}, wait=False)["emb"]
        fresh = initial_rows(spec, np.arange(6))
        assert [not np.array_equal(changed[i], fresh[i]) for i in range(6)] == [True, False, True, False, True, False]
    finally:
        session.close()


def test_a_worker_with_other_tables_is_refused(shards):
    (a,) = shards(1)
    torch.manual_seed(0)
    first = psworker.connect(a.address, worker_name="w0", options=ClientOptions(timeout=30))
    second = psworker.connect(a.address, worker_name="w1", options=ClientOptions(timeout=30))
    try:
        first.prepare(_Model(), OptimizerConfig(name="adagrad", lr=0.05))
        other = _Model()
        other.emb = ShardedEmbedding(ROWS + 1, DIM, init_scale=0.1, seed=7)
        with pytest.raises(errors.PreconditionError, match="num_rows: job has 3000, worker asked for 3001"):
            second.prepare(other, OptimizerConfig(name="adagrad", lr=0.05))
    finally:
        second.client.close()
        first.close()


def test_status_lists_the_jobs_tables_to_a_reader(shards):
    (a,) = shards(1)
    with _prepared(a.address):
        with PSClient(a.address, ClientOptions(timeout=10)) as reader:
            (status,) = reader.status()
            assert [t.spec.name for t in status.tables] == ["emb"]
            assert status.tables[0].spec.num_rows == ROWS and status.tables[0].rows_held == ROWS


def test_prefetched_rows_are_used_by_the_next_forward_and_refused_in_sync(shards):
    (a,) = shards(1)
    with _prepared(a.address) as (session, model, optimizer):
        ids = torch.tensor([[5, 6, 7], [5, 8, 9]])

        def pulled() -> int:
            return session.status()[0].tables[0].rows_pulled

        model.emb.prefetch(ids)
        session.tables._prefetched["emb"][1].result(timeout=30)  # landed
        before = pulled()
        expected = model.emb(ids)  # served from the prefetch: no read of its own
        assert pulled() == before
        model.emb(ids)
        assert pulled() == before + 5  # the 5 distinct rows, pulled once without a prefetch
        # A prefetch for other ids is not used (nor are its rows mistaken for these).
        model.emb.prefetch(torch.tensor([[1, 2, 3]]))
        torch.testing.assert_close(model.emb(ids), expected)
        optimizer.zero_grad()
        model(ids).sum().backward()
        optimizer.step()
    (b,) = shards(1)
    with _prepared(b.address, consistency=Consistency(mode="sync")) as (_, model, _):
        with pytest.raises(ValueError, match="needs an async job"):
            model.emb.prefetch(torch.tensor([[1, 2, 3]]))


def test_two_sync_workers_average_their_row_gradients(shards):
    """Sync with two workers: each clock applies the mean over the workers of the rows'
    gradients (a row one worker did not touch counts zero from it), as an all-reduce does; the
    same as one local step on the concatenated batch with the loss halved per worker."""
    a, b = shards(2)
    ps = f"{a.address},{b.address}"
    torch.manual_seed(0)
    sessions = [psworker.connect(ps, worker_name=f"w{i}", options=ClientOptions(timeout=30)) for i in range(2)]
    try:
        prepared = []
        for s in sessions:
            torch.manual_seed(0)
            prepared.append(s.prepare(_Model(), OptimizerConfig(name="sgd", lr=0.5), consistency=Consistency(mode="sync")))
        batches = [torch.tensor([[0, 1, 2]]), torch.tensor([[2, 3, 4]])]
        import threading

        def step(i: int) -> None:
            model, optimizer = prepared[i]
            optimizer.zero_grad()
            model(batches[i]).sum().backward()
            optimizer.step()

        threads = [threading.Thread(target=step, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        got = sessions[0].client.pull_rows({"emb": np.arange(6)}, wait=False)["emb"]
    finally:
        for s in sessions:
            s.close()
    torch.manual_seed(0)
    local = localize(_Model())
    opt = torch.optim.SGD(local.parameters(), lr=0.5)
    (local(batches[0]).sum() / 2 + local(batches[1]).sum() / 2).backward()
    opt.step()
    torch.testing.assert_close(torch.from_numpy(got), local.emb.weight.detach()[:6], rtol=1e-6, atol=1e-7)


def test_shard_metrics_count_table_rows(shards):
    import re
    import urllib.request

    (a,) = shards(1, "--metrics-port", "0")
    url = re.search(r"metrics on (http://\S+)", a.log()).group(1)
    with _prepared(a.address) as (_, model, optimizer):
        model(torch.tensor([[1, 2, 2]])).sum().backward()
        optimizer.step()
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    values = dict(re.findall(r"^(psserver_table_\w+(?:\{[^}]*\})?) (\S+)$", text, flags=re.M))
    assert float(values['psserver_table_rows{state="held"}']) == ROWS
    assert float(values['psserver_table_rows{state="written"}']) == 2
    assert float(values["psserver_table_rows_pushed_total"]) == 2
    assert float(values["psserver_table_rows_pulled_total"]) == 2


def test_a_table_beyond_the_shards_limit_is_refused_and_the_shard_serves_on(shards):
    (a,) = shards(1, "--max-model-bytes", str(1 << 30))
    huge = TableSpec(name="emb", num_rows=1 << 40, dim=1 << 16, optimizer=OptimizerConfig(name="adagrad", lr=0.1))
    with PSClient(a.address, ClientOptions(timeout=30)) as client:
        client.wait_connected()
        values = {"w": torch.zeros(4)}
        with pytest.raises(errors.InvalidArgumentError, match="above its limit"):
            client.register(model_spec(values.items()), OptimizerConfig(name="adagrad", lr=0.1), worker_name="w0",
                            initial_values=values, tables=[huge])
        (status,) = client.status()
        assert status.state == "empty" and not status.tables
    with _prepared(a.address, name="w1") as (session, model, optimizer):
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        optimizer.step()
        assert session.status()[0].tables[0].rows_written == 3
