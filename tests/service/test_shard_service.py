"""Service tier: one real shard in-process on port 0 (``tests/service/shard_harness.py``): the
happy path, pulls that wait for initialisation, refused pushes, registrations and sizes.

Every refusal is checked four ways: the status code, a message that names the problem, the
shard's state afterwards (values bit for bit, versions, counters) and that it keeps serving.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psserver.store import Registration, ShardStore
from pswire import errors
from pswire.codec import Part
from pswire.dtypes import FLOAT32, FLOAT64
from pswire.optim import OptimizerConfig
from pswire.placement import VariableSpec, place
from pswire.v1 import ps_pb2
from pswire.wire import optimizer_to_proto
from psworker.client import ClientOptions, PSClient

from tests.service.shard_harness import (
    RPC_TIMEOUT, SHORT_DEADLINE, JOB, SGD, SPEC, PARTS, PART, DIGEST, MODEL_BYTES, INITIAL, GRADS, Worker,
    raw, sgd_step, register, header, chunks, stream, initialize, push, pull, status, workers_of,
    expect_rpc_error, Ready, assert_unchanged_and_serving, ObservedStore, nan_w, preinitialised_store,
)

pytestmark = pytest.mark.timeout(120)

# -- happy path ------------------------------------------------------------------------------


def test_register_initialize_pull_push_round_trip(shard, stub):
    w0, r0 = register(stub, "worker-0")
    assert (r0.must_initialize, r0.generation, r0.version) == (True, 1, 0)
    w1, r1 = register(stub, "worker-1")
    assert (r1.must_initialize, r1.generation) == (False, 1)
    assert w1.worker_id != w0.worker_id
    # The same name again, by its own session, is the same worker in a new generation; it is still
    # the initialiser.
    w0b, r0b = register(stub, "worker-0", session=w0.session)
    assert (w0b.worker_id, w0b.generation, r0b.must_initialize) == (w0.worker_id, 2, True)
    assert status(stub).state == "initializing"

    init = initialize(stub, w0b)
    assert (init.applied, init.version) == (True, 0)

    first = pull(stub)
    assert first.version == 0
    assert first.data == raw(INITIAL)
    assert list(first.data) == [p.key for p in PARTS]
    assert all(p.version == 0 and p.included for p in first.parts.values())

    # worker-1 pushes from version 0: applied exactly, version 1, staleness 0.
    r = push(stub, w1, GRADS, base_version=0)
    assert (r.version, r.staleness) == (1, 0)
    after_one = sgd_step(INITIAL, GRADS)
    assert pull(stub).data == raw(after_one)
    assert pull(stub).tensor("scale").item() == 2.75  # 3 - 0.5 * 0.5, spelled out once

    # worker-0 pushes from version 0 too: one update behind.
    r = push(stub, w0b, GRADS, base_version=0)
    assert (r.version, r.staleness) == (2, 1)
    after_two = sgd_step(after_one, GRADS)

    # A push of one variable bumps only that part's version.
    r = push(stub, w1, {"b": GRADS["b"]}, base_version=2)
    assert (r.version, r.staleness) == (3, 0)
    after_three = sgd_step(after_two, {"b": GRADS["b"]})
    full = pull(stub)
    assert full.version == 3
    assert full.data == raw(after_three)
    assert {k: p.version for k, p in full.parts.items()} == {"w": 2, "b": 3, "scale": 2}

    # Known versions skip unchanged parts; a stale or unknown key does not.
    partial = pull(stub, {"w": 2, "b": 2, "scale": 2, "nope": 7})
    assert {k: p.included for k, p in partial.parts.items()} == {"w": False, "b": True, "scale": False}
    assert partial.data == {"b": raw(after_three)["b"]}
    assert partial.parts["w"].version == 2 and partial.version == 3

    st = status(stub)
    assert st.address == shard.address
    assert (st.state, st.version, st.shard_index, st.num_shards) == ("ready", 3, 0, 1)
    assert (st.num_variables, st.bytes_held) == (3, MODEL_BYTES)
    assert (st.pushes_received, st.pushes_applied, st.pushes_rejected, st.max_staleness) == (3, 3, 0, 1)
    assert st.pulls_served == 5
    assert st.optimizer == optimizer_to_proto(SGD)
    assert [Part.from_proto(p) for p in st.parts] == list(PARTS)
    assert (st.job_fingerprint, st.placement_digest) == (JOB, DIGEST)
    assert workers_of(st) == [(w0.worker_id, "worker-0", 2, 1), (w1.worker_id, "worker-1", 1, 2)]
    assert all(w.last_seen_unix > 0 for w in st.workers)
    assert st.uptime_seconds >= 0


def test_health_service_reports_serving(shard):
    with grpc.insecure_channel(shard.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pswire.v1.ParameterServer"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("inline_bytes", [0, 1 << 20], ids=["streams", "single-messages"])
def test_psclient_happy_path(shard, inline_bytes):
    options = ClientOptions(timeout=RPC_TIMEOUT, connect_timeout=RPC_TIMEOUT, inline_bytes=inline_bytes)
    with PSClient([shard.address], options) as first, PSClient([shard.address], options) as second:
        first.wait_connected()
        assert first.register(SPEC, SGD, worker_name="worker-0", job_fingerprint=JOB,
                              initial_values=INITIAL) is True
        assert second.register(SPEC, SGD, worker_name="worker-1", job_fingerprint=JOB) is False

        dest = {k: torch.full_like(v, -1.0) for k, v in INITIAL.items()}
        assert first.pull(dest) == [0]
        assert raw(dest) == raw(INITIAL)

        (reply,) = first.push(GRADS)
        assert (reply.version, reply.staleness) == (1, 0)
        (reply,) = second.push(GRADS)  # second never pulled: its base is version 0
        assert (reply.version, reply.staleness) == (2, 1)

        assert first.pull(dest) == [2]
        assert raw(dest) == raw(sgd_step(sgd_step(INITIAL, GRADS), GRADS))

        # A training step's push and pull together: one call per shard when both fit inline.
        (reply,) = first.push_pull(GRADS, dest)
        assert (reply.version, reply.staleness) == (3, 0)
        assert raw(dest) == raw(sgd_step(sgd_step(sgd_step(INITIAL, GRADS), GRADS), GRADS))
        (st,) = first.status()
        assert (st.version, st.pushes_applied, st.max_staleness) == (3, 3, 1)


@pytest.mark.parametrize("bulk", [False, True], ids=["grpc-streams", "bulk-lanes"])
def test_large_parts_move_in_chunks_and_split_across_two_shards(make_shard, open_stub, bulk):
    """Two shards, a variable split by rows, both directions: through gRPC in chunks far smaller
    than a part, or on the bulk lanes."""
    spec = [VariableSpec("emb", (256, 512), FLOAT32), VariableSpec("bias", (8,), FLOAT32)]
    placement = place(spec, 2)
    assert len(placement.parts_of("emb")) == 2
    shards = [make_shard(chunk_bytes=4096) for _ in range(2)]
    initial = {
        "emb": (torch.arange(256 * 512, dtype=torch.float32) % 64).reshape(256, 512) / 4,
        "bias": torch.arange(8, dtype=torch.float32),
    }
    grads = {"emb": torch.full((256, 512), 0.25).contiguous(), "bias": torch.full((8,), -2.0)}
    # Small calls stay on gRPC here (no lane calls): a lane opens only for bytes above the inline limit.
    options = ClientOptions(timeout=RPC_TIMEOUT, connect_timeout=RPC_TIMEOUT, chunk_bytes=4096, bulk=bulk,
                            lane_calls=False)
    with PSClient([s.address for s in shards], options) as client:
        client.wait_connected()
        assert client.register(spec, SGD, worker_name="worker-0", initial_values=initial)
        dest = {k: torch.zeros_like(v) for k, v in initial.items()}
        assert client.pull(dest) == [0, 0]
        assert raw(dest) == raw(initial)
        assert all(r is not None and r.version == 1 for r in client.push(grads))
        assert client.pull(dest) == [1, 1]
        assert raw(dest) == raw(sgd_step(initial, grads))
        # Lanes carry what is above the inline limit (256 KiB): one shard holds exactly that.
        inline = ClientOptions().inline_bytes
        assert [s.lanes.open_lanes > 0 for s in shards] == [bulk and n > inline for n in placement.shard_bytes()]
        assert any(n > inline for n in placement.shard_bytes())
    for index, s in enumerate(shards):
        st = status(open_stub(s.address))
        assert [Part.from_proto(p) for p in st.parts] == list(placement.shards[index])
        assert st.bytes_held == placement.shard_bytes()[index]


# -- pulls and initialisation ----------------------------------------------------------------


def test_pull_before_initialisation_waits_then_succeeds(make_shard, open_stub):
    store = ObservedStore()
    stub = open_stub(make_shard(store=store).address)
    worker, reply = register(stub)
    assert reply.must_initialize
    with futures.ThreadPoolExecutor(max_workers=2) as pool:
        pending = pool.submit(pull, stub, timeout=RPC_TIMEOUT * 3)
        assert store.pull_waiting.wait(timeout=RPC_TIMEOUT)
        assert not pending.done()  # cannot finish: nothing is initialised yet
        init = pool.submit(initialize, stub, worker)
        assert init.result(timeout=RPC_TIMEOUT).applied
        pulled = pending.result(timeout=RPC_TIMEOUT * 3)
    assert pulled.version == 0
    assert pulled.data == raw(INITIAL)


@pytest.mark.parametrize("registered", [False, True], ids=["no-job", "registered"])
def test_pull_with_short_deadline_on_uninitialised_shard_fails_clearly(stub, registered):
    if registered:
        worker, _ = register(stub)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        pull(stub, timeout=SHORT_DEADLINE)
    assert time.monotonic() - started < RPC_TIMEOUT
    err = info.value
    assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), err.details()
    if err.code() is grpc.StatusCode.UNAVAILABLE:
        assert "not initialised" in err.details()
        if registered:
            assert f"worker id {worker.worker_id}" in err.details()
    assert status(stub).state == ("initializing" if registered else "empty")


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"w": torch.tensor([[0.0, float("nan")], [0, 0], [0, 0], [0, 0]])}, "'w'"),
        ({"scale": torch.tensor(float("inf"))}, "'scale'"),
        ({"b": torch.tensor([0.0, float("-inf"), 0.0])}, "'b'"),
    ],
    ids=["nan", "inf", "-inf"],
)
def test_initialize_refuses_non_finite_values_and_stays_not_ready(stub, bad, needle):
    worker, _ = register(stub)
    values = {**INITIAL, **bad}
    expect_rpc_error(lambda: initialize(stub, worker, values), grpc.StatusCode.INVALID_ARGUMENT,
                     "initial value", needle, "NaN or Inf")
    st = status(stub)
    assert (st.state, st.version) == ("initializing", 0)
    with pytest.raises(grpc.RpcError) as info:
        pull(stub, timeout=SHORT_DEADLINE)
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    # The refusal did not cost the worker its turn: a valid upload then succeeds.
    assert initialize(stub, worker).applied
    assert pull(stub).data == raw(INITIAL)


def test_second_initialize_is_ignored(ready):
    before, before_status = pull(ready.stub), status(ready.stub)
    other, reply = register(ready.stub, "worker-1")
    assert not reply.must_initialize
    zeros = {k: torch.zeros_like(v) for k, v in INITIAL.items()}
    for worker in (ready.worker, other):
        reply = initialize(ready.stub, worker, zeros)
        assert (reply.applied, reply.version) == (False, 1)
    assert pull(ready.stub).snapshot() == before.snapshot()
    assert before.data == raw(ready.values)
    assert status(ready.stub).version == before_status.version


@pytest.mark.parametrize(
    "keys", [["w", "b"], ["b", "w", "scale"], []], ids=["subset", "reordered", "none"]
)
def test_initialize_must_list_every_part_in_order(stub, keys):
    worker, _ = register(stub)
    specs = [PART[k].to_proto() for k in keys]
    messages = [header(worker, specs), *chunks([INITIAL[k] for k in keys])]
    err = expect_rpc_error(lambda: stub.Initialize(iter(messages), timeout=RPC_TIMEOUT),
                           grpc.StatusCode.INVALID_ARGUMENT)
    assert "every variable" in err.details() or "no variables" in err.details()
    assert status(stub).state == "initializing"
    assert initialize(stub, worker).applied


def test_initialize_by_unknown_worker_or_without_job_is_refused(stub):
    stranger = Worker(worker_id=42, generation=1)
    expect_rpc_error(lambda: initialize(stub, stranger), grpc.StatusCode.FAILED_PRECONDITION, "register")
    worker, _ = register(stub)
    expect_rpc_error(lambda: initialize(stub, stranger), grpc.StatusCode.ABORTED,
                     "worker id 42", "register")
    assert status(stub).state == "initializing"
    assert initialize(stub, worker).applied


# -- bad pushes ------------------------------------------------------------------------------

W_SPEC = PART["w"].to_proto()
W_CHUNKS = chunks([GRADS["w"]])  # 32 bytes in 4 chunks of 8


def _spec(
    name: str, shape: Sequence[int], dtype: int = ps_pb2.FLOAT32, rows: tuple[int, int] | None = None
) -> ps_pb2.PartSpec:
    start, end = rows if rows is not None else (0, shape[0] if shape else 1)
    return ps_pb2.PartSpec(name=name, full_shape=list(shape), dtype=dtype, row_start=start, row_end=end)


def _chunk(part_index: int, offset: int, data: bytes) -> ps_pb2.TensorMessage:
    return ps_pb2.TensorMessage(chunk=ps_pb2.TensorChunk(part_index=part_index, offset=offset, data=data))


def _with(**grads: torch.Tensor) -> dict[str, torch.Tensor]:
    return {**GRADS, **grads}


# Each case builds a push stream from (worker, shard version); the message must contain every needle.
BAD_PUSHES: dict[str, tuple[Callable[[Worker, int], list], tuple[str, ...]]] = {
    "unknown-variable": (
        lambda w, v: [header(w, [_spec("nope", [2])], base_version=v), _chunk(0, 0, bytes(8))],
        ("unknown variable", "'nope'"),
    ),
    "unknown-row-range": (
        lambda w, v: [header(w, [_spec("w", [4, 2], rows=(0, 2))], base_version=v), _chunk(0, 0, bytes(16))],
        ("unknown variable", "'w[0:2]'", "holds w"),
    ),
    "wrong-dtype": (
        lambda w, v: [header(w, [_spec("w", [4, 2], ps_pb2.FLOAT64)], base_version=v),
                      *chunks([GRADS["w"].double()])],
        ("'w'", "float32", "float64"),
    ),
    "unspecified-dtype": (
        lambda w, v: [header(w, [_spec("w", [4, 2], ps_pb2.DTYPE_UNSPECIFIED)], base_version=v), *W_CHUNKS],
        ("unknown wire dtype",),
    ),
    "wrong-shape": (
        lambda w, v: [header(w, [_spec("w", [4, 3])], base_version=v), *chunks([torch.zeros(4, 3)])],
        ("'w'", "[4, 2]", "[4, 3]"),
    ),
    "negative-dimension": (
        lambda w, v: [header(w, [_spec("w", [4, -2], rows=(0, 4))], base_version=v), *W_CHUNKS],
        ("'w'", "negative"),
    ),
    "too-short-missing-chunk": (
        lambda w, v: [header(w, [W_SPEC], base_version=v), *W_CHUNKS[:-1]],
        ("byte length", "'w'", "24", "32"),
    ),
    "too-short-no-chunks": (
        lambda w, v: [header(w, [W_SPEC], base_version=v)],
        ("byte length", "'w'", "is 0", "32"),
    ),
    "too-long-extra-chunk": (
        lambda w, v: [header(w, [W_SPEC], base_version=v), *W_CHUNKS, _chunk(0, 32, bytes(4))],
        ("'w'", "exceeds 32 bytes"),
    ),
    "too-long-oversized-chunk": (
        lambda w, v: [header(w, [W_SPEC], base_version=v), _chunk(0, 0, bytes(33))],
        ("'w'", "exceeds 32 bytes"),
    ),
    "out-of-order-offset": (
        lambda w, v: [header(w, [W_SPEC], base_version=v), W_CHUNKS[1], W_CHUNKS[0], *W_CHUNKS[2:]],
        ("'w'", "at byte 8", "expected byte 0"),
    ),
    "gap-in-offsets": (
        lambda w, v: [header(w, [W_SPEC], base_version=v), W_CHUNKS[0], *W_CHUNKS[2:]],
        ("'w'", "at byte 16", "expected byte 8"),
    ),
    "part-index-out-of-range": (
        lambda w, v: [header(w, [W_SPEC], base_version=v), *W_CHUNKS, _chunk(1, 0, bytes(4))],
        ("part 1", "lists 1 parts"),
    ),
    "negative-part-index": (
        lambda w, v: [header(w, [W_SPEC], base_version=v), _chunk(-1, 0, bytes(8))],
        ("part -1",),
    ),
    "nan-gradient": (lambda w, v: stream(w, {"w": nan_w()}, base_version=v), ("'w'", "NaN")),
    "inf-gradient": (lambda w, v: stream(w, {"scale": torch.tensor(float("inf"))}, base_version=v), ("'scale'", "Inf")),
    "nan-in-second-part-only": (
        lambda w, v: stream(w, _with(b=torch.tensor([1.0, float("nan"), 1.0])), base_version=v),
        ("'b'", "NaN"),
    ),
    "second-part-truncated": (
        lambda w, v: stream(w, GRADS, base_version=v)[:-1],  # w and b complete, scale missing
        ("byte length", "'scale' is 0", "expected 4"),
    ),
    "no-header": (lambda w, v: W_CHUNKS, ("must start with a header",)),
    "empty-stream": (lambda w, v: [], ("must start with a header",)),
    "empty-header": (lambda w, v: [header(w, [], base_version=v)], ("no variables",)),
    "second-header": (
        lambda w, v: [header(w, [W_SPEC], base_version=v), W_CHUNKS[0], header(w, [W_SPEC], base_version=v)],
        ("only chunks may follow the header",),
    ),
    "part-listed-twice": (
        lambda w, v: [header(w, [W_SPEC, W_SPEC], base_version=v), *chunks([GRADS["w"], GRADS["w"]])],
        ("'w'", "listed twice"),
    ),
    "base-version-from-future": (
        lambda w, v: stream(w, GRADS, base_version=v + 1),
        ("base version 2", "now 1"),
    ),
    "negative-base-version": (lambda w, v: stream(w, GRADS, base_version=-1), ("base version -1",)),
}


@pytest.mark.parametrize("case", list(BAD_PUSHES))
def test_bad_push_is_invalid_argument_and_changes_nothing(ready, case):
    build, needles = BAD_PUSHES[case]
    before, before_status = pull(ready.stub), status(ready.stub)
    assert (before.version, before.data) == (1, raw(ready.values))
    messages = build(ready.worker, before.version)
    expect_rpc_error(lambda: ready.stub.Push(iter(messages), timeout=RPC_TIMEOUT),
                     grpc.StatusCode.INVALID_ARGUMENT, *needles)
    assert_unchanged_and_serving(ready, before, before_status, rejected=1)


def test_push_by_unregistered_worker_is_refused(ready):
    before, before_status = pull(ready.stub), status(ready.stub)
    stranger = Worker(worker_id=999, generation=1)
    expect_rpc_error(lambda: push(ready.stub, stranger, GRADS, base_version=1),
                     grpc.StatusCode.ABORTED, "worker id 999", "not registered", "register")
    assert_unchanged_and_serving(ready, before, before_status, rejected=1)


def test_push_by_stale_generation_is_refused(ready):
    old, _ = register(ready.stub, "worker-1")
    new, _ = register(ready.stub, "worker-1", session=old.session)
    assert (new.worker_id, new.generation) == (old.worker_id, old.generation + 1)
    before, before_status = pull(ready.stub), status(ready.stub)
    expect_rpc_error(lambda: push(ready.stub, old, GRADS, base_version=1),
                     grpc.StatusCode.ABORTED,
                     "'worker-1'", f"generation {old.generation}", f"generation is {new.generation}", "re-register")
    assert_unchanged_and_serving(ready, before, before_status, rejected=1)
    assert push(ready.stub, new, GRADS, base_version=2).version == 3


def test_push_before_initialisation_is_unavailable(stub):
    worker, _ = register(stub)
    expect_rpc_error(lambda: push(stub, worker, GRADS, base_version=0),
                     grpc.StatusCode.UNAVAILABLE, "not initialised")
    st = status(stub)
    assert (st.state, st.version, st.pushes_applied, st.pushes_rejected) == ("initializing", 0, 0, 1)
    assert initialize(stub, worker).applied
    assert pull(stub).data == raw(INITIAL)


# -- registration ----------------------------------------------------------------------------


def _parts_with(**changes: Part) -> list[ps_pb2.PartSpec]:
    return [changes.get(p.key, p).to_proto() for p in PARTS]


REGISTER_MISMATCHES: dict[str, tuple[dict, tuple[str, ...]]] = {
    "shape": (
        {"parts": _parts_with(w=Part("w", (4, 3), FLOAT32, 0, 4))},
        ("'w'", "[4, 2]", "[4, 3]"),
    ),
    "dtype": (
        {"parts": _parts_with(w=Part("w", (4, 2), FLOAT64, 0, 4))},
        ("'w'", "float32[4, 2]", "float64[4, 2]"),
    ),
    "missing-variable": ({"parts": [p.to_proto() for p in PARTS[:2]]}, ("lacks", "scale")),
    "extra-variable": (
        {"parts": [*(p.to_proto() for p in PARTS), Part("extra", (2,), FLOAT32, 0, 2).to_proto()]},
        ("'extra'", "not in the job"),
    ),
    "optimizer-lr": ({"optimizer": optimizer_to_proto(OptimizerConfig(name="sgd", lr=0.25))}, ("lr", "0.5", "0.25")),
    "optimizer-momentum": (
        {"optimizer": optimizer_to_proto(OptimizerConfig(name="sgd", lr=0.5, momentum=0.9))},
        ("momentum", "0.0", "0.9"),
    ),
    "optimizer-name": (
        {"optimizer": optimizer_to_proto(OptimizerConfig(name="adam", lr=0.5))},
        ("name", "'sgd'", "'adam'"),
    ),
    "shard-index": ({"shard_index": 1, "num_shards": 2}, ("shard 0 of 1", "shard 1 of 2")),
    "num-shards": ({"shard_index": 0, "num_shards": 3}, ("shard 0 of 1", "shard 0 of 3")),
    "placement-digest": ({"placement_digest": "0" * 32}, ("placement",)),
    "job-fingerprint": ({"job_fingerprint": "job-b"}, ("'job-b'", "'job-a'")),
}

MALFORMED_REGISTERS: dict[str, tuple[dict, tuple[str, ...]]] = {
    "empty-worker-name": ({"worker_name": ""}, ("worker_name",)),
    "shard-index-past-end": ({"shard_index": 2, "num_shards": 2}, ("shard index 2 of 2",)),
    "negative-shard-index": ({"shard_index": -1}, ("shard index -1",)),
    "zero-shards": ({"num_shards": 0}, ("0 shards",)),
    "no-parts": ({"parts": []}, ("no variables",)),
    "part-twice": ({"parts": [p.to_proto() for p in (*PARTS, PARTS[0])]}, ("twice",)),
    "bad-rows": ({"parts": _parts_with(w=Part("w", (4, 2), FLOAT32, 0, 9))}, ("'w'", "rows")),
    "bad-optimizer-lr": ({"optimizer": ps_pb2.OptimizerSettings(name="sgd", lr=0.0, eps=1e-8)}, ("learning rate",)),
    "unknown-optimizer": ({"optimizer": ps_pb2.OptimizerSettings(name="lamb", lr=0.1, eps=1e-8)}, ("'lamb'",)),
}


@pytest.mark.parametrize(
    "case, code",
    [(c, grpc.StatusCode.FAILED_PRECONDITION) for c in REGISTER_MISMATCHES]
    + [(c, grpc.StatusCode.INVALID_ARGUMENT) for c in MALFORMED_REGISTERS],
)
def test_refused_register_leaves_the_job_unchanged(ready, case, code):
    overrides, needles = {**REGISTER_MISMATCHES, **MALFORMED_REGISTERS}[case]
    before, before_status = pull(ready.stub), status(ready.stub)
    fields = dict(overrides)
    # By default the registered worker's own name: a refused register must not cost it its generation.
    name = fields.pop("worker_name", "worker-0")
    expect_rpc_error(lambda: register(ready.stub, name, **fields), code, *needles)
    st = status(ready.stub)
    assert list(st.parts) == list(before_status.parts)
    assert st.optimizer == before_status.optimizer
    assert (st.shard_index, st.num_shards) == (before_status.shard_index, before_status.num_shards)
    assert (st.placement_digest, st.job_fingerprint) == (DIGEST, JOB)
    assert workers_of(st) == workers_of(before_status)
    assert_unchanged_and_serving(ready, before, before_status, rejected=0)


def test_a_shard_given_no_variables_of_a_packed_model_serves_at_once(stub):
    """A model small enough to live whole on shard 0 (``pswire.placement.PACK_BELOW``) leaves the
    other shards none: such a shard is ready at registration, nobody uploads to it, a pull reads
    nothing and a push naming no variables is refused as before."""
    worker, reply = register(stub, shard_index=1, num_shards=2, parts=[])
    assert not reply.must_initialize
    st = status(stub)
    assert (st.state, list(st.parts), st.shard_index, st.num_shards) == ("ready", [], 1, 2)
    assert pull(stub).data == {}
    expect_rpc_error(lambda: stub.Push(iter([header(worker, [])]), timeout=RPC_TIMEOUT),
                     grpc.StatusCode.INVALID_ARGUMENT, "no variables")
    _, again = register(stub, "worker-1", shard_index=1, num_shards=2, parts=[])
    assert not again.must_initialize
    # A variable the job does not put here is still refused.
    expect_rpc_error(lambda: register(stub, "worker-2", shard_index=1, num_shards=2),
                     grpc.StatusCode.FAILED_PRECONDITION, "not in the job")
    assert status(stub).state == "ready"


def test_a_shard_holding_no_variables_checkpoints_and_restores():
    store = ShardStore()
    reg = Registration(worker_name="worker-0", shard_index=1, num_shards=2, placement_digest=DIGEST, parts=(),
                       optimizer=SGD, job_fingerprint=JOB)
    assert not store.register(reg).must_initialize
    _, tensors, metadata = store.export()
    restored = ShardStore()
    restored.restore(tensors, metadata, source="test")
    assert restored.register(reg).must_initialize is False
    version, _, _ = restored.export()
    assert version == 0
    # The only shard of a job must hold something.
    with pytest.raises(errors.InvalidArgumentError, match="no variables"):
        ShardStore().register(Registration(worker_name="w", shard_index=0, num_shards=1, placement_digest=DIGEST,
                                           parts=(), optimizer=SGD, job_fingerprint=JOB))


def test_mismatching_register_before_initialisation_keeps_the_first_job(stub):
    worker, _ = register(stub)
    expect_rpc_error(lambda: register(stub, "worker-1", job_fingerprint="job-b"),
                     grpc.StatusCode.FAILED_PRECONDITION, "'job-b'")
    st = status(stub)
    assert (st.state, st.job_fingerprint) == ("initializing", JOB)
    assert workers_of(st) == [(worker.worker_id, "worker-0", 1, 0)]
    _, reply = register(stub, "worker-1")
    assert not reply.must_initialize
    assert initialize(stub, worker).applied


# -- size limits -----------------------------------------------------------------------------


def test_initialize_above_max_request_bytes_is_resource_exhausted(make_shard, open_stub):
    stub = open_stub(make_shard(max_request_bytes=MODEL_BYTES - 8).address)
    worker, _ = register(stub)
    expect_rpc_error(lambda: initialize(stub, worker), grpc.StatusCode.RESOURCE_EXHAUSTED,
                     str(MODEL_BYTES), str(MODEL_BYTES - 8))
    assert status(stub).state == "initializing"


@pytest.mark.parametrize("send_chunks", [True, False], ids=["with-chunks", "header-only"])
def test_push_above_max_request_bytes_is_resource_exhausted(make_shard, open_stub, send_chunks):
    store, worker = preinitialised_store()
    shard = make_shard(store=store, max_request_bytes=MODEL_BYTES - 8)
    job = Ready(shard, open_stub(shard.address), worker, dict(INITIAL))
    before, before_status = pull(job.stub), status(job.stub)
    messages = stream(worker, GRADS, base_version=0)
    messages = messages if send_chunks else messages[:1]  # refused before any bytes are read
    expect_rpc_error(lambda: job.stub.Push(iter(messages), timeout=RPC_TIMEOUT),
                     grpc.StatusCode.RESOURCE_EXHAUSTED, str(MODEL_BYTES), str(MODEL_BYTES - 8))
    assert pull(job.stub).snapshot() == before.snapshot()
    st = status(job.stub)
    assert (st.version, st.pushes_applied, st.pushes_rejected) == (0, 0, 1)
    # A push within the limit (w alone: 32 bytes) is applied.
    assert push(job.stub, worker, {"w": GRADS["w"]}, base_version=0).version == 1
    assert pull(job.stub).data == raw(sgd_step(INITIAL, {"w": GRADS["w"]}))
