"""psworker.rowreads: a rows read planned across shards, packed into calls, its replies checked."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pswire import errors
from pswire.optim import OptimizerConfig
from pswire.tables import TableSpec, owner
from pswire.v1 import ps_pb2
from pswire.wire import rows_from_proto, rows_to_proto
from psworker.rowreads import Identity, plan_rows, row_blocks, rows_calls, write_rows

ADAGRAD = OptimizerConfig(name="adagrad", lr=0.1)
TABLES = {
    "a": TableSpec(name="a", num_rows=10_000, dim=4, optimizer=ADAGRAD),
    "b": TableSpec(name="b", num_rows=500, dim=2, optimizer=ADAGRAD),
}


def _ids(draw, table: str) -> np.ndarray:
    rows = TABLES[table].num_rows
    return np.array(draw(st.lists(st.integers(0, rows - 1), unique=True, max_size=60)), dtype=np.int64)


@st.composite
def reads(draw):
    return {t: _ids(draw, t) for t in draw(st.sets(st.sampled_from(sorted(TABLES)), min_size=1))}


def _answer(request: ps_pb2.PullRowsRequest) -> ps_pb2.PullRowsResponse:
    """A shard's honest reply: each row's values are its id, table by table."""
    reply = ps_pb2.PullRowsResponse()
    for block in request.rows:
        ids, _ = rows_from_proto(block, None)
        dim = TABLES[block.table].dim
        reply.rows.append(rows_to_proto(block.table, ids, np.repeat(ids.astype(np.float32)[:, None], dim, axis=1)))
    return reply


@settings(max_examples=60, deadline=None)
@given(requests=reads(), shards=st.integers(1, 4), limit_rows=st.integers(1, 20))
def test_every_id_is_read_once_from_its_owner_in_calls_within_the_limit(requests, shards, limit_rows):
    limit = limit_rows * 16  # bytes: 4 rows of table "a", 8 of table "b" per 16 bytes x limit_rows
    plan = plan_rows(TABLES, shards, requests)
    out = {t.table: np.full((t.ids.size, t.spec.dim), -1.0, dtype=np.float32) for t in plan}
    for shard in range(shards):
        calls = rows_calls(plan, shard, identity=Identity(7, 2, b"s" * 16), clock=-1, limit=limit)
        for call in calls:
            assert call.nbytes <= max(limit, max(t.spec.row_bytes for t in plan))
            assert (call.request.worker_id, call.request.generation, call.request.session) == (7, 2, b"s" * 16)
            for block in call.request.rows:
                ids, _ = rows_from_proto(block, None)
                assert ids.size and (owner(ids, shards) == shard).all()
            write_rows(f"shard{shard}", _answer(call.request), call, out)
    for table, ids in requests.items():
        np.testing.assert_array_equal(out[table], np.repeat(ids.astype(np.float32)[:, None], TABLES[table].dim, axis=1))


def test_a_reader_read_carries_no_registration_and_a_shard_with_no_rows_gets_no_call():
    plan = plan_rows(TABLES, 2, {"a": np.array([0, 2, 4], dtype=np.int64)})
    owners = set(owner(np.array([0, 2, 4]), 2).tolist())
    for shard in range(2):
        calls = rows_calls(plan, shard, identity=None, clock=5, limit=1 << 20)
        assert len(calls) == (shard in owners)
        for call in calls:
            assert (call.request.worker_id, call.request.session, call.request.clock) == (0, b"", 5)


@pytest.mark.parametrize("tamper, match", [
    (lambda reply: reply.rows.pop(), "answered 0 tables' rows for 1"),
    (lambda reply: setattr(reply.rows[0], "table", "b"), "other rows of table 'a'"),
    (lambda reply: setattr(reply.rows[0], "ids", reply.rows[0].ids[8:] + reply.rows[0].ids[:8]), "other rows"),
])
def test_a_reply_that_answers_something_else_is_refused_and_writes_nothing(tamper, match):
    ids = np.array([x for x in range(40) if owner(np.array([x]), 1)[0] == 0][:3], dtype=np.int64)
    plan = plan_rows(TABLES, 1, {"a": ids})
    (call,) = rows_calls(plan, 0, identity=None, clock=-1, limit=1 << 20)
    reply = _answer(call.request)
    tamper(reply)
    out = {"a": np.zeros((3, 4), dtype=np.float32)}
    with pytest.raises(errors.InvalidArgumentError, match=match):
        write_rows("shard0", reply, call, out)
    assert not out["a"].any()


def test_unknown_tables_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown table 'c'"):
        plan_rows(TABLES, 2, {"c": np.array([1])})
    with pytest.raises(ValueError, match="unknown table 'c'"):
        row_blocks(TABLES, 2, {"c": (np.array([1]), np.zeros((1, 4), dtype=np.float32))})


def test_a_push_gives_every_shard_a_block_of_every_table():
    ids = np.arange(10, dtype=np.int64)
    values = np.arange(40, dtype=np.float32).reshape(10, 4)
    blocks = row_blocks(TABLES, 3, {"a": (ids, values)})
    seen = []
    for shard, shard_blocks in enumerate(blocks):
        (block,) = shard_blocks
        got_ids, got = rows_from_proto(block, 4)
        assert (owner(got_ids, 3) == shard).all()
        np.testing.assert_array_equal(got, values[got_ids])
        seen.extend(got_ids.tolist())
    assert sorted(seen) == ids.tolist()
