"""Fuzz tier: a real ``psserver`` process takes tens of thousands of random and mutated messages
on every method of its service, and random bytes on its bulk port, from several clients at once.

What must hold: no call ends in UNKNOWN or INTERNAL (every refusal is a meaningful status), the
shard keeps serving, nothing refused changes the model or the newest checkpoint, and the shard's
resident memory grows by less than 20 MiB. ``PS_FUZZ_MESSAGES`` sets the count (default 20,000).
"""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest

from psserver.checkpoint import LATEST
from pswire.codec import Part
from pswire.optim import OptimizerConfig
from pswire.tables import TableSpec
from pswire.v1 import ps_pb2, ps_pb2_grpc
from pswire.wire import rows_to_proto, table_to_proto
from tests.conftest import start_shard, wait_until
from tests.service.shard_harness import GRADS, PARTS, initialize, push, register, register_request

pytestmark = [pytest.mark.timeout(300), pytest.mark.integration]

MESSAGES = int(os.environ.get("PS_FUZZ_MESSAGES", "20000"))
CLIENTS = 6
RPC_TIMEOUT = 5.0
SERVICE = "/pswire.v1.ParameterServer/"
EXTREMES = (0, 1, -1, 2**31 - 1, -(2**31), 2**53, 2**62, 2**63 - 1, -(2**63))
UNARY = ("Register", "PushInline", "PullInline", "PushPull", "Leave", "Heartbeat", "Status", "Checkpoint", "PullRows")
TABLE = TableSpec(name="emb", num_rows=1000, dim=4, optimizer=OptimizerConfig(name="adagrad", lr=0.1))
STREAMS = ("Push", "Initialize")


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _scramble(message, rng: random.Random) -> None:
    """Set a few integer, bytes and string fields anywhere in ``message`` to hostile values."""
    for field in message.DESCRIPTOR.fields:
        if rng.random() > 0.3:
            continue
        if field.type == field.TYPE_MESSAGE:
            if field.is_repeated:
                items = getattr(message, field.name)
                if field.message_type.GetOptions().map_entry:
                    items[rng.choice(["w", "", "x" * 300])] = rng.choice(EXTREMES)
                elif len(items):
                    _scramble(items[rng.randrange(len(items))], rng)
            else:
                _scramble(getattr(message, field.name), rng)
            continue
        if field.is_repeated:
            if field.type in (field.TYPE_INT64, field.TYPE_INT32):
                del getattr(message, field.name)[:]
                bound = 2**31 - 1 if field.type == field.TYPE_INT32 else 2**63 - 1
                getattr(message, field.name).extend(
                    max(-bound - 1, min(bound, rng.choice(EXTREMES))) for _ in range(rng.randrange(4))
                )
            continue
        if field.type in (field.TYPE_INT64, field.TYPE_SINT64, field.TYPE_SFIXED64):
            setattr(message, field.name, rng.choice(EXTREMES))
        elif field.type in (field.TYPE_INT32, field.TYPE_ENUM):
            setattr(message, field.name, max(-(2**31), min(2**31 - 1, rng.choice(EXTREMES))))
        elif field.type in (field.TYPE_UINT64, field.TYPE_UINT32):
            setattr(message, field.name, rng.choice((0, 1, 2**32 - 1)))
        elif field.type == field.TYPE_BYTES:
            setattr(message, field.name, rng.randbytes(rng.choice((0, 1, 16, 32, 300))))
        elif field.type == field.TYPE_STRING:
            setattr(message, field.name, rng.choice(("", "w", "\u00e9" * 50, "x" * 5000)))
        elif field.type == field.TYPE_DOUBLE:
            setattr(message, field.name, rng.choice((0.0, -1.0, 1e308, float("nan"), float("inf"))))
        elif field.type == field.TYPE_BOOL:
            setattr(message, field.name, rng.random() < 0.5)


def _mutate(raw: bytes, rng: random.Random) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(4)
        if kind == 0 and data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind == 1 and data:
            del data[rng.randrange(len(data)):]
        elif kind == 2:
            at = rng.randrange(len(data) + 1)
            data[at:at] = rng.randbytes(rng.randint(1, 16))
        else:
            data += rng.randbytes(rng.randint(0, 8))
    return bytes(data)


class _Templates:
    """Valid messages of every method, each naming the real worker with a wrong session."""

    def __init__(self, worker, bulk_port: int) -> None:
        wrong = b"\x00" * 32
        specs = [p.to_proto() for p in PARTS]
        rows = rows_to_proto(TABLE.name, np.array([0, 7]), np.ones((2, TABLE.dim)))
        head = ps_pb2.TensorHeader(worker_id=worker.worker_id, generation=worker.generation, sequence=1,
                                   session=wrong, parts=specs, rows=[rows])
        data = [bytes(p.nbytes) for p in PARTS]
        pull = ps_pb2.PullRequest(worker_id=worker.worker_id, generation=worker.generation, clock=0,
                                  session=wrong, known_versions={PARTS[0].key: 1})
        self.unary = {
            "Register": register_request("fuzzed"),
            "PushInline": ps_pb2.InlinePush(header=head, data=data),
            "PullInline": pull,
            "PushPull": ps_pb2.PushPullRequest(push=ps_pb2.InlinePush(header=head, data=data), pull=pull),
            "Leave": ps_pb2.LeaveRequest(worker_id=worker.worker_id, generation=worker.generation, session=wrong),
            "Heartbeat": ps_pb2.HeartbeatRequest(worker_id=worker.worker_id, generation=worker.generation,
                                                 session=wrong),
            "Status": ps_pb2.StatusRequest(),
            "Checkpoint": ps_pb2.CheckpointRequest(checkpoint_id=1),
            "PullRows": ps_pb2.PullRowsRequest(worker_id=worker.worker_id, generation=worker.generation, clock=0,
                                               session=wrong, rows=[rows_to_proto(TABLE.name, np.arange(5))]),
        }
        self.stream = [ps_pb2.TensorMessage(header=head)] + [
            ps_pb2.TensorMessage(chunk=ps_pb2.TensorChunk(part_index=i, offset=0, data=d)) for i, d in enumerate(data)
        ]
        self.bulk_port = bulk_port

    def message(self, method: str, rng: random.Random) -> bytes:
        roll = rng.random()
        if roll < 0.15:
            return rng.randbytes(rng.randrange(64))
        template = self.unary[method] if method in self.unary else rng.choice(self.stream)
        if roll < 0.55:
            return _mutate(template.SerializeToString(), rng)
        message = type(template)()
        message.CopyFrom(template)
        _scramble(message, rng)
        return message.SerializeToString()


def _fuzz(address: str, templates: _Templates, seed: int, count: int, codes: Counter, oks: Counter,
          lock: threading.Lock) -> None:
    rng = random.Random(seed)
    channel = grpc.insecure_channel(address)
    identity = dict(request_serializer=None, response_deserializer=None)
    calls = {m: channel.unary_unary(SERVICE + m, **identity) for m in UNARY}
    calls.update({m: channel.stream_unary(SERVICE + m, **identity) for m in STREAMS})
    pull = channel.unary_stream(SERVICE + "Pull", **identity)
    try:
        sent = 0
        while sent < count:
            method = rng.choice(UNARY + STREAMS + ("Pull",))
            try:
                if method in STREAMS:
                    batch = [templates.message(method, rng) for _ in range(rng.randint(1, 3))]
                    sent += len(batch)
                    calls[method](iter(batch), timeout=RPC_TIMEOUT)
                elif method == "Pull":
                    sent += 1
                    for _ in pull(templates.message("PullInline", rng), timeout=RPC_TIMEOUT):
                        pass
                else:
                    sent += 1
                    calls[method](templates.message(method, rng), timeout=RPC_TIMEOUT)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
                if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
                    with lock:
                        codes[(method, code.name, (exc.details() or "")[:160])] += 1
            with lock:
                codes[code.name] += 1
                if code is grpc.StatusCode.OK:
                    oks[method] += 1
            if sent % 50 == 0:
                _bulk_garbage(address, templates.bulk_port, rng)
    finally:
        channel.close()


def _bulk_garbage(address: str, port: int, rng: random.Random) -> None:
    """Random bytes, a hostile push frame or a forged handshake on the bulk port; then close."""
    host = address.rpartition(":")[0]
    try:
        with socket.create_connection((host, port), timeout=2) as sock:
            sock.settimeout(2)
            kind = rng.randrange(3)
            if kind == 0:
                sock.sendall(rng.randbytes(rng.randrange(1, 256)))
            elif kind == 1:
                sock.sendall(b"PSPU" + struct.pack("<QQ", rng.randrange(2**64), rng.choice((8 << 30, 2**64 - 1, 16))))
            else:
                sock.sendall(b"PSAU" + struct.pack("<QQ", 1, 1) + rng.randbytes(32))
            try:
                sock.recv(64)
            except OSError:
                pass
    except OSError:
        pass


def test_random_and_mutated_messages_never_break_a_shard(tmp_path):
    shard = start_shard(tmp_path, "fuzzed", "--checkpoint-dir", str(tmp_path / "ckpt"), "--lease-timeout", "0")
    channel = grpc.insecure_channel(shard.address)
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    try:
        worker, reply = register(stub, tables=[table_to_proto(TABLE)])
        assert reply.must_initialize and initialize(stub, worker).applied
        push(stub, worker, GRADS, base_version=0)
        assert stub.Checkpoint(ps_pb2.CheckpointRequest(checkpoint_id=int(time.time())), timeout=30).complete
        latest = (tmp_path / "ckpt" / LATEST).read_bytes()
        model = _model(stub)
        templates = _Templates(worker, reply.bulk_port)

        codes, oks, lock = Counter(), Counter(), threading.Lock()
        _fuzz(shard.address, templates, seed=-1, count=1000, codes=codes, oks=oks, lock=lock)  # warm-up
        rss_before = _rss_kib(shard.popen.pid)
        started = time.monotonic()
        threads = [
            threading.Thread(target=_fuzz, args=(shard.address, templates, seed, MESSAGES // CLIENTS, codes, oks, lock))
            for seed in range(CLIENTS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
            assert not t.is_alive(), "a fuzzing client hung"
        seconds = time.monotonic() - started
        rss_after = _rss_kib(shard.popen.pid)
        print(f"fuzz: {MESSAGES} messages in {seconds:.1f}s; codes {dict((k, v) for k, v in codes.items() if isinstance(k, str))}; "
              f"accepted {dict(oks)}; shard RSS {rss_before / 1024:.1f} -> {rss_after / 1024:.1f} MiB")

        broken = {k: v for k, v in codes.items() if not isinstance(k, str)}
        assert not broken, f"calls answered UNKNOWN or INTERNAL: {broken}"
        assert shard.popen.poll() is None, shard.log()
        for method in ("PushInline", "PushPull", "Push", "Initialize", "Checkpoint", "Leave"):
            assert not oks[method], f"a fuzzed {method} was accepted: {dict(oks)}"
        # Calls whose callers gave up may still hold data slots for a moment: an overloaded shard
        # says RESOURCE_EXHAUSTED, retry after a backoff, and it must serve again within seconds.
        stopped = time.monotonic()
        after = wait_until(lambda: _unless_overloaded(lambda: _model(stub)), 60, shard.popen, "the model's pull")
        print(f"serving the model's pull again {time.monotonic() - stopped:.2f}s after the fuzzers stopped")
        assert after == model, "refused input changed the model"
        assert (tmp_path / "ckpt" / LATEST).read_bytes() == latest
        assert rss_after - rss_before < 20 * 1024, f"RSS grew {(rss_after - rss_before) / 1024:.1f} MiB"
        assert "Traceback" not in shard.log(), shard.log()[-3000:]

        # Still serving: the real worker's push applies and its heartbeat answers.
        version = stub.Status(ps_pb2.StatusRequest(), timeout=RPC_TIMEOUT).version
        pushed = wait_until(lambda: _unless_overloaded(lambda: push(stub, worker, GRADS, base_version=version)), 60,
                            shard.popen, "the real worker's push")
        assert pushed.version == version + 1
        stub.Heartbeat(ps_pb2.HeartbeatRequest(worker_id=worker.worker_id, generation=worker.generation,
                                               session=worker.session), timeout=RPC_TIMEOUT)
    finally:
        channel.close()
        shard.stop()


def _unless_overloaded(call):
    """``call()``'s reply, or None while the shard answers RESOURCE_EXHAUSTED (retry later)."""
    try:
        return call()
    except grpc.RpcError as exc:
        if exc.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return None


def _model(stub) -> dict[str, bytes]:
    reply = stub.PullInline(ps_pb2.PullRequest(), timeout=RPC_TIMEOUT)
    keys = [Part.from_proto(p.spec).key for p in reply.header.parts]
    rows = stub.PullRows(ps_pb2.PullRowsRequest(clock=-1, rows=[rows_to_proto(TABLE.name, np.arange(TABLE.num_rows))]),
                         timeout=RPC_TIMEOUT)
    return dict(zip(keys, reply.data)) | {"version": str(reply.header.version).encode(), "rows": rows.rows[0].values}

