"""The service tier's harness: one real shard in-process on port 0, driven through raw gRPC (to
craft malformed requests) and through ``ShardClient`` / ``PSClient``; its model, requests,
fixtures and the checks that a refusal changed nothing (``assert_unchanged_and_serving``).

Values are chosen so that float32 arithmetic is exact (lr = 0.5, power-of-two gradients), so
expected results are compared with ``==``, never with a tolerance.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc
import pytest
import torch

from psserver.config import ServerConfig
from psserver.server import Shard, create_server
from psserver.store import Registration, ShardStore
from pswire.codec import Part, iter_chunks
from pswire.dtypes import FLOAT32
from pswire.optim import OptimizerConfig
from pswire.placement import VariableSpec, place
from pswire.v1 import ps_pb2, ps_pb2_grpc
from pswire.wire import optimizer_to_proto
from psworker.tensors import tensor_bytes, torch_dtype

RPC_TIMEOUT = 10.0
"""Deadline of every RPC these tests make (seconds); generous, never reached when things work."""
SHORT_DEADLINE = 0.5
"""Deadline of the calls that are expected to wait and give up."""
JOB = "job-a"
SGD = OptimizerConfig(name="sgd", lr=0.5)

SPEC = [
    VariableSpec("w", (4, 2), FLOAT32),
    VariableSpec("b", (3,), FLOAT32),
    VariableSpec("scale", (), FLOAT32),
]
PLACEMENT = place(SPEC, 1)
PARTS: tuple[Part, ...] = PLACEMENT.shards[0]
PART = {p.key: p for p in PARTS}
DIGEST = PLACEMENT.digest()
MODEL_BYTES = 32 + 12 + 4

# Multiples of 1/4 and power-of-two gradients: x - 0.5 * g is exact in float32.
INITIAL = {
    "w": torch.arange(8, dtype=torch.float32).reshape(4, 2) / 4,
    "b": torch.tensor([1.0, -2.0, 0.5]),
    "scale": torch.tensor(3.0),
}
GRADS = {
    "w": torch.tensor([[1.0, 2.0], [4.0, 0.5], [0.25, -1.0], [-8.0, 0.0]]),
    "b": torch.tensor([2.0, -4.0, 1.0]),
    "scale": torch.tensor(0.5),
}
CHUNK = 8
"""Chunk size of the raw streams: several chunks per part, so order and gaps matter."""


# -- helpers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Worker:
    worker_id: int
    generation: int
    session: bytes = b""


@dataclass
class Pulled:
    version: int
    parts: dict[str, ps_pb2.PulledPart]
    data: dict[str, bytes]
    """Raw bytes of every included part, by key."""

    def tensor(self, key: str) -> torch.Tensor:
        part = Part.from_proto(self.parts[key].spec)
        return torch.frombuffer(bytearray(self.data[key]), dtype=torch_dtype(part.dtype)).reshape(part.shape)

    def snapshot(self) -> tuple[int, dict[str, tuple[int, bytes]]]:
        return self.version, {k: (self.parts[k].version, self.data[k]) for k in self.data}


def raw(values: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: bytes(tensor_bytes(v.contiguous())) for k, v in values.items()}


def sgd_step(values: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v - SGD.lr * grads[k] if k in grads else v for k, v in values.items()}


def register_request(name: str = "worker-0", **overrides) -> ps_pb2.RegisterRequest:
    fields = dict(
        worker_name=name, shard_index=0, num_shards=1, placement_digest=DIGEST,
        parts=[p.to_proto() for p in PARTS], optimizer=optimizer_to_proto(SGD), job_fingerprint=JOB,
    )
    fields.update(overrides)
    return ps_pb2.RegisterRequest(**fields)


def register(stub, name: str = "worker-0", **overrides) -> tuple[Worker, ps_pb2.RegisterResponse]:
    reply = stub.Register(register_request(name, **overrides), timeout=RPC_TIMEOUT)
    return Worker(reply.worker_id, reply.generation, reply.session), reply


def header(
    worker: Worker, specs: Sequence[ps_pb2.PartSpec], *, base_version: int = 0, sequence: int = 0
) -> ps_pb2.TensorMessage:
    return ps_pb2.TensorMessage(header=ps_pb2.TensorHeader(
        worker_id=worker.worker_id, generation=worker.generation, sequence=sequence, session=worker.session,
        base_version=base_version, parts=list(specs),
    ))


def chunks(tensors: Sequence[torch.Tensor], chunk_bytes: int = CHUNK) -> list[ps_pb2.TensorMessage]:
    return [
        ps_pb2.TensorMessage(chunk=c)
        for c in iter_chunks([tensor_bytes(t.contiguous()) for t in tensors], chunk_bytes)
    ]


def stream(
    worker: Worker, tensors: Mapping[str, torch.Tensor], *, base_version: int = 0, sequence: int = 0
) -> list[ps_pb2.TensorMessage]:
    """A well-formed Initialize/Push stream of ``tensors`` (part key -> value)."""
    specs = [PART[k].to_proto() for k in tensors]
    return [header(worker, specs, base_version=base_version, sequence=sequence), *chunks(list(tensors.values()))]


def initialize(stub, worker: Worker, values: Mapping[str, torch.Tensor] = INITIAL) -> ps_pb2.InitializeResponse:
    return stub.Initialize(iter(stream(worker, values)), timeout=RPC_TIMEOUT)


def push(stub, worker: Worker, grads: Mapping[str, torch.Tensor], base_version: int) -> ps_pb2.PushResponse:
    return stub.Push(iter(stream(worker, grads, base_version=base_version)), timeout=RPC_TIMEOUT)


def pull(stub, known: Mapping[str, int] | None = None, *, timeout: float = RPC_TIMEOUT) -> Pulled:
    """A raw pull, reassembled here (checking order and completeness) rather than by the codec."""
    replies = stub.Pull(ps_pb2.PullRequest(known_versions=dict(known or {})), timeout=timeout)
    first = next(replies)
    assert first.WhichOneof("kind") == "header"
    keys = [Part.from_proto(p.spec).key for p in first.header.parts]
    parts = dict(zip(keys, first.header.parts))
    data: dict[str, bytearray] = {k: bytearray() for k, p in parts.items() if p.included}
    for message in replies:
        assert message.WhichOneof("kind") == "chunk"
        key = keys[message.chunk.part_index]
        assert key in data, f"chunk sent for skipped part {key}"
        assert message.chunk.offset == len(data[key])
        data[key] += message.chunk.data
    for key, buf in data.items():
        assert len(buf) == Part.from_proto(parts[key].spec).nbytes
    return Pulled(first.header.version, parts, {k: bytes(v) for k, v in data.items()})


def status(stub) -> ps_pb2.StatusResponse:
    return stub.Status(ps_pb2.StatusRequest(), timeout=RPC_TIMEOUT)


def workers_of(st: ps_pb2.StatusResponse) -> list[tuple[int, str, int, int]]:
    return sorted((w.worker_id, w.worker_name, w.generation, w.pushes) for w in st.workers)


def expect_rpc_error(call: Callable[[], object], code: grpc.StatusCode, *needles: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    assert err.code() == code, f"{err.code()}: {err.details()}"
    for needle in needles:
        assert needle in err.details(), f"{needle!r} not in {err.details()!r}"
    return err


# -- fixtures --------------------------------------------------------------------------------


@contextlib.contextmanager
def started_shards(**defaults):
    """A factory of in-process shards on port 0 (``defaults`` are config fields every one gets);
    every one is stopped on exit."""
    started = []

    def make(*, store: ShardStore | None = None, failpoint=None, **config) -> Shard:
        shard = create_server(ServerConfig(port=0, **{**defaults, **config}), store=store, failpoint=failpoint)
        started.append(shard)
        return shard

    try:
        yield make
    finally:
        for shard in started:
            shard.stop(grace=0)


@pytest.fixture
def make_shard():
    """A factory of in-process shards on port 0; every one is stopped after the test."""
    with started_shards() as make:
        yield make


@pytest.fixture
def open_stub():
    channels = []

    def open_(address: str) -> ps_pb2_grpc.ParameterServerStub:
        channel = grpc.insecure_channel(address)
        channels.append(channel)
        return ps_pb2_grpc.ParameterServerStub(channel)

    yield open_
    for channel in channels:
        channel.close()


@pytest.fixture
def shard(make_shard):
    return make_shard()


@pytest.fixture
def stub(shard, open_stub):
    return open_stub(shard.address)


@dataclass
class Ready:
    """A shard that is registered, initialised and has applied one push (version 1)."""

    shard: Shard
    stub: ps_pb2_grpc.ParameterServerStub
    worker: Worker
    values: dict[str, torch.Tensor]


@pytest.fixture
def ready(shard, stub) -> Ready:
    worker, reply = register(stub)
    assert reply.must_initialize
    assert initialize(stub, worker).applied
    assert push(stub, worker, GRADS, base_version=0).version == 1
    return Ready(shard, stub, worker, sgd_step(INITIAL, GRADS))


def assert_unchanged_and_serving(
    job: Ready, before: Pulled, before_status: ps_pb2.StatusResponse, *, rejected: int
) -> None:
    """The refused call changed nothing, was counted, and a valid push still succeeds."""
    after = pull(job.stub)
    assert after.snapshot() == before.snapshot()
    now = status(job.stub)
    assert now.version == before_status.version
    assert now.pushes_applied == before_status.pushes_applied
    assert now.pushes_rejected == before_status.pushes_rejected + rejected
    assert now.max_staleness == before_status.max_staleness
    assert now.state == "ready"
    assert list(now.parts) == list(before_status.parts)
    assert now.optimizer == before_status.optimizer

    reply = push(job.stub, job.worker, GRADS, base_version=now.version)
    assert (reply.version, reply.staleness) == (now.version + 1, 0)
    expected = sgd_step({k: after.tensor(k) for k in after.data}, GRADS)
    assert pull(job.stub).data == raw(expected)


# -- shared by the tests of several modules ------------------------------------------------


class ObservedStore(ShardStore):
    """Tells the test what the servicer is doing (instead of sleeping and hoping)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.pull_waiting = threading.Event()
        self.upload_started = threading.Event()
        self._observed = threading.Condition()  # guards _waiters
        self._waiters = 0

    def wait_ready(self, timeout: float, **kwargs) -> None:
        with self._observed:
            self._waiters += 1
            self._observed.notify_all()
        self.pull_waiting.set()
        super().wait_ready(timeout, **kwargs)

    def upload_parts(self, header_parts, *, initialize, rows=False):
        self.upload_started.set()
        return super().upload_parts(header_parts, initialize=initialize, rows=rows)

    def wait_for_waiters(self, n: int, timeout: float) -> bool:
        with self._observed:
            return self._observed.wait_for(lambda: self._waiters >= n, timeout=timeout)


def nan_w() -> torch.Tensor:
    g = GRADS["w"].clone()
    g[2, 1] = float("nan")
    return g


def preinitialised_store() -> tuple[ShardStore, Worker]:
    """A store initialised directly, so that its whole model may exceed the RPC size limit."""
    store = ShardStore()
    result = store.register(Registration(
        worker_name="worker-0", shard_index=0, num_shards=1, placement_digest=DIGEST,
        parts=PARTS, optimizer=SGD, job_fingerprint=JOB,
    ))
    worker = Worker(result.worker_id, result.generation, result.session)
    assert store.initialize(worker.worker_id, worker.generation, [INITIAL[p.key].numpy().copy() for p in PARTS]) == (True, 0)
    return store, worker
