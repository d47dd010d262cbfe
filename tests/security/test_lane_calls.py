"""Security tier: whole calls on the bulk lanes (``pswire.lanes.CALL``/``REPLY``).

A lane that carries a call runs the shard's own handler on the lane's thread, so everything a
gRPC call is checked for, a lane call is checked for too, and the lane adds its own rules: the
request must name the session that opened the lane, may not name a bulk transfer, and may not
announce more than ``CALL_LIMIT`` bytes or stall inside its body. Each refusal leaves the shard's
state unchanged and the shard serving. Part of it runs against a ``LaneServer`` alone (a handler
that records what it was given), part against a real in-process shard.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time

import grpc
import numpy as np
import pytest
import torch

from psserver.config import ServerConfig
from psserver.inflight import InflightBudget
from psserver.lanes import LaneServer
from psserver.server import create_server
from pswire import errors
from pswire import lanes as wire
from pswire.dtypes import FLOAT32
from pswire.optim import OptimizerConfig
from pswire.placement import VariableSpec
from pswire.v1 import ps_pb2
from psworker.client import ClientOptions, PSClient
from psworker.shard import LaneCallError
from tests.security.lane_harness import hung_up, wait_for
from tests.service.test_lanes import client_for

pytestmark = pytest.mark.timeout(60)

WAIT = 10.0
OWNER = (5, 1)
SGD = OptimizerConfig(name="sgd", lr=0.5)
SPEC = [VariableSpec("w", (8, 4), FLOAT32), VariableSpec("b", (4,), FLOAT32)]
INITIAL = {"w": torch.arange(32, dtype=torch.float32).reshape(8, 4) / 4, "b": torch.tensor([1.0, -2.0, 0.5, 0.0])}
GRADS = {"w": torch.full((8, 4), 0.5), "b": torch.tensor([2.0, -4.0, 1.0, 8.0])}


def stepped(n: int) -> dict[str, torch.Tensor]:
    return {k: v - n * 0.5 * GRADS[k] for k, v in INITIAL.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def lane_socket(port: int, secret: bytes, owner: tuple[int, int]) -> socket.socket:
    """An authenticated lane driven by hand."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    tag, lane_id, nonce = wire.GREETING.unpack(wire.recv_exactly(sock, wire.GREETING.size))
    assert tag == wire.GREETING_TAG
    sock.sendall(wire.AUTH.pack(wire.AUTH_TAG, *owner, wire.lane_proof(secret, lane_id, nonce)))
    assert wire.recv_exactly(sock, len(wire.ACCEPT_TAG)) == wire.ACCEPT_TAG
    return sock


def call(sock: socket.socket, method: str, request: bytes, token: int = 1, timeout_ms: int = 5000) -> tuple[int, bytes]:
    body = struct.pack("<I", timeout_ms) + request
    sock.sendall(wire.CALL.pack(wire.CALL_TAG, token, wire.LANE_METHODS.index(method), len(body)) + body)
    tag, got, status, nbytes = wire.REPLY.unpack(wire.recv_exactly(sock, wire.REPLY.size))
    assert (tag, got) == (wire.REPLY_TAG, token)
    return status, wire.recv_exactly(sock, nbytes)


# -- the lane server alone ----------------------------------------------------------------------

@contextlib.contextmanager
def lane_server(secret: bytes, calls=None, **options):
    server = LaneServer("127.0.0.1", 0, max_bytes=1 << 20, session_secret=lambda w, g: secret if (w, g) == OWNER
                        else None, **options)
    if calls is not None:
        server.take_calls(calls)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_a_call_is_answered_on_its_lane_with_the_handler_s_reply():
    secret, seen = os.urandom(32), []

    def calls(method, body, owner, lane_id, timeout):
        assert lane_id > 0
        seen.append((method, bytes(body), owner, timeout))
        return (0, b"reply:" + bytes(body)) if method == "PullRows" else (7 | wire.RETRYABLE_FLAG, b"no")

    with lane_server(secret, calls) as server, lane_socket(server.port, secret, OWNER) as sock:
        assert call(sock, "PullRows", b"abc", token=1, timeout_ms=2500) == (0, b"reply:abc")
        assert call(sock, "PushPull", b"", token=2) == (7 | wire.RETRYABLE_FLAG, b"no")  # the lane stays open
        assert seen == [("PullRows", b"abc", OWNER, 2.5), ("PushPull", b"", OWNER, 5.0)]


@pytest.mark.parametrize("frame", [
    pytest.param(lambda: wire.CALL.pack(wire.CALL_TAG, 1, len(wire.LANE_METHODS), 8) + bytes(8), id="unknown-method"),
    pytest.param(lambda: wire.CALL.pack(wire.CALL_TAG, 1, 0, wire.CALL_LIMIT + 1), id="above-the-limit"),
    pytest.param(lambda: wire.CALL.pack(wire.CALL_TAG, 1, 0, 2) + bytes(2), id="no-room-for-a-timeout"),
])
def test_a_call_the_shard_cannot_take_closes_its_lane_and_holds_nothing(frame):
    secret, seen = os.urandom(32), []
    budget = InflightBudget(64 << 20)
    with lane_server(secret, lambda *a: seen.append(a) or (0, b""), budget=budget) as server:
        with lane_socket(server.port, secret, OWNER) as sock:
            sock.sendall(frame())
            assert hung_up(sock)
        assert seen == [] and budget.held == 0
        with lane_socket(server.port, secret, OWNER) as sock:  # the port still serves
            assert call(sock, "PullInline", b"x") == (0, b"")


def test_a_call_that_stalls_inside_its_body_is_cut_and_its_budget_released():
    secret, seen = os.urandom(32), []
    budget = InflightBudget(64 << 20)
    with lane_server(secret, lambda *a: seen.append(a) or (0, b""), budget=budget, stall_seconds=0.3) as server:
        with lane_socket(server.port, secret, OWNER) as sock:
            sock.sendall(wire.CALL.pack(wire.CALL_TAG, 1, 0, 1 << 20) + bytes(1000))  # announces 1 MiB, sends 1000
            wait_for(lambda: budget.held > 0, "the call's bytes to be budgeted")
            assert 0 < budget.held <= 1 << 20  # held while it arrives ...
            started = time.monotonic()
            assert hung_up(sock)
            assert time.monotonic() - started < 5.0
        wait_for(lambda: budget.held == 0, "the cut call's budget to be released")
        assert seen == [] and budget.held == 0  # ... and released when the lane is cut


def test_calls_claiming_staged_pushes_that_fill_the_budget_go_on_at_once():
    """Two pushes staged on two lanes hold 900 of a 1,000-byte budget, and each is freed only by
    the call its lane sends next, whose 216 bytes are budgeted too: each call shares its push's
    place in line, so the older push's call goes on over the limit and frees the room the younger
    one's call needs. (Before, both calls waited for room ``laneframes.ROOM_SECONDS``, a minute,
    and their lanes were cut: two workers pushing at once could stall a shard.)"""
    secret, claimed = os.urandom(32), []
    budget = InflightBudget(1000)

    def calls(method, body, owner, lane_id, timeout):
        token, nbytes = struct.unpack_from("<QQ", body)
        server.give_back(server.claim(lane_id, token, nbytes, timeout, owner=owner))
        claimed.append(nbytes)
        return 0, b""

    with lane_server(secret, calls, budget=budget) as server, \
            lane_socket(server.port, secret, OWNER) as older, lane_socket(server.port, secret, OWNER) as younger:
        older.sendall(wire.PUSH.pack(wire.PUSH_TAG, 1, 600) + bytes(600))
        wait_for(lambda: budget.held == 600, "the older push to be staged")
        younger.sendall(wire.PUSH.pack(wire.PUSH_TAG, 1, 300) + bytes(300))
        wait_for(lambda: budget.held == 900, "the younger push to be staged")
        started = time.monotonic()
        for sock in (younger, older):  # the younger's call first: it must wait for the older's
            body = struct.pack("<I", 5000) + struct.pack("<QQ", 1, 600 if sock is older else 300) + bytes(196)
            sock.sendall(wire.CALL.pack(wire.CALL_TAG, 2, wire.LANE_METHODS.index("PushInline"), len(body)) + body)
        for sock in (older, younger):
            assert wire.REPLY.unpack(wire.recv_exactly(sock, wire.REPLY.size)) == (wire.REPLY_TAG, 2, 0, 0)
        assert time.monotonic() - started < WAIT
        assert claimed == [600, 300]
        wait_for(lambda: budget.held == 0, "every push and call to be freed")
        assert budget.peak <= 1000 + 216


def test_a_shard_without_a_call_handler_closes_a_lane_that_sends_one():
    secret = os.urandom(32)
    with lane_server(secret) as server, lane_socket(server.port, secret, OWNER) as sock:
        sock.sendall(wire.CALL.pack(wire.CALL_TAG, 1, 0, 8) + bytes(8))
        assert hung_up(sock)


# -- a real shard -------------------------------------------------------------------------------

@pytest.fixture
def shard():
    started = create_server(ServerConfig(port=0))
    yield started
    started.stop(grace=0)


@pytest.mark.parametrize("lane_calls", [True, False], ids=["lane-calls", "grpc"])
def test_small_calls_travel_whole_on_a_lane_unless_turned_off(shard, lane_calls):
    with client_for(shard, lane_calls=lane_calls) as client:
        assert client.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL)
        dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
        assert client.pull(dest) == [0]
        assert same(dest, INITIAL)
        (reply,) = client.push(GRADS)
        assert reply.version == 1
        (reply,) = client.push_pull(GRADS, dest)
        assert (reply.version, reply.staleness) == (2, 1)
        assert same(dest, stepped(2))
        assert shard.lanes.open_lanes == (1 if lane_calls else 0)
        model = sum(v.numel() * 4 for v in INITIAL.values())
        used, unused = ("lane", "grpc") if lane_calls else ("grpc", "lane")
        pushed, pulled = shard.servicer.traffic.totals()
        assert (pushed[used], pushed[unused]) == (2 * model, 0)
        assert (pulled[used], pulled[unused]) == (2 * model, 0)


def _registered(shard):
    client = client_for(shard)
    client.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL)
    (session,) = client._sessions
    header = client._header(session, 0)
    header.sequence = 1
    return client, session, header


def _push(header: ps_pb2.TensorHeader, grads=GRADS, **fields) -> ps_pb2.InlinePush:
    return ps_pb2.InlinePush(header=header, data=[grads[k].numpy().tobytes() for k in ("w", "b")], **fields)


def _code(status: int) -> grpc.StatusCode:
    return LaneCallError(status, b"").code()


def test_lane_calls_are_checked_as_grpc_calls_are_and_change_nothing_when_refused(shard):
    client, session, header = _registered(shard)
    other = client_for(shard)
    try:
        assert not other.register(SPEC, SGD, worker_name="w1")
        (theirs,) = other._sessions
        their_header = other._header(theirs, 0)
        their_header.sequence = 1
        with lane_socket(shard.lanes.port, session.secret, (session.worker_id, session.generation)) as sock:
            refusals = {
                # Another live worker's call, on this worker's lane.
                "another session": (_push(their_header), grpc.StatusCode.PERMISSION_DENIED, "names session"),
                # A call on a lane naming a transfer on another lane.
                "bulk": (_push(header, bulk=ps_pb2.BulkRef(lane=1, token=1, nbytes=144)),
                         grpc.StatusCode.INVALID_ARGUMENT, "names a transfer on lane 1"),
                # A NaN gradient: refused whole, as through gRPC.
                "nan": (_push(header, {**GRADS, "b": torch.tensor([1.0, float("nan"), 0.0, 0.0])}),
                        grpc.StatusCode.INVALID_ARGUMENT, "NaN"),
            }
            bad_secret = ps_pb2.TensorHeader()
            bad_secret.CopyFrom(header)
            bad_secret.session = os.urandom(32)
            refusals["wrong secret"] = (_push(bad_secret), grpc.StatusCode.UNAUTHENTICATED, "")
            for token, (what, (request, code, words)) in enumerate(refusals.items(), 1):
                status, details = call(sock, "PushInline", request.SerializeToString(), token)
                assert _code(status) == code, what
                assert words in details.decode(), what
            status, details = call(sock, "PushInline", b"\xff\xff\xff", token=10)  # undecodable
            assert _code(status) == grpc.StatusCode.INVALID_ARGUMENT and b"undecodable" in details
            (st,) = client.status()
            assert st.pushes_applied == 0
            # The same lane then carries a good call.
            status, reply = call(sock, "PushInline", _push(header).SerializeToString(), token=11)
            assert status == 0 and ps_pb2.PushResponse.FromString(reply).version == 1
        dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
        assert client.pull(dest) == [1]
        assert same(dest, stepped(1))
    finally:
        other.close()
        client.close()


def test_a_lane_call_after_the_session_ended_is_told_to_register_again(shard):
    with client_for(shard) as client:
        assert client.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL)
        dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
        client.push_pull(GRADS, dest)
        (session,) = client._sessions
        with lane_socket(shard.lanes.port, session.secret, (session.worker_id, session.generation)) as sock:
            shard.store.leave(session.worker_id, session.generation)
            header = client._header(session, 0)
            header.sequence = 2
            status, details = call(sock, "PushInline", _push(header).SerializeToString())
            assert _code(status) == grpc.StatusCode.ABORTED and b"re-register" in details
        with pytest.raises(errors.FencedError, match="re-register"):  # the client's own lane call, alike
            client.push_pull(GRADS, dest)
        # The hand-driven lane closes; the client's stays open.
        wait_for(lambda: shard.lanes.open_lanes == 1, "the hand-driven lane to close")
        assert shard.lanes.open_lanes == 1


def test_a_dynamic_data_exchange_rides_on_a_lane_for_its_own_session_only(shard):
    from pswire.data import DataPlan
    from pswire.wire import data_plan_to_proto

    client, session, _ = _registered(shard)
    other = client_for(shard)
    try:
        assert not other.register(SPEC, SGD, worker_name="w1")
        (theirs,) = other._sessions
        plan = data_plan_to_proto(DataPlan(examples=10, task_size=4, seed=1, total=20))
        with lane_socket(shard.lanes.port, session.secret, (session.worker_id, session.generation)) as sock:
            theft = ps_pb2.DataRequest(worker_id=theirs.worker_id, generation=theirs.generation,
                                       session=theirs.secret, plan=plan, want=2)
            status, details = call(sock, "Data", theft.SerializeToString(), token=1)
            assert _code(status) == grpc.StatusCode.PERMISSION_DENIED and b"names session" in details
            mine = ps_pb2.DataRequest(worker_id=session.worker_id, generation=session.generation,
                                      session=session.secret, plan=plan, want=2)
            status, reply = call(sock, "Data", mine.SerializeToString(), token=2)
            assert status == 0
            leased = ps_pb2.DataResponse.FromString(reply)
            assert [(t.epoch, t.start, t.end) for t in leased.tasks] == [(0, 0, 4), (0, 4, 8)]
        # The other worker never leased anything; the queue shows only this worker's tasks.
        (st,) = client.status()
        assert {h.worker_name for h in st.data.holders} == {"w0"}
    finally:
        other.close()
        client.close()


def test_a_reply_lost_on_a_lane_is_retried_and_the_push_applies_once(shard, monkeypatch):
    """The lane breaks after the shard applied a push-and-pull and before its reply arrives: the
    client retries it (same sequence number), and the shard acknowledges it without applying it
    again."""
    from psworker import lanes as worker_lanes

    lost = []
    receive = worker_lanes.Lane.receive_reply

    def lose_the_first(lane, token, deadline):
        if not lost:
            lost.append(token)
            wait_for(lambda: shard.store.status()["pushes_applied"] == 1, "the shard to apply the push")
            lane.sock.close()
            raise wire.LaneError("cut by the test")
        return receive(lane, token, deadline)

    with client_for(shard) as client:
        assert client.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL)
        dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
        client.pull(dest)
        monkeypatch.setattr(worker_lanes.Lane, "receive_reply", lose_the_first)
        (reply,) = client.push_pull(GRADS, dest)
        assert lost and reply.version == 1
        assert same(dest, stepped(1))
        (st,) = client.status()
        assert (st.version, st.pushes_applied) == (1, 1)


@pytest.mark.parametrize("rows_per_call", [None, 96], ids=["one-call-per-shard", "several-calls-per-shard"])
@pytest.mark.parametrize("lane_calls", [True, False], ids=["lane-calls", "grpc"])
def test_row_reads_of_several_tables_from_two_shards_come_back_exactly(monkeypatch, lane_calls, rows_per_call):
    """``PSClient.pull_rows``: each shard's rows of every table in as few calls as its limit
    allows (all sent before any reply is read when each shard gets one), and every value lands
    at its id's place, as the tables' seeded initializer computes them."""
    from psworker import exchange
    from pswire.tables import TableSpec, initial_rows

    if rows_per_call is not None:  # bytes of values per call: 96 is 3 rows of dim 8
        monkeypatch.setattr(exchange, "ROWS_PER_CALL", rows_per_call)
    adagrad = OptimizerConfig(name="adagrad", lr=0.1)
    tables = [TableSpec(name="users", num_rows=1000, dim=8, optimizer=adagrad, seed=3),
              TableSpec(name="items", num_rows=50, dim=4, optimizer=adagrad, seed=4)]
    shards = [create_server(ServerConfig(port=0, shard_index=i, num_shards=2)) for i in range(2)]
    try:
        options = ClientOptions(timeout=WAIT, connect_timeout=WAIT, lane_calls=lane_calls)
        with PSClient([s.address for s in shards], options) as client:
            client.wait_connected()
            client.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL, tables=tables)
            asked = {"users": np.array([999, 0, 5, 6, 7, 8, 11, 500, 2]), "items": np.array([49, 1, 0, 2, 3])}
            got = client.pull_rows(asked)
            for spec in tables:
                assert np.array_equal(got[spec.name], initial_rows(spec, asked[spec.name])), spec.name
            assert [s.lanes.open_lanes for s in shards] == ([1, 1] if lane_calls else [0, 0])
    finally:
        for s in shards:
            s.stop(grace=0)


BIG = [VariableSpec("emb", (512, 256), FLOAT32)]  # 512 KiB: its pushes and pulls move on a lane
BIG_INITIAL = {"emb": (torch.arange(512 * 256, dtype=torch.float32) % 64).reshape(512, 256) / 4}
BIG_GRADS = {"emb": torch.full((512, 256), 0.5)}


def test_a_large_push_and_pull_go_whole_on_the_lane_with_their_call(shard):
    with client_for(shard) as client:
        assert client.register(BIG, SGD, worker_name="w0", initial_values=BIG_INITIAL)
        dest = {"emb": torch.zeros(512, 256)}
        assert client.pull(dest) == [0]
        (reply,) = client.push_pull(BIG_GRADS, dest)
        assert reply.version == 1
        assert torch.equal(dest["emb"], BIG_INITIAL["emb"] - 0.25)
        pushed, pulled = shard.servicer.traffic.totals()
        assert (pushed["lane"], pulled["lane"]) == (512 * 1024, 2 * 512 * 1024)
        assert shard.lanes.open_lanes == 1


def test_a_staged_push_the_shard_refuses_is_reported_not_retried(shard):
    """The shard cuts a lane whose staged push is above its limit before it reads the call that
    follows; the worker then learns the refusal through gRPC at once, rather than retrying a
    push that can never go through."""
    with client_for(shard) as client:
        assert client.register(BIG, SGD, worker_name="w0", initial_values=BIG_INITIAL)
        shard.lanes._max_bytes = 1024  # a shard whose limit the worker's pushes exceed
        started = time.monotonic()
        with pytest.raises(errors.TooLargeError, match="above this shard's limit"):
            client.push(BIG_GRADS)
        assert time.monotonic() - started < 5.0
        (st,) = client.status()
        assert st.pushes_applied == 0


def test_a_worker_refused_a_lane_makes_its_calls_through_grpc():
    """``--max-lanes 1``: the second worker's lane is refused, and its calls go through gRPC."""
    started = create_server(ServerConfig(port=0, max_lanes=1))
    try:
        first, second = client_for(started), client_for(started)
        try:
            assert first.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL)
            assert not second.register(SPEC, SGD, worker_name="w1")
            dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
            first.push_pull(GRADS, dest)
            second.push_pull(GRADS, dest)
            assert same(dest, stepped(2))
            assert started.lanes.open_lanes == 1
            pushed, _ = started.servicer.traffic.totals()
            model = sum(v.numel() * 4 for v in INITIAL.values())
            assert (pushed["lane"], pushed["grpc"]) == (model, model)
        finally:
            first.close()
            second.close()
    finally:
        started.stop(grace=0)
