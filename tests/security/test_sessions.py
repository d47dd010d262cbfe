"""Sessions on a real ``psserver`` process: a client that knows a live worker's id and generation
(``Status`` publishes both) but not its session secret cannot push, pull, heartbeat, leave or use
a bulk lane as that worker, and nothing it tries changes the model. Without tokens on the shard,
this is all that stands between a stranger and someone else's worker."""

from __future__ import annotations

import secrets
import socket

import grpc
import pytest

from pswire import lanes as wire
from pswire.v1 import ps_pb2, ps_pb2_grpc
from tests.conftest import start_shard
from tests.service.shard_harness import (
    GRADS, PARTS, RPC_TIMEOUT, Worker, expect_rpc_error, initialize, pull, push, register, status,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _lane(address: str, port: int) -> tuple[socket.socket, int, bytes]:
    sock = socket.create_connection((address.rpartition(":")[0], port), timeout=RPC_TIMEOUT)
    tag, lane_id, nonce = wire.GREETING.unpack(wire.recv_exactly(sock, wire.GREETING.size))
    assert tag == wire.GREETING_TAG
    return sock, lane_id, nonce


def _bulk_push(worker: Worker, lane_id: int, token: int) -> ps_pb2.InlinePush:
    head = ps_pb2.TensorHeader(worker_id=worker.worker_id, generation=worker.generation, session=worker.session,
                               sequence=0, base_version=0, parts=[p.to_proto() for p in PARTS])
    nbytes = sum(p.nbytes for p in PARTS)
    return ps_pb2.InlinePush(header=head, bulk=ps_pb2.BulkRef(lane=lane_id, token=token, nbytes=nbytes))


def test_a_stranger_with_a_live_workers_id_and_generation_cannot_act_as_it(tmp_path):
    shard = start_shard(tmp_path, "shard")
    channel = grpc.insecure_channel(shard.address)
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    try:
        victim, reply = register(stub, "victim")
        assert initialize(stub, victim).applied
        push(stub, victim, GRADS, base_version=0)
        st = status(stub)
        (info,) = [w for w in st.workers if w.worker_name == "victim"]
        assert victim.session not in st.SerializeToString()
        before = pull(stub).snapshot()

        for forged in (b"", secrets.token_bytes(32), victim.session[:-1] + bytes([victim.session[-1] ^ 1])):
            as_victim = Worker(info.worker_id, info.generation, forged)
            expect_rpc_error(lambda: push(stub, as_victim, GRADS, base_version=st.version),
                             grpc.StatusCode.UNAUTHENTICATED, "session secret")
            request = ps_pb2.PullRequest(worker_id=info.worker_id, generation=info.generation, clock=0, session=forged)
            expect_rpc_error(lambda: stub.PullInline(request, timeout=RPC_TIMEOUT), grpc.StatusCode.UNAUTHENTICATED)
            beat = ps_pb2.HeartbeatRequest(worker_id=info.worker_id, generation=info.generation, session=forged)
            expect_rpc_error(lambda: stub.Heartbeat(beat, timeout=RPC_TIMEOUT), grpc.StatusCode.UNAUTHENTICATED)
            leave = ps_pb2.LeaveRequest(worker_id=info.worker_id, generation=info.generation, session=forged)
            expect_rpc_error(lambda: stub.Leave(leave, timeout=RPC_TIMEOUT), grpc.StatusCode.UNAUTHENTICATED)
            expect_rpc_error(lambda: register(stub, "victim", session=forged), grpc.StatusCode.UNAVAILABLE,
                             "held by a live registration")

            # A lane opened in the victim's name with a forged proof is closed, never accepted.
            sock, lane_id, nonce = _lane(shard.address, reply.bulk_port)
            with sock:
                proof = wire.lane_proof(forged or b"\0" * 32, lane_id, nonce)
                sock.sendall(wire.AUTH.pack(wire.AUTH_TAG, info.worker_id, info.generation, proof))
                assert sock.recv(len(wire.ACCEPT_TAG)) == b""
            # Naming a lane in a push needs the session too.
            expect_rpc_error(lambda: stub.PushInline(_bulk_push(as_victim, lane_id, 1), timeout=RPC_TIMEOUT),
                             grpc.StatusCode.UNAUTHENTICATED)

        # The victim's own lane: bytes it staged cannot be claimed by another registration.
        sock, lane_id, nonce = _lane(shard.address, reply.bulk_port)
        with sock:
            sock.sendall(wire.AUTH.pack(wire.AUTH_TAG, victim.worker_id, victim.generation,
                                        wire.lane_proof(victim.session, lane_id, nonce)))
            assert wire.recv_exactly(sock, len(wire.ACCEPT_TAG)) == wire.ACCEPT_TAG
            payload = bytes(sum(p.nbytes for p in PARTS))
            sock.sendall(wire.PUSH.pack(wire.PUSH_TAG, 7, len(payload)) + payload)
            stranger, _ = register(stub, "stranger")
            expect_rpc_error(lambda: stub.PushInline(_bulk_push(stranger, lane_id, 7), timeout=RPC_TIMEOUT),
                             grpc.StatusCode.INVALID_ARGUMENT, "does not belong to this session")
            assert pull(stub).snapshot() == before
            applied = stub.PushInline(_bulk_push(victim, lane_id, 7), timeout=RPC_TIMEOUT)  # zero gradients
            assert applied.action == "apply"

        (still,) = [w for w in status(stub).workers if w.worker_name == "victim"]
        assert (still.live, still.generation) == (True, info.generation)
        assert push(stub, victim, GRADS, base_version=status(stub).version).action == "apply"
        assert "Traceback" not in shard.log()
    finally:
        channel.close()
        shard.stop()
