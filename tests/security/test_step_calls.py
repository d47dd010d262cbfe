"""Security tier: ``Step`` calls (``pswire.step``) sent by hand on an authenticated lane.

A Step's body is a fixed binary layout the shard parses itself, so every way it can lie is tried
here: garbage, a body cut short, counts that announce more than the body holds, another
session's ids, a wrong secret, non-finite gradients, a dense gradient of the wrong size, an
unknown table, rows of the wrong width, ids outside the table or given twice. Each is refused with a status naming the problem, nothing is applied, and the
same lane then carries a good Step, which is answered as the worker's own would be."""

from __future__ import annotations

import os
import struct

import grpc
import numpy as np
import pytest
import torch

from psserver.config import ServerConfig
from psserver.server import create_server
from pswire import step
from pswire.optim import OptimizerConfig
from pswire.tables import TableSpec, initial_rows
from tests.security.test_lane_calls import GRADS, INITIAL, SGD, SPEC, _code, call, lane_socket, stepped
from tests.service.test_lanes import client_for

pytestmark = pytest.mark.timeout(60)

TABLE = TableSpec(name="emb", num_rows=50, dim=4, optimizer=OptimizerConfig(name="adagrad", lr=0.1), seed=1,
                  init_scale=0.1)
DENSE = [GRADS["w"].numpy().tobytes(), GRADS["b"].numpy().tobytes()]


@pytest.fixture
def shard():
    started = create_server(ServerConfig(port=0))
    yield started
    started.stop(grace=0)


def _body(session, *, worker_id=None, secret=None, sequence=1, dense=DENSE, tables=None, data=None) -> bytes:
    if tables is None:
        tables = [("emb", 4, np.array([3, 8]), np.ones((2, 4), np.float32), np.array([3, 9]))]
    return b"".join(step.encode_request(
        worker_id=session.worker_id if worker_id is None else worker_id, generation=session.generation,
        sequence=sequence, base_version=0, clock=0, base_clock=0,
        session=session.secret if secret is None else secret, data=data, dense=[memoryview(d) for d in dense],
        tables=tables))


def test_every_lie_a_step_can_tell_is_refused_and_changes_nothing(shard):
    with client_for(shard) as client, client_for(shard) as other:
        assert client.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL, tables=[TABLE])
        assert not other.register(SPEC, SGD, worker_name="w1", tables=[TABLE])
        (session,), (theirs,) = client._sessions, other._sessions
        good = _body(session)
        nan = np.ones((2, 4), np.float32)
        nan[1, 2] = np.nan
        head = step.REQUEST.size + len(session.secret) + sum(map(len, DENSE))
        lying = bytearray(good)
        struct.pack_into("<I", lying, head + 4, 1 << 30)  # the table's width: 2^30 values a row
        huge = bytearray(good)
        struct.pack_into("<I", huge, head + 8, (1 << 32) - 1)  # 4 billion rows pushed
        refusals = {
            "garbage": (b"\xff" * 7, grpc.StatusCode.INVALID_ARGUMENT, "undecodable Step"),
            "cut short": (good[:-5], grpc.StatusCode.INVALID_ARGUMENT, "ends inside"),
            "bytes past its end": (good + b"\0", grpc.StatusCode.INVALID_ARGUMENT, "past its end"),
            "a width it does not have": (bytes(lying), grpc.StatusCode.INVALID_ARGUMENT, "width"),
            "more rows than it holds": (bytes(huge), grpc.StatusCode.INVALID_ARGUMENT, "ends inside"),
            "another session": (_body(theirs), grpc.StatusCode.PERMISSION_DENIED, "names session"),
            "a wrong secret": (_body(session, secret=os.urandom(32)), grpc.StatusCode.UNAUTHENTICATED, ""),
            "a NaN gradient": (_body(session, dense=[DENSE[0], np.array([1, np.nan, 0, 0], np.float32).tobytes()]),
                               grpc.StatusCode.INVALID_ARGUMENT, "NaN"),
            "a NaN row gradient": (_body(session, tables=[("emb", 4, np.array([3, 8]), nan, np.array([3]))]),
                                   grpc.StatusCode.INVALID_ARGUMENT, "NaN"),
            "a dense gradient of the wrong size": (_body(session, dense=DENSE[:1]), grpc.StatusCode.INVALID_ARGUMENT,
                                                   "dense gradient is 128 bytes"),
            "an unknown table": (_body(session, tables=[("nope", 4, np.array([1]), np.ones((1, 4), np.float32),
                                                         np.array([1]))]),
                                 grpc.StatusCode.INVALID_ARGUMENT, "unknown table 'nope'"),
            "rows of the wrong width": (_body(session, tables=[("emb", 2, np.array([1]), np.ones((1, 2), np.float32),
                                                                np.array([1]))]),
                                        grpc.StatusCode.INVALID_ARGUMENT, "rows of 4 values"),
            "an id outside the table": (_body(session, tables=[("emb", 4, np.array([1]), np.ones((1, 4), np.float32),
                                                                np.array([50]))]),
                                        grpc.StatusCode.INVALID_ARGUMENT, "outside"),
            "an id pushed twice": (_body(session, tables=[("emb", 4, np.array([2, 2]), np.ones((2, 4), np.float32),
                                                           np.array([1]))]),
                                   grpc.StatusCode.INVALID_ARGUMENT, "twice"),
            "a read of a table the push does not carry": (_body(session, tables=[("emb", 4, None, None,
                                                                                   np.array([99]))]),
                                                         grpc.StatusCode.INVALID_ARGUMENT, "outside"),
            "nothing to push": (_body(session, dense=[], tables=[]), grpc.StatusCode.INVALID_ARGUMENT,
                                "names no variables"),
        }
        with lane_socket(shard.lanes.port, session.secret, (session.worker_id, session.generation)) as sock:
            for token, (what, (body, code, words)) in enumerate(refusals.items(), 1):
                status, details = call(sock, "Step", body, token)
                assert _code(status) == code, what
                assert words in details.decode(), (what, details)
                (st,) = client.status()
                assert (st.version, st.pushes_applied) == (0, 0), what
            # The same lane then carries a good Step, answered with the variables and rows after it.
            status, reply = call(sock, "Step", good, token=100)
            assert status == 0
            answer = step.decode_reply(reply, 144, [(2, 4)])
            assert (answer.push_version, answer.staleness, answer.action, answer.version) == (1, 0, "apply", 1)
            values = np.frombuffer(answer.dense, dtype=np.float32)
            np.testing.assert_array_equal(values, np.concatenate([v.numpy().ravel() for v in stepped(1).values()]))
            assert not np.array_equal(answer.rows[0][0], initial_rows(TABLE, np.array([3]))[0])  # row 3 was pushed
            np.testing.assert_array_equal(answer.rows[0][1], initial_rows(TABLE, np.array([9]))[0])
            # Sent again (a retry), it is acknowledged with its first answer, not applied twice.
            status, again = call(sock, "Step", good, token=101)
            assert status == 0 and step.decode_reply(again, 144, [(2, 4)]).push_version == 1
        (st,) = client.status()
        assert (st.version, st.pushes_applied) == (1, 1)
        dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
        assert client.pull(dest) == [1]
        assert all(torch.equal(dest[k], stepped(1)[k]) for k in dest)
