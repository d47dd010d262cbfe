"""Service tier: one real shard in-process on port 0 (``tests/service/shard_harness.py``): how
the clients map its status codes, concurrent and dropped calls, exactly-once pushes, and the
single-message calls (PushInline, PullInline, PushPull) with their compressed wire.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent import futures

import grpc
import pytest
import torch

from pswire import errors
from pswire.codec import Part
from pswire.dtypes import FLOAT32
from pswire.placement import VariableSpec
from pswire.v1 import ps_pb2, ps_pb2_grpc
from psworker.client import ClientOptions, PSClient, ShardClient
from psworker.tensors import tensor_bytes

from tests.service.shard_harness import (
    RPC_TIMEOUT, SHORT_DEADLINE, JOB, SGD, SPEC, PART, MODEL_BYTES, INITIAL, GRADS, Worker, raw, sgd_step,
    register_request, register, header, stream, initialize, push, pull, status, expect_rpc_error,
    assert_unchanged_and_serving, ObservedStore, nan_w, preinitialised_store,
)

pytestmark = pytest.mark.timeout(120)

# -- client error mapping --------------------------------------------------------------------


def _client_header(worker: Worker, keys: Sequence[str], base_version: int) -> ps_pb2.TensorHeader:
    return header(worker, [PART[k].to_proto() for k in keys], base_version=base_version).header


def test_shard_client_maps_status_codes_to_domain_errors(ready, make_shard):
    client = ShardClient(ready.shard.address, ClientOptions(timeout=RPC_TIMEOUT, connect_timeout=RPC_TIMEOUT))
    try:
        client.wait_connected(RPC_TIMEOUT)
        address = ready.shard.address

        with pytest.raises(errors.InvalidArgumentError) as info:
            client.push(_client_header(ready.worker, ["w"], 1), [tensor_bytes(nan_w())])
        assert address in str(info.value) and "NaN" in str(info.value) and "INVALID_ARGUMENT" in str(info.value)
        assert isinstance(info.value.__cause__, grpc.RpcError)

        stale = Worker(ready.worker.worker_id, ready.worker.generation - 1, ready.worker.session)
        with pytest.raises(errors.PreconditionError) as info:
            client.push(_client_header(stale, ["w"], 1), [tensor_bytes(GRADS["w"])])
        assert address in str(info.value) and "re-register" in str(info.value)

        with pytest.raises(errors.PreconditionError) as info:
            client.register(register_request(job_fingerprint="job-b"))
        assert address in str(info.value) and "'job-b'" in str(info.value)

        with pytest.raises(errors.InvalidArgumentError) as info:
            client.register(register_request(""))
        assert address in str(info.value) and "worker_name" in str(info.value)

        assert client.status().version == 1
        reply = client.push(_client_header(ready.worker, ["w", "b", "scale"], 1),
                            [tensor_bytes(GRADS[k]) for k in ("w", "b", "scale")])
        assert (reply.version, reply.staleness) == (2, 0)
    finally:
        client.close()

    # RESOURCE_EXHAUSTED -> TooLargeError
    store, worker = preinitialised_store()
    small = make_shard(store=store, max_request_bytes=MODEL_BYTES - 8)
    client = ShardClient(small.address, ClientOptions(timeout=RPC_TIMEOUT))
    try:
        with pytest.raises(errors.TooLargeError) as info:
            client.push(_client_header(worker, ["w", "b", "scale"], 0),
                        [tensor_bytes(GRADS[k]) for k in ("w", "b", "scale")])
        assert small.address in str(info.value) and "RESOURCE_EXHAUSTED" in str(info.value)
    finally:
        client.close()

    # A pull that cannot be served before its deadline -> UnavailableError or DeadlineError.
    empty = make_shard()
    client = ShardClient(empty.address, ClientOptions(timeout=SHORT_DEADLINE))
    try:
        with pytest.raises((errors.UnavailableError, errors.DeadlineError)) as info:
            client.pull(ps_pb2.PullRequest(), {}, 0)
        assert empty.address in str(info.value)
    finally:
        client.close()


def test_psclient_register_mismatch_is_a_precondition_error(ready):
    spec = [VariableSpec("w", (4, 3), FLOAT32), *SPEC[1:]]
    with PSClient([ready.shard.address], ClientOptions(timeout=RPC_TIMEOUT)) as client:
        with pytest.raises(errors.PreconditionError) as info:
            client.register(spec, SGD, worker_name="worker-1", job_fingerprint=JOB)
    message = str(info.value)
    assert ready.shard.address in message and "'w'" in message
    assert "[4, 2]" in message and "[4, 3]" in message


# -- concurrency and dropped streams ---------------------------------------------------------


def test_concurrent_pushes_lose_no_update_and_pulls_see_whole_pushes(ready):
    """Pushes from several workers at once, with pulls in between: every push is applied exactly
    once, and every pulled snapshot is the state after exactly ``version`` pushes (never half)."""
    pushers, per_pusher = 4, 10
    total = 1 + pushers * per_pusher
    state, states = dict(INITIAL), [raw(INITIAL)]  # states[v]: the bytes after v pushes
    for _ in range(total):
        state = sgd_step(state, GRADS)
        states.append(raw(state))
    workers = [register(ready.stub, f"pusher-{i}")[0] for i in range(pushers)]
    done = threading.Event()

    def push_many(worker: Worker) -> list[ps_pb2.PushResponse]:
        return [push(ready.stub, worker, GRADS, base_version=1) for _ in range(per_pusher)]

    def pull_until_done() -> int:
        seen = 0
        while not done.is_set() or seen == 0:
            pulled = pull(ready.stub)
            assert pulled.data == states[pulled.version]
            assert all(p.version == pulled.version for p in pulled.parts.values())
            seen += 1
        return seen

    with futures.ThreadPoolExecutor(max_workers=pushers + 2) as pool:
        pulls = [pool.submit(pull_until_done) for _ in range(2)]
        pushes = [pool.submit(push_many, w) for w in workers]
        try:
            replies = [r for f in pushes for r in f.result(timeout=RPC_TIMEOUT * 3)]
        finally:
            done.set()
        assert all(f.result(timeout=RPC_TIMEOUT * 3) > 0 for f in pulls)

    assert sorted(r.version for r in replies) == list(range(2, total + 1))
    assert all(r.staleness == r.version - 2 for r in replies)  # every push was based on version 1
    final = pull(ready.stub)
    assert (final.version, final.data) == (total, states[total])
    st = status(ready.stub)
    assert (st.pushes_applied, st.pushes_rejected, st.max_staleness) == (total, 0, total - 2)


def test_concurrent_initialize_applies_exactly_one_upload_whole(stub):
    first, _ = register(stub, "worker-0")
    second, _ = register(stub, "worker-1")
    other = {k: v + 16 for k, v in INITIAL.items()}
    with futures.ThreadPoolExecutor(max_workers=2) as pool:
        a = pool.submit(initialize, stub, first, INITIAL)
        b = pool.submit(initialize, stub, second, other)
        assert a.result(timeout=RPC_TIMEOUT).applied
        try:  # only the chosen initialiser uploads: the other is told so, or that it is done
            assert not b.result(timeout=RPC_TIMEOUT).applied
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "not chosen" in exc.details()
    assert pull(stub).data == raw(INITIAL)


@pytest.mark.parametrize("how", ["cancelled", "deadline"])
def test_dropped_push_stream_leaves_shard_unchanged(make_shard, open_stub, how):
    store = ObservedStore()
    shard = make_shard(store=store)
    stub = open_stub(shard.address)
    worker, _ = register(stub)
    assert initialize(stub, worker).applied
    before, before_status = pull(stub), status(stub)
    release = threading.Event()

    def partial_stream():
        # Everything but the last chunk, then the client goes quiet until the call is dropped.
        yield from stream(worker, GRADS, base_version=0)[:-1]
        release.wait(timeout=RPC_TIMEOUT)

    call = stub.Push.future(partial_stream(), timeout=RPC_TIMEOUT if how == "cancelled" else SHORT_DEADLINE)
    try:
        assert store.upload_started.wait(timeout=RPC_TIMEOUT)
        if how == "cancelled":
            assert call.cancel()
            with pytest.raises(grpc.FutureCancelledError):
                call.result(timeout=RPC_TIMEOUT)
        else:
            with pytest.raises(grpc.RpcError) as info:
                call.result(timeout=RPC_TIMEOUT)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        release.set()
    assert pull(stub).snapshot() == before.snapshot()
    assert status(stub).pushes_applied == before_status.pushes_applied
    reply = push(stub, worker, GRADS, base_version=0)
    assert (reply.version, reply.staleness) == (1, 0)
    assert pull(stub).data == raw(sgd_step(INITIAL, GRADS))


# -- exactly-once pushes and waiting pulls ------------------------------------------------


def test_retried_push_with_same_sequence_is_applied_once(ready):
    messages = stream(ready.worker, GRADS, base_version=1, sequence=2)
    first = ready.stub.Push(iter(messages), timeout=RPC_TIMEOUT)
    again = ready.stub.Push(iter(messages), timeout=RPC_TIMEOUT)  # e.g. the reply was lost
    assert (first.version, again.version) == (2, 2)
    assert status(ready.stub).pushes_applied == 2
    assert pull(ready.stub).data == raw(sgd_step(ready.values, GRADS))


def test_initialize_is_served_while_pulls_wait_for_it(make_shard, open_stub):
    # Waiting pulls are capped below the handler threads, so the Initialize that releases them
    # always finds a thread; a pull beyond the cap is refused at once as retryable.
    store = ObservedStore(max_waiting_pulls=1)
    stub = open_stub(make_shard(store=store, threads=2, max_concurrent_rpcs=8).address)
    worker, _ = register(stub)
    with futures.ThreadPoolExecutor(max_workers=2) as pool:
        waiting = [pool.submit(pull, stub, timeout=4.0) for _ in range(2)]
        assert store.wait_for_waiters(1, timeout=RPC_TIMEOUT)
        # Far shorter than the pulls' deadline: only served if the waiting pulls leave room.
        reply = stub.Initialize(iter(stream(worker, INITIAL)), timeout=2.0)
        assert reply.applied
        outcomes = []
        for pending in waiting:
            try:
                outcomes.append(pending.result(timeout=RPC_TIMEOUT).data == raw(INITIAL))
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and "already waiting" in exc.details()
                outcomes.append("refused")
    # The admitted pull gets the values; the other was refused or arrived after initialisation.
    assert outcomes.count(True) >= 1 and set(outcomes) <= {True, "refused"}
    assert pull(stub).data == raw(INITIAL)


# -- the single-message paths: PushInline, PullInline, PushPull --------------------------------


def inline_push(worker: Worker, tensors: Mapping[str, torch.Tensor], *, base_version: int, sequence: int = 0):
    head = header(worker, [PART[k].to_proto() for k in tensors], base_version=base_version, sequence=sequence).header
    return ps_pb2.InlinePush(header=head, data=list(raw(tensors).values()))


def test_inline_calls_match_the_streamed_ones(ready):
    streamed = pull(ready.stub)
    inline = ready.stub.PullInline(ps_pb2.PullRequest(), timeout=RPC_TIMEOUT)
    assert [Part.from_proto(p.spec).key for p in inline.header.parts] == list(streamed.data)
    assert list(inline.data) == list(streamed.data.values())

    reply = ready.stub.PushInline(inline_push(ready.worker, GRADS, base_version=1), timeout=RPC_TIMEOUT)
    assert (reply.version, reply.staleness) == (2, 0)
    assert pull(ready.stub).data == raw(sgd_step(ready.values, GRADS))


def test_push_pull_applies_once_and_returns_the_values_after_the_push(ready):
    call = ps_pb2.PushPullRequest(
        push=inline_push(ready.worker, GRADS, base_version=1, sequence=1),
        pull=ps_pb2.PullRequest(worker_id=ready.worker.worker_id, generation=ready.worker.generation,
                                session=ready.worker.session,
                                known_versions={"scale": 1}, clock=-1),
    )
    expected = raw(sgd_step(ready.values, GRADS))
    first = ready.stub.PushPull(call, timeout=RPC_TIMEOUT)
    again = ready.stub.PushPull(call, timeout=RPC_TIMEOUT)  # a retry: acknowledged, not re-applied
    for reply in (first, again):
        assert (reply.push.version, reply.pull.header.version) == (2, 2)
        included = [Part.from_proto(p.spec).key for p in reply.pull.header.parts if p.included]
        assert included == ["w", "b", "scale"] and list(reply.pull.data) == [expected[k] for k in included]
    assert (status(ready.stub).pushes_applied, pull(ready.stub).data) == (2, expected)


BAD_INLINE_PUSHES = {
    "a-tensor-missing": (lambda w: ps_pb2.InlinePush(
        header=inline_push(w, GRADS, base_version=1).header, data=list(raw(GRADS).values())[:2]), ("2 tensors for 3 parts",)),
    "short-bytes": (lambda w: ps_pb2.InlinePush(
        header=inline_push(w, GRADS, base_version=1).header, data=[b"\0" * 4, *list(raw(GRADS).values())[1:]]),
        ("byte length of 'w' is 4", "expected 32")),
    "nan": (lambda w: inline_push(w, {**GRADS, "b": torch.tensor([1.0, float("nan"), 0.0])}, base_version=1),
            ("'b'", "NaN")),
}


@pytest.mark.parametrize("case", list(BAD_INLINE_PUSHES))
def test_bad_inline_push_is_invalid_argument_and_changes_nothing(ready, case):
    build, needles = BAD_INLINE_PUSHES[case]
    before, before_status = pull(ready.stub), status(ready.stub)
    expect_rpc_error(lambda: ready.stub.PushInline(build(ready.worker), timeout=RPC_TIMEOUT),
                     grpc.StatusCode.INVALID_ARGUMENT, *needles)
    assert_unchanged_and_serving(ready, before, before_status, rejected=1)


@pytest.mark.parametrize("inline_bytes", [0, 1 << 20], ids=["streams", "single-messages"])
@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_compressed_wire_round_trips_and_the_shard_keeps_full_precision(shard, inline_bytes, wire):
    options = ClientOptions(timeout=RPC_TIMEOUT, connect_timeout=RPC_TIMEOUT, inline_bytes=inline_bytes, wire_dtype=wire)
    # Every value here is exact in both 16-bit formats, so compression loses nothing.
    with PSClient([shard.address], options) as client:
        client.wait_connected()
        client.register(SPEC, SGD, worker_name="worker-0", job_fingerprint=JOB, initial_values=INITIAL)
        dest = {k: torch.full_like(v, -1.0) for k, v in INITIAL.items()}
        client.pull(dest)
        assert raw(dest) == raw(INITIAL)
        (reply,) = client.push_pull(GRADS, dest)
        assert reply.version == 1
        assert raw(dest) == raw(sgd_step(INITIAL, GRADS))
        # A value 16 bits cannot hold: the shard keeps it exactly, the worker gets it rounded.
        # (The gradient is rounded on its way to the shard too.)
        third = {"scale": torch.tensor(1 / 3)}
        client.push_pull(third, dest)
        expected = sgd_step(sgd_step(INITIAL, GRADS), {"scale": third["scale"].to(wire).float()})
        assert dest["scale"].item() == expected["scale"].to(wire).item() != expected["scale"].item()
    channel = grpc.insecure_channel(shard.address)
    with channel:
        assert pull(ps_pb2_grpc.ParameterServerStub(channel)).data == raw(expected)


def test_compressed_pushes_must_use_a_16_bit_float_and_initial_values_go_uncompressed(ready):
    before, before_status = pull(ready.stub), status(ready.stub)
    bad = inline_push(ready.worker, GRADS, base_version=1)
    bad.header.wire_dtype = ps_pb2.INT8
    expect_rpc_error(lambda: ready.stub.PushInline(bad, timeout=RPC_TIMEOUT),
                     grpc.StatusCode.INVALID_ARGUMENT, "wire dtype must be float16 or bfloat16", "int8")
    assert_unchanged_and_serving(ready, before, before_status, rejected=1)
    init = stream(ready.worker, INITIAL)
    init[0].header.wire_dtype = ps_pb2.BFLOAT16
    expect_rpc_error(lambda: ready.stub.Initialize(iter(init), timeout=RPC_TIMEOUT),
                     grpc.StatusCode.INVALID_ARGUMENT, "not compressed")
