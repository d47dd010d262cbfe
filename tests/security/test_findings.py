"""Regression tests of the security review's findings: each was an accepted input that left a
real shard broken, a silent loss, or a way in for a client without credentials. Every test here
failed on the code before the fix; each now checks the status code, a message naming the
problem, that the shard's model is unchanged, and that it keeps serving.

One real shard in-process on port 0, driven through raw gRPC as a hostile client would.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time

import grpc
import numpy as np
import pytest

from psserver.checkpoint import LATEST
from pswire.v1 import ps_pb2
from tests.service.shard_harness import (
    GRADS, INITIAL, PARTS, RPC_TIMEOUT, Worker, chunks, expect_rpc_error, header, initialize, pull, push, register,
    register_request, status,
)

pytestmark = pytest.mark.timeout(120)

INT64_MAX = 2**63 - 1


def _push(stub, worker: Worker, *, grads=GRADS, base_version: int, **fields):
    specs = [p.to_proto() for p in PARTS if p.key in grads]
    first = header(worker, specs, base_version=base_version)
    for name, value in fields.items():
        if name == "data":
            first.header.data.CopyFrom(value)
        else:
            setattr(first.header, name, value)
    return stub.Push(iter([first, *chunks(list(grads.values()))]), timeout=RPC_TIMEOUT)


def _serving(job, before) -> None:
    """Status, Pull and Register still answer, the model is what it was, and a real push applies."""
    assert pull(job.stub).snapshot() == before.snapshot()
    now = status(job.stub)
    assert now.state == "ready" and now.version == before.version
    register(job.stub, "newcomer")
    reply = push(job.stub, job.worker, GRADS, base_version=now.version)
    assert reply.version == now.version + 1 and reply.action == "apply"
    assert status(job.stub).version == now.version + 1


@pytest.mark.parametrize("field, value", [
    ("clock", INT64_MAX), ("clock", -1), ("base_clock", INT64_MAX), ("sequence", -5),
    ("data", ps_pb2.DataPosition(step=INT64_MAX - 1)), ("data", ps_pb2.DataPosition(position=-1)),
])
def test_a_push_with_an_out_of_range_integer_is_refused_and_the_shard_keeps_serving(ready, field, value):
    before = pull(ready.stub)
    expect_rpc_error(
        lambda: _push(ready.stub, ready.worker, base_version=1, **{field: value}),
        grpc.StatusCode.INVALID_ARGUMENT, "out of range" if field != "clock" or value < 0 else "clock",
    )
    _serving(ready, before)


def test_a_registration_whose_shape_overflows_is_refused(shard, stub):
    huge = ps_pb2.PartSpec(name="w", full_shape=[2**62, 2**62], dtype=ps_pb2.FLOAT32, row_start=0, row_end=2**62)
    expect_rpc_error(lambda: stub.Register(register_request(parts=[huge]), timeout=RPC_TIMEOUT),
                     grpc.StatusCode.INVALID_ARGUMENT, "'w'")
    big = ps_pb2.PartSpec(name="w", full_shape=[1 << 20, 1 << 20], dtype=ps_pb2.FLOAT32, row_start=0, row_end=1 << 20)
    expect_rpc_error(lambda: stub.Register(register_request(parts=[big]), timeout=RPC_TIMEOUT),
                     grpc.StatusCode.INVALID_ARGUMENT, "--max-model-bytes")
    assert status(stub).state == "empty"
    worker, reply = register(stub)
    assert reply.must_initialize and initialize(stub, worker).applied
    assert status(stub).bytes_held == sum(p.nbytes for p in PARTS)


@pytest.mark.parametrize("sequence, why", [(2**62, "out of range"), (1000, "far ahead")])
def test_a_sequence_far_ahead_is_refused_and_later_pushes_still_apply(ready, sequence, why):
    expect_rpc_error(lambda: _push(ready.stub, ready.worker, base_version=1, sequence=sequence),
                     grpc.StatusCode.INVALID_ARGUMENT, why)
    for sequence in (1, 2, 3):
        version = status(ready.stub).version
        reply = _push(ready.stub, ready.worker, base_version=version, sequence=sequence)
        assert (reply.action, reply.version) == ("apply", version + 1)
    assert status(ready.stub).version == 4


def test_a_push_older_than_the_dedupe_window_is_never_acknowledged_as_applied(ready):
    for sequence in range(1, 70):
        _push(ready.stub, ready.worker, base_version=status(ready.stub).version, sequence=sequence)
    version = status(ready.stub).version
    again = _push(ready.stub, ready.worker, base_version=version, sequence=69)
    assert again.version == version  # a recent one is acknowledged with its reply, not re-applied
    expect_rpc_error(lambda: _push(ready.stub, ready.worker, base_version=version, sequence=1),
                     grpc.StatusCode.FAILED_PRECONDITION, "not known")
    assert status(ready.stub).version == version


def test_a_client_that_knows_a_live_workers_id_and_generation_cannot_act_as_it(ready):
    st = status(ready.stub)
    (info,) = [w for w in st.workers if w.worker_name == "worker-0"]
    assert len(ready.worker.session) >= 16 and ready.worker.session not in st.SerializeToString()
    before = pull(ready.stub)
    for session in (b"", secrets.token_bytes(32)):
        impostor = Worker(info.worker_id, info.generation, session)
        expect_rpc_error(lambda: push(ready.stub, impostor, GRADS, base_version=st.version),
                         grpc.StatusCode.UNAUTHENTICATED, "session")
        as_worker = ps_pb2.PullRequest(worker_id=info.worker_id, generation=info.generation, clock=0, session=session)
        expect_rpc_error(lambda: ready.stub.PullInline(as_worker, timeout=RPC_TIMEOUT),
                         grpc.StatusCode.UNAUTHENTICATED, "session")
        beat = ps_pb2.HeartbeatRequest(worker_id=info.worker_id, generation=info.generation, session=session)
        expect_rpc_error(lambda: ready.stub.Heartbeat(beat, timeout=RPC_TIMEOUT), grpc.StatusCode.UNAUTHENTICATED)
        leave = ps_pb2.LeaveRequest(worker_id=info.worker_id, generation=info.generation, session=session)
        expect_rpc_error(lambda: ready.stub.Leave(leave, timeout=RPC_TIMEOUT), grpc.StatusCode.UNAUTHENTICATED)
        expect_rpc_error(lambda: register(ready.stub, "worker-0", session=session),
                         grpc.StatusCode.UNAVAILABLE, "held by a live registration")
    assert pull(ready.stub).snapshot() == before.snapshot()
    (still,) = [w for w in status(ready.stub).workers if w.worker_name == "worker-0"]
    assert (still.live, still.generation) == (True, info.generation)
    reply = push(ready.stub, ready.worker, GRADS, base_version=st.version)  # the real worker goes on
    assert reply.version == st.version + 1


def test_a_live_name_is_taken_over_by_its_own_session_or_after_its_lease(make_shard, open_stub):
    stub = open_stub(make_shard(lease_timeout=1.0).address)
    first, _ = register(stub, "w")
    again, reply = register(stub, "w", session=first.session)
    assert again.generation == first.generation + 1 and again.session != first.session
    expect_rpc_error(lambda: register(stub, "w"), grpc.StatusCode.UNAVAILABLE, "lease expires")
    deadline = time.monotonic() + 20
    while True:  # no heartbeat: the lease runs out and the reaper evicts the registration
        try:
            taken, _ = register(stub, "w")
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
            time.sleep(0.2)
    assert taken.generation == again.generation + 1


def test_checkpoint_ids_cannot_pin_latest_and_must_increase(make_shard, open_stub, tmp_path):
    shard = make_shard(checkpoint_dir=str(tmp_path))
    job = _ready(open_stub(shard.address))
    now = int(time.time())
    assert job.Checkpoint(ps_pb2.CheckpointRequest(checkpoint_id=now), timeout=RPC_TIMEOUT).complete
    latest = (tmp_path / LATEST).read_bytes()
    expect_rpc_error(lambda: job.Checkpoint(ps_pb2.CheckpointRequest(checkpoint_id=999999999999), timeout=RPC_TIMEOUT),
                     grpc.StatusCode.INVALID_ARGUMENT, "out of range")
    expect_rpc_error(lambda: job.Checkpoint(ps_pb2.CheckpointRequest(checkpoint_id=now - 1), timeout=RPC_TIMEOUT),
                     grpc.StatusCode.FAILED_PRECONDITION, "only increase")
    assert (tmp_path / LATEST).read_bytes() == latest
    assert job.Checkpoint(ps_pb2.CheckpointRequest(checkpoint_id=now + 1), timeout=RPC_TIMEOUT).complete


def test_an_unwritable_checkpoint_directory_is_a_clear_failed_precondition(make_shard, open_stub, tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    shard = make_shard(checkpoint_dir=str(directory))
    job = _ready(open_stub(shard.address))
    shutil.rmtree(directory)
    directory.write_text("a file where the checkpoint directory was\n")  # root ignores chmod; this fails for all
    expect_rpc_error(lambda: job.Checkpoint(ps_pb2.CheckpointRequest(checkpoint_id=int(time.time())), timeout=RPC_TIMEOUT),
                     grpc.StatusCode.FAILED_PRECONDITION, "cannot write checkpoint", str(directory))
    assert status(job).state == "ready"


def test_an_update_that_would_overflow_is_refused_whole_and_counted(ready):
    huge = {k: (v.sign() + (v == 0)) * 3e38 for k, v in GRADS.items()}  # finite gradients
    for version in (1, 2):  # x - 0.5 * 3e38, twice: about -3e38, still finite
        assert push(ready.stub, ready.worker, huge, base_version=version).version == version + 1
    before = pull(ready.stub)
    expect_rpc_error(lambda: push(ready.stub, ready.worker, huge, base_version=3),  # a third: -4.5e38 = -inf
                     grpc.StatusCode.INVALID_ARGUMENT, "non-finite")
    assert pull(ready.stub).snapshot() == before.snapshot()
    assert status(ready.stub).updates_nonfinite == 1
    assert all(np.isfinite(np.frombuffer(b, np.float32)).all() for b in pull(ready.stub).data.values())
    small = {k: v / 4 for k, v in GRADS.items()}
    assert push(ready.stub, ready.worker, small, base_version=3).version == 4


def test_initialize_streams_from_strangers_are_refused_before_their_bytes_are_read(shard, stub):
    worker, reply = register(stub)
    assert reply.must_initialize
    stranger = Worker(worker.worker_id + 100, 1)
    other, _ = register(stub, "other")  # registered, but not the one chosen to initialise
    specs = [p.to_proto() for p in PARTS]
    for who, code in ((stranger, grpc.StatusCode.ABORTED), (other, grpc.StatusCode.FAILED_PRECONDITION),
                      (Worker(worker.worker_id, worker.generation), grpc.StatusCode.UNAUTHENTICATED)):
        # The header alone, and a stream the client never closes: the shard answers at once.
        def never_ending(first=header(who, specs)):
            yield first
            time.sleep(RPC_TIMEOUT)

        started = time.monotonic()
        expect_rpc_error(lambda: stub.Initialize(never_ending(), timeout=RPC_TIMEOUT), code)
        assert time.monotonic() - started < RPC_TIMEOUT / 2
    assert initialize(stub, worker).applied


def test_a_push_stream_that_stops_sending_is_cut_and_frees_its_thread(make_shard, open_stub):
    stub = open_stub(make_shard(stream_idle_timeout=1.0).address)
    worker, _ = register(stub)
    initialize(stub, worker)
    specs = [p.to_proto() for p in PARTS]
    stop = time.monotonic() + 30

    def stalled():
        yield header(worker, specs, base_version=0)
        while time.monotonic() < stop:  # sends nothing more, never closes
            time.sleep(0.05)

    started = time.monotonic()
    expect_rpc_error(lambda: stub.Push(stalled(), timeout=30), grpc.StatusCode.CANCELLED)
    assert time.monotonic() - started < 10
    assert status(stub).state == "ready" and status(stub).push_bytes_in_flight == 0


def test_undecodable_requests_are_invalid_argument(shard, open_stub):
    channel = grpc.insecure_channel(shard.address)
    try:
        for method in ("Status", "Register", "Heartbeat", "PullInline", "PushInline", "Checkpoint"):
            call = channel.unary_unary(f"/pswire.v1.ParameterServer/{method}")
            for garbage in (b"\xff\xff\xff", b"\x0a\x05ab", os.urandom(64)):
                try:
                    call(garbage, timeout=RPC_TIMEOUT)
                except grpc.RpcError as exc:
                    assert exc.code() != grpc.StatusCode.UNKNOWN, f"{method}: {exc.details()}"
        push = channel.stream_unary("/pswire.v1.ParameterServer/Push")
        expect_rpc_error(lambda: push(iter([b"\xff\xff\xff"]), timeout=RPC_TIMEOUT),
                         grpc.StatusCode.INVALID_ARGUMENT, "undecodable")
        expect_rpc_error(lambda: channel.unary_unary("/pswire.v1.ParameterServer/Status")(b"\xff", timeout=RPC_TIMEOUT),
                         grpc.StatusCode.INVALID_ARGUMENT, "undecodable")
    finally:
        channel.close()


def _ready(stub):
    worker, _ = register(stub)
    initialize(stub, worker, INITIAL)
    push(stub, worker, GRADS, base_version=0)
    return stub
