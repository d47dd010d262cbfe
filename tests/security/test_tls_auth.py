"""TLS, mutual TLS, tokens and admission control against real ``psserver`` processes.

The hostile clients speak gRPC directly; the friendly ones are the real ``psworker`` and
``psctl``. Certificates come from ``pswire.security.make_dev_pki``; ports are chosen at run time.
"""

from __future__ import annotations

import json
import multiprocessing
import secrets
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pswire.consistency import Consistency
from pswire.placement import model_spec, place
from pswire.security import ClientSecurity, make_dev_pki, write_private_file
from pswire.tlsbio import TLSStream
from pswire.v1 import ps_pb2, ps_pb2_grpc
from pswire.wire import consistency_to_proto, optimizer_to_proto
from psworker.client import ClientOptions, PSClient
from pswire.optim import OptimizerConfig
from tests.conftest import ROOT, child_env, start_shard

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RPC_TIMEOUT = 10.0
ROLES = ("worker", "reader", "admin")


@pytest.fixture
def pki(tmp_path):
    return make_dev_pki(tmp_path / "tls", ["127.0.0.1", "localhost"])


@pytest.fixture
def tokens(tmp_path) -> dict[str, str]:
    """Fresh tokens by role, in ``tmp_path/tokens`` (the shard's format) and one file per role."""
    made = {role: secrets.token_urlsafe(32) for role in ROLES}
    write_private_file(tmp_path / "tokens", "".join(f"{r} {t}\n" for r, t in made.items()).encode())
    for role, token in made.items():
        write_private_file(tmp_path / f"{role}.token", f"{token}\n".encode())
    return made


@pytest.fixture
def started(tmp_path):
    shards = []

    def start(*flags: str):
        shard = start_shard(tmp_path, f"shard{len(shards)}", *flags)
        shards.append(shard)
        return shard

    yield start
    for shard in shards:
        shard.stop()


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _health(channel: grpc.Channel, timeout: float = RPC_TIMEOUT) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status


def _refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    return info.value.details()


def _worker(ps: str, *flags: str, env: dict[str, str] | None = None, steps: int = 20) -> subprocess.Popen:
    return subprocess.Popen(
        # The static split: several runs of different lengths join one job (dynamic data would hold
        # every run to the first one's plan).
        [sys.executable, "-m", "psworker", "--ps", ps, "--task", "linreg", "--steps", str(steps), "--threads", "1",
         "--progress", "log", "--worker-index", "0", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(child_env(), **(env or {})), cwd=ROOT,
    )


def _ctl(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``psctl ARGV`` to completion, with ``env`` added to the children's environment."""
    return subprocess.run([sys.executable, "-m", "psworker.ctl", *argv], capture_output=True, text=True, timeout=120,
                          env=dict(child_env(), **(env or {})), cwd=ROOT)


def _result(proc: subprocess.Popen, timeout: float = 120) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


# -- TLS ------------------------------------------------------------------------------------------


def test_a_plaintext_client_cannot_talk_to_a_tls_shard(started, pki):
    shard = started("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key))
    with grpc.insecure_channel(shard.address) as plain:
        _refused(lambda: _health(plain, timeout=3), grpc.StatusCode.UNAVAILABLE)
    with grpc.secure_channel(shard.address, ClientSecurity(ca_file=str(pki.ca)).channel_credentials()) as tls:
        assert _health(tls) == health_pb2.HealthCheckResponse.SERVING
    # psctl without --tls-ca fails, and says what to give.
    proc = _ctl("status", "--ps", shard.address, "--timeout", "2")
    assert proc.returncode == 1 and "give --tls-ca" in proc.stderr, proc.stderr
    proc = _ctl("status", "--ps", shard.address, "--tls-ca", str(pki.ca), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)[0]["state"] == "empty", proc.stderr


def test_a_mutual_tls_shard_refuses_a_client_without_a_certificate(started, pki, tmp_path):
    shard = started(*pki.shard_flags())
    anonymous = ClientSecurity(ca_file=str(pki.ca))
    with grpc.secure_channel(shard.address, anonymous.channel_credentials()) as channel:
        _refused(lambda: _health(channel, timeout=3), grpc.StatusCode.UNAVAILABLE)
    with grpc.secure_channel(shard.address, pki.client().channel_credentials()) as channel:
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    # A certificate from another CA is refused too.
    stranger = make_dev_pki(tmp_path / "other")
    impostor = ClientSecurity(ca_file=str(pki.ca), cert_file=str(stranger.client_cert),
                              key_file=str(stranger.client_key))
    with grpc.secure_channel(shard.address, impostor.channel_credentials()) as channel:
        _refused(lambda: _health(channel, timeout=3), grpc.StatusCode.UNAVAILABLE)


# -- tokens and roles ----------------------------------------------------------------------------


def test_tokens_and_roles_are_checked_on_every_call_and_health_stays_open(started, tokens, tmp_path):
    shard = started("--auth-token-file", str(tmp_path / "tokens"), "--checkpoint-dir", str(tmp_path / "ckpt"))
    bad = secrets.token_urlsafe(32)
    with grpc.insecure_channel(shard.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        status = lambda md=None: stub.Status(ps_pb2.StatusRequest(), timeout=RPC_TIMEOUT, metadata=md)  # noqa: E731
        details = _refused(status, grpc.StatusCode.UNAUTHENTICATED)
        assert "Status" in details and "reader" in details
        details = _refused(lambda: status(_bearer(bad)), grpc.StatusCode.UNAUTHENTICATED)
        assert bad not in details and "not one this shard accepts" in details
        _refused(lambda: status((("authorization", tokens["admin"]),)), grpc.StatusCode.UNAUTHENTICATED)  # no scheme
        assert status(_bearer(tokens["reader"])).state == "empty"
        assert status(_bearer(tokens["worker"])).state == "empty"  # a worker is a reader too

        checkpoint = ps_pb2.CheckpointRequest(checkpoint_id=1)
        details = _refused(lambda: stub.Checkpoint(checkpoint, timeout=RPC_TIMEOUT, metadata=_bearer(tokens["worker"])),
                           grpc.StatusCode.PERMISSION_DENIED)
        assert "Checkpoint needs the admin role" in details and "worker role" in details
        assert tokens["worker"] not in details
        for role in ("worker", "reader"):  # ending the job is the admin's alone
            details = _refused(lambda: stub.EndJob(ps_pb2.EndJobRequest(), timeout=RPC_TIMEOUT,
                                                   metadata=_bearer(tokens[role])), grpc.StatusCode.PERMISSION_DENIED)
            assert "EndJob needs the admin role" in details
        assert not stub.EndJob(ps_pb2.EndJobRequest(), timeout=RPC_TIMEOUT, metadata=_bearer(tokens["admin"])).ended
        # A reader may read the model but not change it or join the job. The Push stream is
        # refused before the shard reads any of it.
        details = _refused(lambda: stub.Push(iter(()), timeout=RPC_TIMEOUT, metadata=_bearer(tokens["reader"])),
                           grpc.StatusCode.PERMISSION_DENIED)
        assert "Push needs the worker role" in details
        _refused(lambda: stub.Register(ps_pb2.RegisterRequest(worker_name="r"), timeout=RPC_TIMEOUT,
                                       metadata=_bearer(tokens["reader"])), grpc.StatusCode.PERMISSION_DENIED)
        _refused(lambda: stub.Heartbeat(ps_pb2.HeartbeatRequest(), timeout=RPC_TIMEOUT,
                                        metadata=_bearer(tokens["reader"])), grpc.StatusCode.PERMISSION_DENIED)
        # The health service needs no token.
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    assert bad not in shard.log() and tokens["worker"] not in shard.log()

    # The CLIs: a token from the environment, a role too low, and none at all.
    ctl = ["status", "--ps", shard.address, "--json"]
    proc = _ctl(*ctl, env={"PSGRPC_TOKEN": tokens["reader"]})
    assert proc.returncode == 0, proc.stderr
    proc = _ctl(*ctl)
    assert proc.returncode == 1 and "UNAUTHENTICATED" in proc.stderr and "PSGRPC_TOKEN" in proc.stderr, proc.stderr
    proc = _ctl("checkpoint", "--ps", shard.address, "--token-file", str(tmp_path / "worker.token"))
    assert proc.returncode == 1 and "PERMISSION_DENIED" in proc.stderr and "admin role" in proc.stderr, proc.stderr


def test_a_worker_trains_and_an_operator_checkpoints_through_mutual_tls_and_tokens(started, pki, tokens, tmp_path):
    shard = started(*pki.shard_flags(), "--auth-token-file", str(tmp_path / "tokens"),
                    "--checkpoint-dir", str(tmp_path / "ckpt"))
    result = _result(_worker(shard.address, *pki.client_flags(), env={"PSGRPC_TOKEN": tokens["worker"]}))
    assert result["steps"] == 20 and result["rejoins"] == 0 and result["test_loss"] < 10, result

    # psctl checkpoint with no --id: twice in a row, each id above the last.
    ctl = ["checkpoint", "--ps", shard.address, *pki.client_flags(), "--token-file", str(tmp_path / "admin.token")]
    ids = []
    for _ in range(2):
        proc = _ctl(*ctl)
        assert proc.returncode == 0 and "complete" in proc.stdout, proc.stderr
        ids.append(int(proc.stdout.split("checkpoint ")[-1].split()[0]))
    assert ids[0] >= int(time.time()) - 120 and ids[1] > ids[0]

    # Large transfers go over the bulk lanes, in TLS too: a 2 MiB variable, pushed and pulled.
    values = {"w": torch.zeros(512, 1024)}
    options = ClientOptions(timeout=RPC_TIMEOUT, connect_timeout=RPC_TIMEOUT, security=pki.client(tokens["worker"]))
    other = started(*pki.shard_flags(), "--auth-token-file", str(tmp_path / "tokens"))
    with PSClient([other.address], options) as client:
        client.wait_connected()
        client.register(model_spec(values.items()), OptimizerConfig(name="sgd", lr=1.0), worker_name="big",
                        initial_values=values)
        pulled = {"w": torch.empty(512, 1024)}
        client.push_pull({"w": torch.ones(512, 1024)}, pulled)
        assert torch.equal(pulled["w"], torch.full((512, 1024), -1.0))
        lane = client._clients[0].lanes.take()  # a lane the transfer gave back: it went over TLS
        assert lane is not None and isinstance(lane.sock, TLSStream) and lane.sock.version()
        client._clients[0].lanes.give(lane)


# -- admission control -------------------------------------------------------------------------


def _stalled(stop: threading.Event):
    """A request stream that sends nothing until ``stop``."""
    stop.wait(timeout=240)
    return
    yield  # a generator


def _hammer(address: str, threads: int, stop, results) -> None:
    """A hostile process: ``threads`` threads calling Status (even ones) or PullInline (odd ones)
    in a loop until ``stop``; puts the count of each outcome on ``results``. Runs under ``spawn``
    (gRPC does not survive fork)."""
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def loop(index: int, channel: grpc.Channel) -> None:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        call = (lambda: stub.Status(ps_pb2.StatusRequest(), timeout=5)) if index % 2 == 0 else (
            lambda: stub.PullInline(ps_pb2.PullRequest(), timeout=5))
        while not stop.is_set():
            try:
                call()
                outcome = "ok"
            except grpc.RpcError as exc:
                outcome = "overloaded" if (exc.details() or "").startswith("overloaded:") else exc.code().name
            with lock:
                counts[outcome] = counts.get(outcome, 0) + 1

    channels = [grpc.insecure_channel(address) for _ in range(8)]
    workers = [threading.Thread(target=loop, args=(i, channels[i % 8])) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=60)
    results.put(counts)


def _register_request(name: str) -> ps_pb2.RegisterRequest:
    """What a linreg worker registers (the real worker's job): same model, optimizer, fingerprint."""
    from psworker.tasks import load_task

    task = load_task("linreg")
    spec = model_spec((n, p.data) for n, p in task.model.named_parameters())
    placement = place(spec, 1)
    d = task.defaults
    return ps_pb2.RegisterRequest(
        worker_name=name, shard_index=0, num_shards=1, placement_digest=placement.digest(),
        parts=[p.to_proto() for p in placement.shards[0]],
        optimizer=optimizer_to_proto(OptimizerConfig(name=d.optimizer, lr=d.lr, momentum=d.momentum)),
        job_fingerprint="task=linreg", consistency=consistency_to_proto(Consistency()),
    )


def test_stalled_streams_and_status_and_pull_loops_leave_heartbeats_health_and_a_real_worker_running(started):
    # The shard's default 32 threads; streams are never cut (--stream-idle-timeout 0), so only
    # admission control keeps threads free. A short lease: starved heartbeats would evict.
    shard = started("--stream-idle-timeout", "0", "--lease-timeout", "5")
    stop_streams = threading.Event()
    channel = grpc.insecure_channel(shard.address)
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    spawn = multiprocessing.get_context("spawn")
    stop_hammer, results = spawn.Event(), spawn.Queue()
    hammer = spawn.Process(target=_hammer, args=(shard.address, 64, stop_hammer, results), daemon=True)
    stalled = []
    try:
        stalled = [stub.Push.future(_stalled(stop_streams), timeout=240) for _ in range(16)]
        hammer.start()
        worker = _worker(shard.address, steps=300)

        # Wait (with a deadline) for the worker to have made the job, then join it as a prober.
        deadline = time.monotonic() + 120
        while True:
            try:
                if stub.Status(ps_pb2.StatusRequest(), timeout=RPC_TIMEOUT).state == "ready":
                    break
            except grpc.RpcError as exc:  # Status is crowded out by the hammer now and then
                assert exc.details().startswith("overloaded:"), exc
            assert time.monotonic() < deadline and worker.poll() is None, worker.stderr.read()[-3000:]
            stop_streams.wait(0.1)  # a paced retry: nothing signals the job's creation
        reply = stub.Register(_register_request("prober"), timeout=RPC_TIMEOUT)
        assert not reply.must_initialize

        latencies = []
        for _ in range(25):
            started_at = time.monotonic()
            stub.Heartbeat(ps_pb2.HeartbeatRequest(worker_id=reply.worker_id, generation=reply.generation,
                                                   session=reply.session), timeout=1.0)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == \
                health_pb2.HealthCheckResponse.SERVING
            latencies.append(time.monotonic() - started_at)
            stop_streams.wait(0.1)  # paces the probes over a few seconds of load
        assert max(latencies) < 1.0, latencies
        assert all(not f.done() for f in stalled), "a stalled stream ended early"

        result = _result(worker, timeout=240)
        assert result["steps"] == 300 and result["rejoins"] == 0, result

        # The 16 streams really held data slots: with the default cap of 24, eight more are
        # admitted and the ninth is turned away as overloaded and retryable.
        more = [stub.Push.future(_stalled(stop_streams), timeout=240) for _ in range(9)]
        stalled += more
        one_ended = threading.Event()
        for call in more:
            call.add_done_callback(lambda _: one_ended.set())
        assert one_ended.wait(timeout=30)
        (refused,) = [call for call in more if call.done()]
        error = refused.exception()
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and error.details().startswith("overloaded:")
        assert ("ps-retryable", "1") in tuple(error.trailing_metadata())
    finally:
        stop_hammer.set()
        for call in stalled:
            call.cancel()
        stop_streams.set()
        hammer.join(timeout=60)
        channel.close()
    counts = results.get(timeout=10)
    # The hammer kept Status and pulls busy throughout; beyond a cap a call is refused as
    # overloaded, never with another error (gRPC's own limit, a deadline). Pulls before the job
    # existed were told the shard is not ready.
    assert counts.get("ok", 0) > 100 and set(counts) <= {"ok", "overloaded", "UNAVAILABLE"}, counts
    print(f"hammer outcomes {counts}; heartbeat + health round trips {min(latencies):.3f}-{max(latencies):.3f}s")
    # Every cancelled stream gave its slot back: a fresh worker trains on the same shard.
    assert _result(_worker(shard.address, steps=5)).get("steps") == 5
    log = shard.log()
    assert "Traceback" not in log, log[-6000:]
