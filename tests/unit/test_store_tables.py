"""The store's table rows hold the dense path's guarantees: a push applies whole or not at all,
a retried push is acknowledged and not applied again, a sync clock averages rows over its
pushes, and a checkpoint (an open sync clock's rows included) restores exactly."""

from __future__ import annotations

import numpy as np
import pytest

from psserver.consistency import Consistency, Mode
from psserver.store import NonFiniteError, Registration, ShardStore
from pswire.codec import Part
from pswire.dtypes import FLOAT64
from pswire.errors import InvalidArgumentError, PreconditionError
from pswire.optim import OptimizerConfig
from pswire.tables import TableSpec, initial_rows

pytestmark = pytest.mark.timeout(60)

PART = Part("w", (2,), FLOAT64, 0, 2)
SGD = OptimizerConfig(name="sgd", lr=0.5)
TABLE = TableSpec(name="emb", num_rows=100, dim=3, optimizer=OptimizerConfig(name="adagrad", lr=0.1), seed=4)


def _registration(name: str, *, shard: int = 0, shards: int = 1, consistency: Consistency = Consistency(),
                  tables: tuple = (TABLE,)) -> Registration:
    return Registration(worker_name=name, shard_index=shard, num_shards=shards, placement_digest="d", parts=(PART,),
                        optimizer=SGD, job_fingerprint="job", consistency=consistency, tables=tables)


def _job(*names: str, **kw):
    store = ShardStore()
    workers = {n: store.register(_registration(n, **kw)) for n in names}
    first = workers[names[0]]
    store.initialize(first.worker_id, first.generation, [np.zeros(2)])
    return store, workers


def _rows(store: ShardStore, ids) -> np.ndarray:
    return store.pull_rows([("emb", np.asarray(ids, dtype=np.int64))], timeout=5)[2][0][2]


def _push(store, w, sequence, rows, *, parts=(PART,), grads=(np.ones(2),), clock=0, base_version=0):
    return store.apply_push(w.worker_id, w.generation, sequence, base_version, list(parts), list(grads),
                            clock=clock, session=w.session, rows=rows)


def test_a_retried_push_of_rows_is_acknowledged_and_not_applied_again():
    store, w = _job("a")
    rows = [("emb", np.array([3, 9]), np.ones((2, 3), dtype=np.float32))]
    first = _push(store, w["a"], 1, rows)
    after = _rows(store, [3, 9])
    again = _push(store, w["a"], 1, rows)
    assert again == first
    np.testing.assert_array_equal(_rows(store, [3, 9]), after)
    table = store.status()["tables"][0]
    assert table["step"] == 1 and table["rows_written"] == 2 and table["rows_pushed"] == 2


@pytest.mark.parametrize("bad", [
    [("emb", np.array([3, 3]), np.ones((2, 3), dtype=np.float32))],                  # a row twice
    [("emb", np.array([100]), np.ones((1, 3), dtype=np.float32))],                   # outside the table
    [("emb", np.array([1]), np.full((1, 3), np.inf, dtype=np.float32))],              # not finite
    [("emb", np.array([1]), np.ones((1, 3), dtype=np.float32)),
     ("emb", np.array([2]), np.full((1, 3), 3e38, dtype=np.float32))],               # an update that overflows
], ids=["repeat", "outside", "inf", "overflow"])
def test_a_push_with_bad_rows_changes_nothing_not_even_its_dense_part(bad):
    store, w = _job("a")
    before = (store.tensor(PART.key), _rows(store, [1, 2, 3]), store.status()["version"])
    with pytest.raises(InvalidArgumentError):
        _push(store, w["a"], 1, bad)
    np.testing.assert_array_equal(store.tensor(PART.key), before[0])
    np.testing.assert_array_equal(_rows(store, [1, 2, 3]), before[1])
    assert store.status()["version"] == before[2] and store.status()["tables"][0]["step"] == 0


def test_non_finite_rows_are_counted_as_the_dense_path_counts_them():
    store, w = _job("a")
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        _push(store, w["a"], 1, [("emb", np.array([2]), np.full((1, 3), np.nan, dtype=np.float32))])
    assert store.reading().pushes["nonfinite"] == 0  # the servicer counts the refused push (note_rejected)
    assert store.status()["updates_nonfinite"] == 0
    with pytest.raises(NonFiniteError, match="non-finite"):
        _push(store, w["a"], 1, [("emb", np.array([2]), np.full((1, 3), 3e38, dtype=np.float32))])
    assert store.status()["updates_nonfinite"] == 1


def test_rows_of_another_shard_are_refused():
    store = ShardStore()
    w = store.register(_registration("a", shard=1, shards=2))
    store.initialize(w.worker_id, w.generation, [np.zeros(2)])
    with pytest.raises(InvalidArgumentError, match="lives on shard 0, not on shard 1"):
        _push(store, w, 1, [("emb", np.array([4]), np.ones((1, 3), dtype=np.float32))])
    assert store.status()["tables"][0]["rows_held"] == 50


def test_a_worker_with_another_table_is_refused():
    store, _ = _job("a")
    other = TableSpec(name="emb", num_rows=100, dim=3, optimizer=OptimizerConfig(name="adagrad", lr=0.2), seed=4)
    with pytest.raises(PreconditionError, match="optimizer lr: job has 0.1, worker asked for 0.2"):
        store.register(_registration("b", tables=(other,)))
    with pytest.raises(PreconditionError, match="tables"):
        store.register(_registration("c", tables=()))


def test_a_sync_clock_averages_rows_over_its_pushes_and_survives_a_checkpoint():
    sync = Consistency(mode=Mode.SYNC)
    sgd_table = TableSpec(name="emb", num_rows=100, dim=3, optimizer=OptimizerConfig(name="sgd", lr=1.0), seed=4)
    store, w = _job("a", "b", consistency=sync, tables=(sgd_table,))
    start = _rows(store, [1, 2, 3])
    ga = np.array([[1, 1, 1], [2, 2, 2]], dtype=np.float32)
    _push(store, w["a"], 1, [("emb", np.array([1, 2]), ga)])
    # The clock is open: a checkpoint now holds a's rows, and a restored shard completes it.
    _, tensors, metadata = store.export()
    restored = ShardStore()
    restored.restore(tensors, metadata, source="test")
    gb = np.array([[4, 4, 4], [8, 8, 8]], dtype=np.float32)
    for s in (store, restored):
        b = w["b"] if s is store else s.register(_registration("b", consistency=sync, tables=(sgd_table,)))
        s.apply_push(b.worker_id, b.generation, 1, 0, [PART], [np.ones(2)], session=b.session,
                     rows=[("emb", np.array([2, 3]), gb)])
    expected = start.copy()
    expected[0] -= ga[0] / 2             # row 1: a's gradient, zero from b
    expected[1] -= (ga[1] + gb[0]) / 2   # row 2: both
    expected[2] -= gb[1] / 2             # row 3: b's
    np.testing.assert_allclose(_rows(store, [1, 2, 3]), expected, rtol=1e-6)
    np.testing.assert_array_equal(_rows(restored, [1, 2, 3]), _rows(store, [1, 2, 3]))
    assert store.status()["tables"][0]["step"] == 1


def test_rows_never_written_read_as_their_initial_values_and_cost_no_writes():
    store, _ = _job("a")
    ids = np.array([0, 50, 99])
    np.testing.assert_array_equal(_rows(store, ids), initial_rows(TABLE, ids))
    status = store.status()["tables"][0]
    assert status["rows_written"] == 0 and status["rows_pulled"] == 3


def test_initial_values_are_the_documented_stream_bit_for_bit():
    """The seeded initializer is part of the job's contract (restores of never-written rows,
    ``localize`` for local training): its values are pinned, for both initializers, and its
    generator takes one counter (a 0-d array) as well as many."""
    import hashlib

    from pswire.tables import splitmix64

    ids = np.concatenate([np.arange(0, 40000, 7), np.array([9_999_999, 3_456_789])])
    pinned = {"normal": "e1b840a0ab084183f0df48a6720f031f68ec963c20ae6c3d2750558da5e82955",
              "uniform": "0c85a76859bc9aaf804a23f1dc309aabcc97bcc37714029a92f00823c57c1af3"}
    for init, digest in pinned.items():
        spec = TableSpec(name="emb", num_rows=10_000_000, dim=64, optimizer=OptimizerConfig(name="adagrad", lr=0.1),
                         init=init, init_scale=0.01, seed=3)
        assert hashlib.sha256(initial_rows(spec, ids).tobytes()).hexdigest() == digest, init
    counters = np.arange(1000, dtype=np.uint64)
    assert splitmix64(np.asarray(5, dtype=np.uint64))[()] == 7134611160154358618
    assert splitmix64(counters)[5] == 7134611160154358618
    assert np.array_equal(counters, np.arange(1000, dtype=np.uint64))  # the input is not written


def test_a_read_checked_before_a_push_reads_what_it_would_have_read_unchecked():
    """A push-and-pull checks its read before the push (``check_rows``) and hands the checked ids
    to the read after it, which then reads exactly what a read of its own would."""
    store, w = _job("a")
    asked = [("emb", np.array([2, 5, 8], dtype=np.int64))]
    checked = store.check_rows(asked)
    _push(store, w["a"], 1, [("emb", np.array([5]), np.ones((1, 3), dtype=np.float32))])
    _, _, [(_, ids, values)] = store.pull_rows(asked, timeout=5, checked=checked)
    np.testing.assert_array_equal(ids, [2, 5, 8])
    np.testing.assert_array_equal(values, _rows(store, [2, 5, 8]))
    assert not np.array_equal(values[1], initial_rows(TABLE, np.array([5]))[0])  # the push's row, updated
    with pytest.raises(InvalidArgumentError, match="outside the table"):
        store.check_rows([("emb", np.array([100], dtype=np.int64))])
