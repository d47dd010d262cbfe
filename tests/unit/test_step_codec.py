"""``pswire.step``: the Step layout round-trips, and a body that does not add up (cut anywhere,
with bytes past its end, with flags or widths that cannot be, a table named twice) is refused
with a ``ValueError`` naming the problem, never read past its end."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pswire import step

pytestmark = pytest.mark.timeout(120)


@st.composite
def requests(draw):
    tables = []
    for k in range(draw(st.integers(0, 3))):
        dim = draw(st.integers(1, 5))
        pushed = draw(st.booleans())
        n = draw(st.integers(0, 4)) if pushed else 0
        ids = np.array(draw(st.lists(st.integers(0, 1 << 40), min_size=n, max_size=n, unique=True)), dtype=np.int64)
        grads = np.arange(n * dim, dtype=np.float32).reshape(n, dim) - k
        reads = np.array(draw(st.lists(st.integers(0, 1 << 40), max_size=4)), dtype=np.int64)
        tables.append((f"t{k}é", dim, ids if pushed else None, grads if pushed else None, reads))
    data = draw(st.none() | st.fixed_dictionaries({"step": st.integers(0, 99), "epoch": st.integers(0, 9),
                                                   "position": st.integers(0, 999)}))
    dense = [memoryview(draw(st.binary(max_size=24))) for _ in range(draw(st.integers(0, 3)))]
    fields = dict(worker_id=draw(st.integers(1, 1 << 40)), generation=draw(st.integers(1, 50)),
                  sequence=draw(st.integers(1, 1 << 40)), base_version=draw(st.integers(0, 99)),
                  clock=draw(st.integers(0, 99)), base_clock=draw(st.integers(0, 99)),
                  session=draw(st.binary(min_size=16, max_size=32)), data=data, dense=dense, tables=tables)
    return fields


@settings(max_examples=150, deadline=None)
@given(fields=requests())
def test_a_request_round_trips_and_any_cut_or_excess_is_refused(fields):
    body = b"".join(step.encode_request(**fields))
    got = step.decode_request(memoryview(body))
    assert (got.worker_id, got.generation, got.sequence, got.base_version, got.clock, got.base_clock, got.session) == (
        fields["worker_id"], fields["generation"], fields["sequence"], fields["base_version"], fields["clock"],
        fields["base_clock"], fields["session"])
    assert got.data == fields["data"]
    assert bytes(got.dense) == b"".join(bytes(d) for d in fields["dense"])
    pushed = [(name, ids, grads) for name, _, ids, grads, _ in fields["tables"] if ids is not None]
    assert [r.table for r in got.pushed] == [name for name, _, _ in pushed]
    for rows, (_, ids, grads) in zip(got.pushed, pushed):
        np.testing.assert_array_equal(np.frombuffer(rows.ids, dtype=np.int64), ids)
        np.testing.assert_array_equal(np.frombuffer(rows.values, dtype=np.float32), grads.ravel())
    assert [name for name, _ in got.reads] == [t[0] for t in fields["tables"]]
    for (_, ids), table in zip(got.reads, fields["tables"]):
        np.testing.assert_array_equal(ids, table[4])
    assert got.dims == [t[1] for t in fields["tables"]]
    assert step.owner_of(body) == (fields["worker_id"], fields["generation"])
    for cut in sorted({0, 1, step.REQUEST.size - 1, step.REQUEST.size, len(body) // 2, len(body) - 1}):
        if cut < len(body):
            with pytest.raises(ValueError):
                step.decode_request(body[:cut])
    with pytest.raises(ValueError, match="past its end"):
        step.decode_request(body + b"\0")


_FLAG = struct.calcsize("<QQQqqqHH")
"""Where the head's progress flag is."""


def _one_table(**changes) -> bytes:
    fields = dict(worker_id=1, generation=1, sequence=1, base_version=0, clock=0, base_clock=0, session=b"s" * 16,
                  data=None, dense=[], tables=[("emb", 2, np.array([1]), np.ones((1, 2), np.float32), np.array([4]))])
    return b"".join(step.encode_request(**{**fields, **changes}))


@pytest.mark.parametrize("patch, words", [
    (lambda b: b[:_FLAG] + b"\x02" + b[_FLAG + 1:], "progress flag is 2"),
    (lambda b: b.replace(b"\x03\x00\x01\x00\x02\x00\x00\x00", b"\x03\x00\x02\x00\x02\x00\x00\x00"), "pushed flag 2"),
    (lambda b: b.replace(b"\x03\x00\x01\x00\x02\x00\x00\x00", b"\x03\x00\x01\x00\x00\x00\x00\x00"), "width 0"),
    (lambda b: b.replace(b"emb", b"e\xffb"), "not UTF-8"),
], ids=["progress-flag", "pushed-flag", "zero-width", "name-not-utf8"])
def test_a_request_with_a_field_that_cannot_be_is_refused_by_name(patch, words):
    body = _one_table()
    bad = patch(body)
    assert bad != body and len(bad) == len(body)
    with pytest.raises(ValueError, match=words):
        step.decode_request(bad)


def test_a_table_named_twice_and_rows_pushed_without_the_flag_are_refused():
    twice = [("emb", 2, None, None, np.array([1])), ("emb", 2, None, None, np.array([2]))]
    with pytest.raises(ValueError, match="listed twice"):
        step.decode_request(_one_table(tables=twice))
    body = bytearray(_one_table())
    flag = body.index(b"emb") - step.TABLE.size + 2
    body[flag] = 0  # one row pushed, flagged as not pushed
    with pytest.raises(ValueError, match="with the pushed flag 0"):
        step.decode_request(bytes(body))


def test_a_reply_must_answer_its_request_exactly():
    reply = b"".join(step.encode_reply(3, 1, "scale", 4, 2, [b"\1" * 8], [np.ones((2, 3)), np.zeros((0, 1))]))
    got = step.decode_reply(reply, 8, [(2, 3), (0, 1)])
    assert (got.push_version, got.staleness, got.action, got.version, got.clock) == (3, 1, "scale", 4, 2)
    assert bytes(got.dense) == b"\1" * 8 and got.rows[0].tolist() == [[1.0] * 3] * 2 and got.rows[1].shape == (0, 1)
    for dense, reads, words in [(4, [(2, 3), (0, 1)], "8 bytes of values, expected 4"),
                                (8, [(1, 3), (0, 1)], "past its end"), (8, [(3, 3), (0, 1)], "ends inside")]:
        with pytest.raises(ValueError, match=words):
            step.decode_reply(reply, dense, reads)
    bad = bytearray(reply)
    bad[16] = len(step.ACTIONS)
    with pytest.raises(ValueError, match="names action 4"):
        step.decode_reply(bytes(bad), 8, [(2, 3), (0, 1)])
