"""An async step as one ``Step`` per shard (``pswire.step``) in place of ``PushPull``: the same
push and reads in a fixed binary layout. Checked: training with Step calls is bit for bit
training with PushPull calls (dense variables, table rows, a rows-only shard); a Step carries
the worker's progress, which a worker registering again gets back; a Step that fails as a call
that may be retried is made again as PushPull with the same sequence number and applies once;
and the steps Step cannot make (compression, a data exchange riding on the step, calls above
``inline_bytes``) go as PushPull."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pswire import errors
from pswire.dtypes import FLOAT32
from pswire.optim import OptimizerConfig
from pswire.placement import VariableSpec
from pswire.tables import TableSpec, initial_rows
from psserver.servicer import ParameterServerServicer
from psworker.client import ClientOptions, PSClient
from psworker.shard import ShardClient
from tests.service.test_step_reads import _shards, _train

pytestmark = pytest.mark.timeout(120)

WAIT = 20.0
TABLE = TableSpec(name="emb", num_rows=64, dim=4, optimizer=OptimizerConfig(name="adagrad", lr=0.1), seed=3,
                  init_scale=0.1)
SPEC = [VariableSpec("w", (4, 3), FLOAT32), VariableSpec("b", (3,), FLOAT32)]
INITIAL = {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3) / 8, "b": torch.tensor([1.0, -1.0, 0.5])}


class _Calls:
    """Counts the Steps and the PushPulls the shards started after it serve (lanes or gRPC)."""

    def __init__(self, monkeypatch) -> None:
        self.served = {"Step": 0, "PushPull": 0}
        for name in self.served:
            original = getattr(ParameterServerServicer, name)

            def counted(servicer, request, context, _name=name, _original=original):
                self.served[_name] += 1
                return _original(servicer, request, context)

            monkeypatch.setattr(ParameterServerServicer, name, counted)

    @property
    def steps(self) -> int:
        return self.served["Step"]

    @property
    def push_pulls(self) -> int:
        return self.served["PushPull"]


def _client(started, **options) -> PSClient:
    client = PSClient([s.address for s in started], ClientOptions(timeout=WAIT, connect_timeout=WAIT, **options))
    client.wait_connected()
    client.register(SPEC, OptimizerConfig(name="sgd", lr=0.5), worker_name="w0", initial_values=INITIAL,
                    tables=[TABLE])
    return client


def _step(client: PSClient, k: int, **extra):
    """Step ``k`` of a fixed sequence: gradients of both variables and of rows on both shards,
    and a read of the next rows. Returns the replies, the pulled variables and the rows read."""
    ids = np.array(sorted({(7 * k) % 64, (7 * k + 1) % 64, (3 * k + 5) % 64}), dtype=np.int64)
    following = np.array(sorted({(7 * k + 7) % 64, (5 * k) % 64}), dtype=np.int64)
    grads = {"w": torch.full((4, 3), 0.25 * (k + 1)), "b": torch.tensor([1.0, -2.0, 0.5 * k])}
    row_grads = np.arange(ids.size * 4, dtype=np.float32).reshape(ids.size, 4) / (k + 2)
    pulled = {name: torch.zeros_like(value) for name, value in INITIAL.items()}
    out = np.full((following.size, 4), np.nan, dtype=np.float32)
    replies = client.push_pull(grads, pulled, rows={"emb": (ids, row_grads)}, read_rows={"emb": (following, out)},
                               **extra)
    return replies, pulled, out, following


def test_training_with_step_calls_is_bit_for_bit_training_with_push_pull(monkeypatch):
    steps = 30
    results = {}
    for step_calls in (False, True):
        calls = _Calls(monkeypatch)
        with _shards(2) as started:
            results[step_calls] = _train(",".join(s.address for s in started), steps, with_step=True,
                                         step_calls=step_calls)
        assert (calls.steps > 0) == step_calls and (calls.push_pulls > 0) != step_calls
        monkeypatch.undo()
    (losses, table, pulled), (step_losses, step_table, step_pulled) = results[False], results[True]
    assert step_losses == losses
    np.testing.assert_array_equal(step_table, table)
    assert step_pulled == pulled


def test_a_step_is_answered_as_push_pull_answers_it(monkeypatch):
    """The same steps as Steps and as PushPulls: the same replies (version, staleness, action),
    variables and rows, and a rows-only shard's version from its rows."""
    seen = {}
    for step_calls in (False, True):
        calls = _Calls(monkeypatch)
        with _shards(2) as started:
            with _client(started, step_calls=step_calls) as client:
                rows_only = client._require_sessions()[1]
                assert not rows_only.parts
                steps = []
                for k in range(6):
                    replies, pulled, out, _ = _step(client, k)
                    steps.append(([(r.version, r.staleness, r.action) for r in replies], pulled, out.copy()))
                    assert (rows_only.version, rows_only.base_clock) == (replies[1].version, k + 1)
                seen[step_calls] = steps
        assert (calls.steps, calls.push_pulls) == ((12, 0) if step_calls else (0, 12))
        monkeypatch.undo()
    for (replies, pulled, out), (step_replies, step_pulled, step_out) in zip(seen[False], seen[True]):
        assert step_replies == replies
        assert all(torch.equal(step_pulled[k], pulled[k]) for k in pulled)
        np.testing.assert_array_equal(step_out, out)
    assert [r for r, _, _ in seen[True]][-1] == [(6, 0, "apply"), (6, 0, "apply")]


def test_a_step_carries_the_worker_s_progress_which_a_worker_registering_again_gets_back():
    with _shards(2) as started:
        with _client(started) as client:
            _step(client, 0, data={"step": 1, "epoch": 0, "position": 32})
            _step(client, 1, data={"step": 2, "epoch": 1, "position": 7})
            client.leave()
        with _client(started) as again:  # the first one left: its name is free
            assert again.resume_data == {"step": 2, "epoch": 1, "position": 7}


def test_a_step_that_fails_as_one_that_may_be_retried_is_made_again_as_push_pull_and_applies_once(monkeypatch):
    finish = ShardClient.finish_step
    failed = []

    def fail_the_first(client, pending):
        body = finish(client, pending)  # the shard applied it; the reply is lost
        if not failed:
            failed.append(client.address)
            raise errors.UnavailableError(f"shard {client.address}: bulk lane broke: cut by the test")
        return body

    calls = _Calls(monkeypatch)
    with _shards(2) as started:
        with _client(started) as client:
            _step(client, 0)
            assert (calls.steps, calls.push_pulls) == (2, 0)
            monkeypatch.setattr(ShardClient, "finish_step", fail_the_first)
            replies, pulled, out, following = _step(client, 1)
            assert (calls.steps, calls.push_pulls) == (4, 1)  # shard 0's step made again
            # Acknowledged, not applied twice: each shard is at version 2, and the variables
            # moved by two steps of SGD (lr 0.5): gradients 0.25 then 0.5 for "w".
            assert [r.version for r in replies] == [2, 2]
            assert [s.pushes_applied for s in client.status()] == [2, 2]
            assert torch.equal(pulled["w"], INITIAL["w"] - 0.5 * (0.25 + 0.5))
            np.testing.assert_array_equal(out, client.pull_rows({"emb": following}, wait=False)["emb"])


@pytest.mark.parametrize("options, offered", [
    ({"wire_dtype": torch.bfloat16}, False),
    ({"inline_bytes": 64}, False),
    ({"step_calls": False}, False),
    ({}, True),
], ids=["compressed", "above-inline-bytes", "turned-off", "data-exchange-riding"])
def test_steps_a_step_call_cannot_make_go_as_push_pull(monkeypatch, options, offered):
    calls = _Calls(monkeypatch)
    with _shards(2) as started:
        with _client(started, **options) as client:
            if offered:
                client._rider = object()  # a data exchange waiting for the next step
                monkeypatch.setattr(type(client), "_take_rider", lambda self, session: None)
            replies, _, out, _ = _step(client, 0)
            assert [r.version for r in replies] == [1, 1]
            assert not np.isnan(out).any()
    assert calls.steps == 0 and calls.push_pulls == 2


def test_a_shard_that_holds_rows_to_read_but_nothing_to_push_is_read_after_the_step(monkeypatch):
    """Only dense gradients pushed (no rows): shard 1 holds nothing of the push, so the step
    goes as PushPull and the rows are read after it."""
    calls = _Calls(monkeypatch)
    with _shards(2) as started:
        with _client(started) as client:
            ids = np.array([1, 2], dtype=np.int64)
            out = np.empty((2, 4), dtype=np.float32)
            pulled = {name: torch.zeros_like(value) for name, value in INITIAL.items()}
            client.push_pull({"w": torch.ones(4, 3), "b": torch.ones(3)}, pulled, read_rows={"emb": (ids, out)})
            np.testing.assert_array_equal(out, initial_rows(TABLE, ids))
    assert calls.steps == 0 and calls.push_pulls == 1
