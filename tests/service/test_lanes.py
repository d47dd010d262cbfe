"""Service tier: the bulk lanes (``pswire.lanes``) beside one real in-process shard.

Large pushes and pulls move their bytes on a lane; these tests check that the bytes land exactly,
that a broken or missing lane costs a retry or a fallback to gRPC and never a double apply, and
that a peer speaking nonsense on the bulk port is cut off while the shard keeps serving.
Values are exact in float32 (power-of-two steps), so results are compared with ``==``.
"""

from __future__ import annotations

import socket
import struct
import time
from concurrent import futures

import grpc
import pytest
import torch

from psserver import screen
from psserver.config import ServerConfig
from psserver.server import create_server
from pswire import errors
from pswire import lanes as wire
from pswire.dtypes import FLOAT16, FLOAT32
from pswire.optim import OptimizerConfig
from pswire.placement import VariableSpec
from pswire.v1 import ps_pb2, ps_pb2_grpc
from psworker.client import ClientOptions, PSClient
from tests.security.lane_harness import wait_for

pytestmark = pytest.mark.timeout(120)

RPC_TIMEOUT = 10.0
SGD = OptimizerConfig(name="sgd", lr=0.5)
ROWS = 512  # 512 x 256 float32 = 512 KiB: above the default inline limit of 256 KiB
SPEC = [VariableSpec("emb", (ROWS, 256), FLOAT32), VariableSpec("bias", (4,), FLOAT32)]
INITIAL = {
    "emb": (torch.arange(ROWS * 256, dtype=torch.float32) % 64).reshape(ROWS, 256) / 4,
    "bias": torch.tensor([1.0, -2.0, 0.5, 0.0]),
}
GRADS = {"emb": torch.full((ROWS, 256), 0.5), "bias": torch.tensor([2.0, -4.0, 1.0, 8.0])}


def stepped(n: int) -> dict[str, torch.Tensor]:
    """INITIAL after n SGD steps of GRADS (exact in float32)."""
    return {k: v - n * 0.5 * GRADS[k] for k, v in INITIAL.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def shard():
    started = create_server(ServerConfig(port=0, max_request_bytes=4 << 20))
    yield started
    started.stop(grace=0)


def client_for(shard, **options) -> PSClient:
    client = PSClient([shard.address], ClientOptions(timeout=RPC_TIMEOUT, connect_timeout=RPC_TIMEOUT, **options))
    client.wait_connected()
    return client


def test_pushes_and_pulls_move_on_lanes_exactly(shard):
    with client_for(shard) as client:
        assert client.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL)
        dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
        assert client.pull(dest) == [0]
        assert same(dest, INITIAL)
        (reply,) = client.push(GRADS)
        assert reply.version == 1
        (reply,) = client.push_pull(GRADS, dest)  # one PushPull call, both sides on the lane
        assert (reply.version, reply.staleness) == (2, 1)
        assert same(dest, stepped(2))
        assert shard.lanes.open_lanes == 1  # one lane, reused by every call
        (st,) = client.status()
        assert (st.pushes_applied, st.pushes_rejected) == (2, 0)


def test_a_pull_skips_only_the_tensors_it_wrote_itself(shard):
    """Skipping unchanged parts goes by the tensor pulled into, not by its address: a different
    tensor at the same address (a view here; a new tensor in a freed one's memory in practice)
    is written."""
    with client_for(shard) as client:
        assert client.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL)
        dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
        client.pull(dest)
        again = {k: v.view(v.shape) for k, v in dest.items()}
        for tensor in again.values():
            tensor.zero_()
        client.pull(again)
        assert same(again, INITIAL)
        client.pull(again)  # unchanged since that pull: skipped, and still right
        assert same(again, INITIAL)


def test_compressed_pushes_and_pulls_on_lanes(shard):
    with client_for(shard, wire_dtype=torch.bfloat16) as client:
        assert client.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL)
        dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
        client.push_pull(GRADS, dest)
        # Every value here is exact in bfloat16 too (multiples of 1/4 below 16).
        assert same(dest, stepped(1))
        assert shard.lanes.open_lanes == 1


def test_a_broken_lane_is_retried_and_the_push_applies_once(shard):
    with client_for(shard) as client:
        assert client.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL)
        dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
        client.push_pull(GRADS, dest)
        (pool,) = [c.lanes for c in client._clients]
        (idle,) = pool._idle
        idle.sock.shutdown(socket.SHUT_RDWR)  # the next call finds its lane dead mid-use
        client.push_pull(GRADS, dest)
        assert same(dest, stepped(2))
        (st,) = client.status()
        assert st.pushes_applied == 2


def test_without_lanes_the_client_falls_back_to_grpc(shard):
    with client_for(shard) as client:
        assert client.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL)
        shard.lanes.stop()  # the bulk port goes away: connecting to it now fails
        dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
        client.push_pull(GRADS, dest)
        assert same(dest, stepped(1))
        client.push(GRADS)
        assert client.pull(dest) == [2]
        assert same(dest, stepped(2))


def test_shard_without_lanes_offers_none():
    shard = create_server(ServerConfig(port=0, bulk_port=-1))
    try:
        assert shard.lanes is None
        with client_for(shard) as client:
            assert client.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL)
            dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
            client.push_pull(GRADS, dest)
            assert same(dest, stepped(1))
            assert [c.lanes.port for c in client._clients] == [0]
    finally:
        shard.stop(grace=0)


def test_a_failed_call_does_not_leave_the_pull_waiting_on_its_lane(shard):
    """A fenced pull never sends on the lane; the client must not wait out the deadline."""
    with client_for(shard) as client:
        assert client.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL)
        (session,) = client._sessions
        session.generation += 1  # a registration the shard no longer knows
        dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
        request = ps_pb2.PullRequest(worker_id=session.worker_id, generation=session.generation, clock=0)
        started = time.monotonic()
        with pytest.raises(errors.FencedError, match="generation"):
            session.client.pull(request, {p.key: dest[p.name] for p in session.parts}, 512 * 1024 + 16)
        assert time.monotonic() - started < RPC_TIMEOUT / 2


def _greeted(shard) -> tuple[socket.socket, int, bytes]:
    sock = socket.create_connection(("127.0.0.1", shard.lanes.port), timeout=RPC_TIMEOUT)
    tag, lane_id, nonce = wire.GREETING.unpack(wire.recv_exactly(sock, wire.GREETING.size))
    assert tag == wire.GREETING_TAG
    return sock, lane_id, nonce


def _raw_lane(shard, client: PSClient) -> tuple[socket.socket, int]:
    """A lane opened by hand for ``client``'s session on ``shard``."""
    (session,) = client._sessions
    sock, lane_id, nonce = _greeted(shard)
    proof = wire.lane_proof(session.secret, lane_id, nonce)
    sock.sendall(wire.AUTH.pack(wire.AUTH_TAG, session.worker_id, session.generation, proof))
    assert wire.recv_exactly(sock, len(wire.ACCEPT_TAG)) == wire.ACCEPT_TAG
    return sock, lane_id


def _stub(shard) -> tuple[grpc.Channel, ps_pb2_grpc.ParameterServerStub]:
    channel = grpc.insecure_channel(shard.address)
    return channel, ps_pb2_grpc.ParameterServerStub(channel)


def _registered(shard) -> tuple[PSClient, ps_pb2.TensorHeader]:
    client = client_for(shard)
    client.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL)
    (session,) = client._sessions
    header = client._header(session, 0)
    header.sequence = 1
    return client, header


def test_bad_bulk_pushes_are_refused_and_change_nothing(shard):
    client, header = _registered(shard)
    channel, stub = _stub(shard)
    try:
        nbytes = ROWS * 256 * 4 + 16
        # A lane the shard never opened: retryable, so UNAVAILABLE, naming the lane.
        ref = ps_pb2.BulkRef(lane=12345, token=1, nbytes=nbytes)
        with pytest.raises(grpc.RpcError) as caught:
            stub.PushInline(ps_pb2.InlinePush(header=header, bulk=ref), timeout=RPC_TIMEOUT)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "12345" in caught.value.details()

        sock, lane_id = _raw_lane(shard, client)
        with sock:
            # A byte count that disagrees with the parts.
            ref = ps_pb2.BulkRef(lane=lane_id, token=1, nbytes=nbytes - 4)
            with pytest.raises(grpc.RpcError) as caught:
                stub.PushInline(ps_pb2.InlinePush(header=header, bulk=ref), timeout=RPC_TIMEOUT)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in caught.value.details()

            # Inline data and a lane at once.
            ref = ps_pb2.BulkRef(lane=lane_id, token=1, nbytes=nbytes)
            with pytest.raises(grpc.RpcError) as caught:
                stub.PushInline(ps_pb2.InlinePush(header=header, bulk=ref, data=[b"x"]), timeout=RPC_TIMEOUT)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            # NaN staged on the lane: refused whole.
            grad = torch.cat([GRADS["emb"].reshape(-1), GRADS["bias"]])
            grad[7] = float("nan")
            sock.sendall(wire.PUSH.pack(wire.PUSH_TAG, 2, nbytes) + grad.numpy().tobytes())
            ref = ps_pb2.BulkRef(lane=lane_id, token=2, nbytes=nbytes)
            with pytest.raises(grpc.RpcError) as caught:
                stub.PushInline(ps_pb2.InlinePush(header=header, bulk=ref), timeout=RPC_TIMEOUT)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in caught.value.details()

            # Above the shard's request limit (4 MiB here): the lane is cut, the call says why.
            sock.sendall(wire.PUSH.pack(wire.PUSH_TAG, 3, 5 << 20))
            ref = ps_pb2.BulkRef(lane=lane_id, token=3, nbytes=nbytes)
            with pytest.raises(grpc.RpcError) as caught:
                stub.PushInline(ps_pb2.InlinePush(header=header, bulk=ref), timeout=RPC_TIMEOUT)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit" in caught.value.details()

        dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
        assert client.pull(dest) == [0]
        assert same(dest, INITIAL)
        (st,) = client.status()
        assert (st.pushes_applied, st.pushes_rejected) == (0, 5)
        client.push(GRADS)  # still serving, on a lane of its own
        assert client.pull(dest) == [1]
        assert same(dest, stepped(1))
    finally:
        channel.close()
        client.close()


BIG_ROWS = 2304  # 2304 x 1024 float32 = 9 MiB: a push of three lane pieces (4 + 4 + 1 MiB and the rest)
BIG_SPEC = [VariableSpec("big", (BIG_ROWS, 1024), FLOAT32), VariableSpec("bias", (5,), FLOAT32),
            VariableSpec("half", (3,), FLOAT16)]  # 6 bytes: the push ends inside a float32 word
BIG_INITIAL = {"big": torch.full((BIG_ROWS, 1024), 2.0), "bias": torch.arange(5.0),
               "half": torch.tensor([1.0, -1.0, 0.5], dtype=torch.float16)}
BIG_GRADS = {"big": torch.full((BIG_ROWS, 1024), 0.5), "bias": torch.full((5,), 2.0),
             "half": torch.tensor([0.5, 0.5, -0.5], dtype=torch.float16)}


def test_a_push_of_several_pieces_is_read_for_nan_while_it_arrives(monkeypatch):
    """A bulk push of more than one piece has its float32 bytes read for NaN and infinity as each
    piece lands (``psserver.screen.ArrivalScreen``): after its last byte only what was not read
    so (here the float16 variable) is read. A NaN or an infinity in any piece, the last one
    included, still refuses the push whole, and the shard serves the next."""
    read_after: list[int] = []
    real = screen.magnitude
    monkeypatch.setattr(screen, "magnitude", lambda a: read_after.append(a.size) or real(a))
    started = create_server(ServerConfig(port=0, max_request_bytes=64 << 20))
    client = client_for(started)
    channel, stub = _stub(started)
    try:
        assert client.register(BIG_SPEC, SGD, worker_name="w0", initial_values=BIG_INITIAL)
        (reply,) = client.push(BIG_GRADS)
        assert reply.version == 1
        assert 0 < max(read_after) < 16, read_after  # the 9 MiB and the bias were read as they came
        dest = {k: torch.zeros_like(v) for k, v in BIG_INITIAL.items()}
        client.pull(dest)
        assert same(dest, {k: v - 0.5 * BIG_GRADS[k] for k, v in BIG_INITIAL.items()})

        (session,) = client._sessions
        header = client._header(session, 0)
        sock, lane_id = _raw_lane(started, client)
        with sock:
            for token, (name, index, value) in enumerate(
                    [("big", (1 << 20) + 3, float("nan")),  # in the second piece
                     ("bias", 4, float("inf")),  # in the last piece, beside the float16 bytes
                     ("big", BIG_ROWS * 1024 - 1, float("-inf"))], start=2):
                grads = {k: v.clone() for k, v in BIG_GRADS.items()}
                grads[name].view(-1)[index] = value
                body = b"".join(grads[v.name].numpy().tobytes() for v in BIG_SPEC)
                sock.sendall(wire.PUSH.pack(wire.PUSH_TAG, token, len(body)) + body)
                header.sequence = token
                ref = ps_pb2.BulkRef(lane=lane_id, token=token, nbytes=len(body))
                with pytest.raises(grpc.RpcError) as caught:
                    stub.PushInline(ps_pb2.InlinePush(header=header, bulk=ref), timeout=RPC_TIMEOUT)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
                assert "NaN or Inf" in caught.value.details() and name in caught.value.details()
        again = {k: torch.zeros_like(v) for k, v in BIG_INITIAL.items()}
        assert client.pull(again) == [1]
        assert same(again, dest)  # nothing of the refused pushes applied
        (reply,) = client.push(BIG_GRADS)  # still serving
        assert reply.version == 2
        (st,) = client.status()
        assert (st.pushes_applied, st.pushes_rejected) == (2, 3)
    finally:
        channel.close()
        client.close()
        started.stop(grace=0)


@pytest.mark.parametrize("authenticated", [True, False], ids=["in-a-session", "unauthenticated"])
@pytest.mark.parametrize(
    "garbage", [b"GET / HTTP/1.1\r\n\r\n" + bytes(40), struct.pack("<4sQQ", b"PSPL", 1, 1) + bytes(40)]
)
def test_nonsense_on_the_bulk_port_closes_that_lane_only(shard, garbage, authenticated):
    with client_for(shard) as client:
        assert client.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL)
        dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
        client.pull(dest)
        sock = _raw_lane(shard, client)[0] if authenticated else _greeted(shard)[0]
        with sock:
            sock.sendall(garbage)
            sock.settimeout(RPC_TIMEOUT)
            assert sock.recv(1) == b""  # the shard hung up on it
        client.push_pull(GRADS, dest)
        assert same(dest, stepped(1))
        assert shard.lanes.open_lanes == 1


def test_a_lane_serves_only_the_worker_that_opened_it(shard):
    """Another live worker can neither claim the bytes staged on a lane it did not open nor
    have a pull sent on it; the owner's push is still there for its own call."""
    client, header = _registered(shard)
    other = client_for(shard)
    channel, stub = _stub(shard)
    try:
        assert not other.register(SPEC, SGD, worker_name="w1")
        (theirs,) = other._sessions
        their_header = other._header(theirs, 0)
        their_header.sequence = 1
        nbytes = ROWS * 256 * 4 + 16
        sock, lane_id = _raw_lane(shard, client)
        with sock:
            grad = torch.cat([GRADS["emb"].reshape(-1), GRADS["bias"]])
            sock.sendall(wire.PUSH.pack(wire.PUSH_TAG, 1, nbytes) + grad.numpy().tobytes())
            ref = ps_pb2.BulkRef(lane=lane_id, token=1, nbytes=nbytes)
            with pytest.raises(grpc.RpcError) as caught:
                stub.PushInline(ps_pb2.InlinePush(header=their_header, bulk=ref), timeout=RPC_TIMEOUT)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "does not belong" in caught.value.details()
            pull = ps_pb2.PullRequest(
                worker_id=theirs.worker_id, generation=theirs.generation, session=theirs.secret, clock=-1,
                bulk=ps_pb2.BulkRef(lane=lane_id, token=2),
            )
            with pytest.raises(grpc.RpcError) as caught:
                stub.PullInline(pull, timeout=RPC_TIMEOUT)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "does not belong" in caught.value.details()
            reply = stub.PushInline(ps_pb2.InlinePush(header=header, bulk=ref), timeout=RPC_TIMEOUT)
            assert reply.version == 1
        dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
        assert client.pull(dest) == [1]
        assert same(dest, stepped(1))
    finally:
        channel.close()
        other.close()
        client.close()


def test_after_a_shard_restart_the_worker_finds_its_new_bulk_port():
    """A restarted shard listens on a new bulk port: the old lanes fail (retried, then fenced by
    the empty shard), and the next registration learns the new port."""
    first = create_server(ServerConfig(port=0))
    port = first.port
    try:
        with client_for(first) as client:
            assert client.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL)
            dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
            client.push_pull(GRADS, dest)
            first.stop(grace=0)
            second = create_server(ServerConfig(port=port))
            try:
                with pytest.raises(errors.FencedError, match="register again"):
                    client.push_pull(GRADS, dest)
                assert client.register(SPEC, SGD, worker_name="w0", initial_values=INITIAL)
                client.push_pull(GRADS, dest)
                assert same(dest, stepped(1))
                assert [c.lanes.port for c in client._clients] == [second.lanes.port]
                assert second.lanes.open_lanes == 1
            finally:
                second.stop(grace=0)
    finally:
        first.stop(grace=0)


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk-lanes", "grpc-streams"])
def test_pushes_in_flight_stay_within_the_budget(bulk):
    """Two workers push at once, each push 512 KiB, against a 600 KiB budget: every push is
    applied, and the bytes held stay within the budget plus one push (``psserver.inflight``:
    bytes are taken piece by piece as they arrive, and the oldest transfer is always admitted)."""
    push_bytes = ROWS * 256 * 4 + 16
    shard = create_server(ServerConfig(port=0, max_inflight_bytes=600 << 10))
    try:
        clients = [client_for(shard, bulk=bulk) for _ in range(2)]
        assert clients[0].register(SPEC, SGD, worker_name="w0", initial_values=INITIAL)
        assert not clients[1].register(SPEC, SGD, worker_name="w1")

        def train(client: PSClient) -> None:
            dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
            for _ in range(10):
                client.push_pull(GRADS, dest)

        with futures.ThreadPoolExecutor(2) as pool:
            for done in [pool.submit(train, c) for c in clients]:
                done.result(timeout=RPC_TIMEOUT * 6)
        dest = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
        assert clients[0].pull(dest) == [20]
        assert same(dest, stepped(20))
        (st,) = clients[0].status()
        assert st.pushes_applied == 20
        assert st.max_inflight_bytes == 600 << 10
        assert st.push_bytes_in_flight == 0
        assert push_bytes <= st.push_bytes_in_flight_peak <= (600 << 10) + push_bytes
    finally:
        for client in clients:
            client.close()
        shard.stop(grace=0)


def test_a_frozen_worker_s_staged_push_leaves_the_budget_when_its_lease_ends():
    """A worker that staged a push on its lane and froze before the call that claims it holds
    those bytes in the in-flight budget, first in line. Once its lease ends the shard closes the
    lanes of its session, the bytes leave the budget, and a live worker's push that needed the
    room applies (before, it waited for the frozen worker's TCP connection to die)."""
    push_bytes = ROWS * 256 * 4 + 16
    shard = create_server(ServerConfig(port=0, lease_timeout=1.0, max_inflight_bytes=600 << 10))
    live, frozen = client_for(shard), client_for(shard)
    try:
        assert live.register(SPEC, SGD, worker_name="live", initial_values=INITIAL)
        assert not frozen.register(SPEC, SGD, worker_name="frozen")
        frozen._heartbeat_stop.set()
        sock, _ = _raw_lane(shard, frozen)
        with sock, futures.ThreadPoolExecutor(1) as pool:
            sock.sendall(wire.PUSH.pack(wire.PUSH_TAG, 1, push_bytes) + bytes(push_bytes))
            staged = lambda: live.status()[0].push_bytes_in_flight == push_bytes
            wait_for(staged, "the frozen worker's push to be staged", RPC_TIMEOUT)
            pushed = pool.submit(live.push, GRADS)  # another 512 KiB: no room beside the frozen push
            assert pushed.result(timeout=RPC_TIMEOUT * 2)[0].version == 1
            sock.settimeout(RPC_TIMEOUT)
            assert sock.recv(1) == b""  # the shard closed the frozen session's lane
        (st,) = live.status()
        assert (st.pushes_applied, st.push_bytes_in_flight) == (1, 0)
        assert st.workers_evicted == 1
    finally:
        live.close()
        frozen.close()
        shard.stop(grace=0)
