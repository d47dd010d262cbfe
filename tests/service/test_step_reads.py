"""Table rows read with a step (``PushPullRequest.rows``): the next batch's rows ride on the
step's push-and-pull, read by each shard once the push is applied, so an async worker makes one
call per shard a step instead of two. Checked: training with the rows read this way is bit for
bit training with reads of their own; a read the shard would refuse applies nothing; the read
must be the pushing registration's; ssp/sync and reads too large for one reply fall back to a
read after the step."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch import nn

import psworker
from psserver.config import ServerConfig
from psserver.server import create_server
from pswire import errors
from pswire.consistency import Consistency
from pswire.dtypes import FLOAT32
from pswire.optim import OptimizerConfig
from pswire.placement import VariableSpec
from pswire.tables import TableSpec, initial_rows
from pswire.v1 import ps_pb2
from pswire.wire import rows_to_proto
from psworker import exchange
from psworker.client import ClientOptions, PSClient
from psworker.shard import ShardClient
from tests.integration.test_sparse_export import DIM, FEATURES, ROWS, _Model

pytestmark = pytest.mark.timeout(120)

WAIT = 20.0
ADAGRAD = OptimizerConfig(name="adagrad", lr=0.05)


def _batches(steps: int, batch: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    ids = (torch.rand(steps, batch, FEATURES, generator=g) ** 3 * ROWS).long()  # skewed: rows repeat
    return list(zip(ids, torch.randn(steps, batch, 1, generator=g)))


@contextlib.contextmanager
def _shards(n: int):
    started = [create_server(ServerConfig(port=0, shard_index=i, num_shards=n)) for i in range(n)]
    try:
        yield started
    finally:
        for shard in started:
            shard.stop(grace=0)


class _ReadCounter:
    """Counts the PullRows calls the worker's shard clients make (over a lane or gRPC)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        self.counting = True
        for name in ("pull_rows", "start_pull_rows"):
            original = getattr(ShardClient, name)

            def counted(*args, _original=original, **kwargs):
                self.calls += self.counting
                return _original(*args, **kwargs)

            monkeypatch.setattr(ShardClient, name, counted)

    def stop(self) -> None:
        self.counting = False


def _train(addresses: str, steps: int, *, with_step: bool, consistency: Consistency | None = None,
           lane_calls: bool = True, step_calls: bool = True,
           counter: _ReadCounter | None = None) -> tuple[list[float], np.ndarray, int]:
    """One worker's ``steps`` steps; ``with_step``: each step announces the next batch's rows
    (``prefetch(..., with_step=True)``) before ``optimizer.step()``. Returns the losses, the
    whole table after, and the rows the shards read in training. ``counter``: counts the
    training's row reads (not the table's read after)."""
    torch.manual_seed(0)
    session = psworker.connect(addresses, worker_name="w0",
                               options=ClientOptions(timeout=WAIT, connect_timeout=WAIT, lane_calls=lane_calls,
                                                     step_calls=step_calls))
    try:
        extra = {"consistency": consistency} if consistency is not None else {}
        model, optimizer = session.prepare(_Model(), ADAGRAD, **extra)
        batches = _batches(steps)
        losses = []
        for k, (ids, y) in enumerate(batches):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(ids), y)
            loss.backward()
            if with_step and k + 1 < len(batches):
                model.emb.prefetch(batches[k + 1][0], with_step=True)
            optimizer.step()
            losses.append(loss.item())
        if counter is not None:
            counter.stop()
        pulled = sum(t.rows_pulled for s in session.status() for t in s.tables)
        table = session.client.pull_rows({"emb": np.arange(ROWS)}, wait=False)["emb"]
    finally:
        session.close()
    return losses, table, pulled


@pytest.mark.parametrize("lane_calls", [True, False], ids=["lane-calls", "grpc"])
def test_rows_read_with_the_step_train_exactly_as_reads_of_their_own(monkeypatch, lane_calls):
    steps = 30
    with _shards(2) as plain:
        losses, table, pulled = _train(",".join(s.address for s in plain), steps, with_step=False,
                                       lane_calls=lane_calls)
    counter = _ReadCounter(monkeypatch)
    with _shards(2) as riding:
        ridden_losses, ridden_table, ridden_pulled = _train(",".join(s.address for s in riding), steps,
                                                            with_step=True, lane_calls=lane_calls, counter=counter)
    # Only the first batch's rows needed a read of their own (one call per shard).
    assert counter.calls == 2
    # Read right after this worker's push, the rows are the very rows a read at the next
    # forward gets: the same losses and table, bit for bit, and the same rows read.
    assert ridden_losses == losses
    np.testing.assert_array_equal(ridden_table, table)
    assert ridden_pulled == pulled
    assert not np.array_equal(table, initial_rows(_Model().emb.spec_for(ADAGRAD, "emb"), np.arange(ROWS)))


def test_sync_jobs_read_the_announced_rows_after_the_step(monkeypatch):
    """In ssp/sync the rows are not read with the step (a training read waits on the bound): an
    announced read is made after the step, at once, and the training is unchanged."""
    sync = Consistency(mode="sync")
    with _shards(2) as plain:
        losses, table, _ = _train(",".join(s.address for s in plain), 12, with_step=False, consistency=sync)
    with _shards(2) as announced:
        with pytest.raises(ValueError, match="needs an async job"):
            _train(",".join(s.address for s in announced), 12, with_step=True, consistency=sync)
    # The client's own fallback: PSClient.push_pull(read_rows=...) in a sync job.
    with _shards(2) as started:
        with _registered(started, consistency=sync) as client:
            counter = _ReadCounter(monkeypatch)
            ids = np.array([3, 4, 10, 3999])
            out = np.full((ids.size, DIM), np.nan, dtype=np.float32)
            client.push_pull({"w": torch.ones(4)}, {"w": torch.zeros(4)}, read_rows={"emb": (ids, out)})
            assert counter.calls == 2  # one read per shard, after the step
            np.testing.assert_array_equal(out, client.pull_rows({"emb": ids}, wait=False)["emb"])
    assert len(losses) == 12 and np.isfinite(table).all()


TABLE = TableSpec(name="emb", num_rows=ROWS, dim=DIM, optimizer=ADAGRAD, seed=7, init_scale=0.1)


@contextlib.contextmanager
def _registered(started, consistency: Consistency | None = None, **options):
    client = PSClient([s.address for s in started],
                      ClientOptions(timeout=WAIT, connect_timeout=WAIT, **options))
    try:
        client.wait_connected()
        client.register([VariableSpec("w", (4,), FLOAT32)], OptimizerConfig(name="sgd", lr=0.5), worker_name="w0",
                        initial_values={"w": torch.zeros(4)}, tables=[TABLE],
                        **({"consistency": consistency} if consistency is not None else {}))
        yield client
    finally:
        client.close()


def test_a_share_above_one_reply_is_read_after_the_step(monkeypatch):
    monkeypatch.setattr(exchange, "ROWS_PER_CALL", 3 * DIM * 4)  # 3 rows a call
    with _shards(2) as started:
        with _registered(started) as client:
            counter = _ReadCounter(monkeypatch)
            ids = np.arange(0, 20, dtype=np.int64)  # 10 rows a shard: 4 calls each
            out = np.empty((ids.size, DIM), dtype=np.float32)
            client.push_pull({"w": torch.ones(4)}, {"w": torch.zeros(4)}, read_rows={"emb": (ids, out)})
            assert counter.calls == 8
            np.testing.assert_array_equal(out, initial_rows(TABLE, ids))


@pytest.mark.parametrize("lane_calls", [True, False], ids=["lane-calls", "grpc"])
def test_a_step_read_the_shard_refuses_applies_nothing(lane_calls):
    with _shards(1) as started:
        with _registered(started, lane_calls=lane_calls) as client:
            (session,) = client._require_sessions()
            shard = session.client

            def step(rows: ps_pb2.PullRowsRequest) -> tuple:
                # The client's own push and pull, with ``rows`` riding on them.
                message = client._push_message(session, {"w": torch.ones(4)}, None)
                request, dest, nbytes = client._pull_request(session, {"w": torch.zeros(4)}, skip_unchanged=False,
                                                             may_wait=False, clock=session.clock + 1)
                return shard.push_pull(*message, request, dest, nbytes, rows=rows, rows_bytes=3 * DIM * 4)

            def read(ids, **who) -> ps_pb2.PullRowsRequest:
                named = {"worker_id": session.worker_id, "generation": session.generation, "session": session.secret}
                return ps_pb2.PullRowsRequest(clock=-1, rows=[rows_to_proto("emb", np.asarray(ids))], **{**named, **who})

            refusals = [
                (read([1, 2], generation=session.generation + 1), (errors.InvalidArgumentError,
                                                                   errors.PermissionDeniedError), "registration|session"),
                (read([1, 2], session=b"x" * 16), errors.InvalidArgumentError, "same registration"),
                (read([ROWS + 5]), errors.InvalidArgumentError, "outside the table"),
                (ps_pb2.PullRowsRequest(clock=-1, worker_id=session.worker_id, generation=session.generation,
                                        session=session.secret,
                                        rows=[rows_to_proto("emb", np.zeros(1_100_000, dtype=np.int64))]),
                 errors.TooLargeError, "ask in pieces"),
            ]
            for rows, error, message in refusals:
                with pytest.raises(error, match=message):
                    step(rows)
                (status,) = client.status()
                assert (status.version, status.pushes_applied) == (0, 0)  # the push was not applied
            reply, _, _, rows_reply = step(read([0, 5, 17]))
            assert reply.version == 1
            (block,) = rows_reply.rows
            assert block.table == "emb"
            np.testing.assert_array_equal(np.frombuffer(block.values, dtype=np.float32).reshape(3, DIM),
                                          initial_rows(TABLE, np.array([0, 5, 17])))


def test_a_lookup_of_the_announced_ids_sorts_them_once_and_ids_changed_since_are_sorted_afresh(monkeypatch):
    """The lookup of the batch announced with ``prefetch`` takes the distinct ids the
    announcement computed (a batch's ids are sorted once a step, not twice); a lookup of other
    ids, or of the announced tensor changed in place since, computes its own and reads its
    own rows."""
    from psworker import embedding

    sorts = []
    original = embedding._distinct
    monkeypatch.setattr(embedding, "_distinct", lambda module, ids: sorts.append(ids.numel()) or original(module, ids))
    batches = _batches(3)
    with _shards(2) as started:
        session = psworker.connect(",".join(s.address for s in started), worker_name="w0",
                                   options=ClientOptions(timeout=WAIT, connect_timeout=WAIT))
        try:
            model, optimizer = session.prepare(_Model(), ADAGRAD)
            ids = batches[1][0].clone()

            def step_announcing(batch) -> None:
                optimizer.zero_grad()
                nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
                model.emb.prefetch(ids, with_step=True)
                optimizer.step()  # carries the announced read

            step_announcing(batches[0])
            sorts.clear()
            announced = model.emb(ids)
            assert sorts == []  # the announcement's distinct ids, not sorted again
            fresh = session.client.pull_rows({"emb": ids.unique().numpy()}, wait=False)["emb"]
            where = torch.searchsorted(ids.unique(), ids.reshape(-1))
            torch.testing.assert_close(announced.detach().reshape(-1, DIM), torch.from_numpy(fresh)[where],
                                       rtol=0, atol=0)

            step_announcing(batches[2])
            ids[0, 0] = ROWS - 1  # changed in place after it was announced
            sorts.clear()
            changed = model.emb(ids)
            assert sorts == [ids.numel()]
            now = session.client.pull_rows({"emb": ids.unique().numpy()}, wait=False)["emb"]
            where = torch.searchsorted(ids.unique(), ids.reshape(-1))
            torch.testing.assert_close(changed.detach().reshape(-1, DIM), torch.from_numpy(now)[where],
                                       rtol=0, atol=0)
        finally:
            session.close()


@pytest.mark.parametrize("lane_calls", [True, False], ids=["lane-calls", "grpc"])
def test_a_shard_holding_only_rows_gets_no_pull_and_its_rows_say_its_version(monkeypatch, lane_calls):
    """The model ("w") lives whole on shard 0; shard 1 holds only rows. Its step's PushPull
    carries no pull (it would read no variable), and the rows read after the push give the
    version and clock the next push is measured from."""
    sent: list[tuple[str, bool]] = []
    for name in ("start_push_pull", "push_pull"):
        original = getattr(ShardClient, name)

        def spied(self, header, buffers, request, *args, _original=original, **kwargs):
            sent.append((self.address, request is not None))
            return _original(self, header, buffers, request, *args, **kwargs)

        monkeypatch.setattr(ShardClient, name, spied)
    with _shards(2) as started:
        with _registered(started, lane_calls=lane_calls, step_calls=False) as client:
            rows_only = client._require_sessions()[1]
            assert not rows_only.parts
            ids = np.array([1, 2, 3, 6, 9], dtype=np.int64)  # rows on both shards
            for step in range(3):
                out = np.empty((ids.size, DIM), dtype=np.float32)
                grads = np.full((ids.size, DIM), 0.5, dtype=np.float32)
                replies = client.push_pull({"w": torch.ones(4)}, {"w": torch.zeros(4)}, rows={"emb": (ids, grads)},
                                           read_rows={"emb": (ids, out)})
                # Each push was computed from the shard's state after the last one: no staleness.
                assert [r.staleness for r in replies] == [0, 0]
                status = client.status()[1]
                assert (rows_only.version, rows_only.base_clock) == (status.version, step + 1) == (replies[1].version,
                                                                                                    step + 1)
                np.testing.assert_array_equal(out, client.pull_rows({"emb": ids}, wait=False)["emb"])
    # Every step read rows with its calls: shard 1 never got a pull, shard 0 got one each step.
    assert {address for address, pulled in sent if pulled} == {started[0].address}
    assert sum(not pulled for _, pulled in sent) == 3


@pytest.mark.parametrize("lane_calls", [True, False], ids=["lane-calls", "grpc"])
def test_a_push_and_pull_without_a_pull_is_answered_without_one(lane_calls):
    with _shards(1) as started:
        with _registered(started, lane_calls=lane_calls) as client:
            (session,) = client._require_sessions()
            message = client._push_message(session, {"w": torch.ones(4)}, None)
            rows = ps_pb2.PullRowsRequest(clock=-1, worker_id=session.worker_id, generation=session.generation,
                                          session=session.secret, rows=[rows_to_proto("emb", np.array([0, 5]))])
            reply, header, written, rows_reply = session.client.push_pull(*message, None, None, 0, rows=rows,
                                                                          rows_bytes=2 * DIM * 4)
            assert (reply.version, header, written) == (1, None, {})
            assert (rows_reply.version, [b.table for b in rows_reply.rows]) == (1, ["emb"])
            # The shard applied the push: its variable moved (SGD, lr 0.5, gradient 1).
            values = torch.zeros(4)
            client.pull({"w": values}, skip_unchanged=False, wait=False)
            assert values.tolist() == [-0.5] * 4
