"""Service tier: a real shard in-process on port 0 with ``metrics_port=0``, driven through raw
gRPC and ``PSClient``, then scraped over HTTP at its real ``/metrics`` endpoint and parsed with
``prometheus_client.parser``.

After a short run (registrations, an initialisation, pushes applied and dropped, a duplicate, a
refused push, a non-finite one, a fenced one, a pull that waits in ssp, a checkpoint written and
one that fails) every ``psserver_`` metric of the contract (``docs/metrics.md``) is present with
its documented type and labels, and its values are what happened. ``promtool check metrics``
passes on the scrape when promtool is installed; with ``CI`` set, a missing promtool fails the
test rather than skipping it.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from psserver.config import ServerConfig
from psserver.server import create_server
from pswire.codec import Part
from pswire.consistency import Consistency, Mode
from pswire.dtypes import FLOAT32
from pswire.placement import VariableSpec
from pswire.v1 import ps_pb2
from pswire.wire import consistency_to_proto
from psserver.dataqueue import MAX_HELD
from psworker.client import ClientOptions, PSClient
from tests.service.test_data_service import PLAN, data
from tests.service.shard_harness import (
    GRADS, MODEL_BYTES, PART, RPC_TIMEOUT, SGD, Worker, chunks, expect_rpc_error, initialize, open_stub,  # noqa: F401
    register, started_shards, status,
)

pytestmark = pytest.mark.timeout(120)

SSP = Consistency(mode=Mode.SSP, staleness=0)

CONTRACT: dict[str, tuple[str, tuple[str, ...]]] = {
    "psserver_info": ("gauge", ("shard_index", "num_shards", "mode")),
    "psserver_pushes": ("counter", ("outcome",)),
    "psserver_push_bytes": ("counter", ("transport",)),
    "psserver_pull_bytes": ("counter", ("transport",)),
    "psserver_rpc_duration_seconds": ("histogram", ("method", "code")),
    "psserver_applied_staleness": ("histogram", ()),
    "psserver_pull_wait_seconds": ("counter", ()),
    "psserver_pull_waits": ("counter", ("worker",)),
    "psserver_version": ("gauge", ()),
    "psserver_learning_rate": ("gauge", ()),
    "psserver_clock": ("gauge", ()),
    "psserver_workers": ("gauge", ("state",)),
    "psserver_evictions": ("counter", ()),
    "psserver_variable_bytes": ("gauge", ()),
    "psserver_optimizer_state_bytes": ("gauge", ()),
    "psserver_inflight_push_bytes": ("gauge", ()),
    "psserver_checkpoint_duration_seconds": ("histogram", ()),
    "psserver_checkpoint_last_success_timestamp_seconds": ("gauge", ()),
    "psserver_checkpoint_failures": ("counter", ()),
    "psserver_checkpoint_last_id": ("gauge", ()),
    "psserver_checkpoint_schedule_seconds": ("gauge", ()),
    "psserver_data_epoch": ("gauge", ()),
    "psserver_data_tasks": ("gauge", ("state",)),
    "psserver_data_examples": ("gauge", ("state",)),
    "psserver_data_tasks_requeued": ("counter", ()),
    "psserver_table_rows": ("gauge", ("state",)),
    "psserver_table_rows_pushed": ("counter", ()),
    "psserver_table_rows_pulled": ("counter", ()),
}
"""Every shard metric of the contract: its family name as the parser gives it (a counter's
without ``_total``), type and labels (a histogram's ``le`` aside)."""


# -- helpers ---------------------------------------------------------------------------------


class Scrape:
    """One scrape of a ``/metrics`` endpoint, parsed."""

    def __init__(self, url: str) -> None:
        with urllib.request.urlopen(url, timeout=RPC_TIMEOUT) as reply:
            assert reply.status == 200
            assert reply.headers["Content-Type"].startswith("text/plain")
            self.text = reply.read().decode()
        self.families = {f.name: f for f in text_string_to_metric_families(self.text)}

    def value(self, sample: str, **labels: str) -> float:
        found = [s.value for s in self._samples(sample) if s.labels == labels]
        assert len(found) == 1, f"{sample}{labels}: {len(found)} samples"
        return found[0]

    def values(self, sample: str, label: str) -> dict[str, float]:
        return {s.labels[label]: s.value for s in self._samples(sample)}

    def _samples(self, sample: str) -> list:
        for suffix in ("", "_total", "_bucket", "_count", "_sum"):
            family = self.families.get(sample.removesuffix(suffix)) if sample.endswith(suffix) else None
            if family is not None:
                return [s for s in family.samples if s.name == sample]
        raise KeyError(f"no family has samples named {sample}")


def ssp_register(stub, name: str, **overrides) -> Worker:
    worker, _ = register(stub, name, consistency=consistency_to_proto(SSP), **overrides)
    return worker


def ssp_push(stub, worker: Worker, grads, *, sequence: int, base_version: int, clock: int, base_clock: int):
    """A push of ``grads`` (part key -> value; a key the job lacks is sent as a whole float32
    variable of that shape)."""
    specs = [(PART[k] if k in PART else Part(k, tuple(g.shape), FLOAT32, 0, g.shape[0])).to_proto()
             for k, g in grads.items()]
    first = ps_pb2.TensorMessage(header=ps_pb2.TensorHeader(
        worker_id=worker.worker_id, generation=worker.generation, session=worker.session, sequence=sequence,
        base_version=base_version, clock=clock, base_clock=base_clock, parts=specs,
    ))
    return stub.Push(iter([first, *chunks(list(grads.values()))]), timeout=RPC_TIMEOUT)


def wait_until(condition: Callable[[], bool], timeout: float = RPC_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s")
        time.sleep(0.01)


def promtool_check(text: str) -> None:
    """``promtool check metrics`` on ``text``; skipped without promtool, failed in CI."""
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing (CI installs Debian's prometheus package: apt-get install prometheus)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def make_shard():
    """In-process shards on port 0, each serving metrics on a port of its own."""
    with started_shards(metrics_port=0) as make:
        yield make


# -- tests -----------------------------------------------------------------------------------


def test_every_shard_metric_is_served_with_its_type_labels_and_what_happened(make_shard, open_stub, tmp_path):
    broken = threading.Event()

    def failpoint(phase: str) -> None:
        if broken.is_set():
            raise OSError(28, "No space left on device")

    shard = make_shard(checkpoint_dir=str(tmp_path), failpoint=failpoint)
    assert shard.metrics_port and shard.metrics_url == f"http://127.0.0.1:{shard.metrics_port}/metrics"
    assert shard.metrics_port != shard.port
    stub = open_stub(shard.address)

    w0 = ssp_register(stub, "worker-0")
    w1 = ssp_register(stub, "worker-1")
    gone = ssp_register(stub, "worker-2")
    stub.Leave(ps_pb2.LeaveRequest(worker_id=gone.worker_id, generation=gone.generation, session=gone.session),
               timeout=RPC_TIMEOUT)
    assert initialize(stub, w0).applied

    # Clock 0: both apply, at staleness 0. Then worker-0's first push again: a duplicate.
    ssp_push(stub, w0, GRADS, sequence=1, base_version=0, clock=0, base_clock=0)
    ssp_push(stub, w1, GRADS, sequence=1, base_version=0, clock=0, base_clock=0)
    assert ssp_push(stub, w0, GRADS, sequence=1, base_version=0, clock=0, base_clock=0).version == 1
    # Refused: a variable the shard does not hold (before its bytes are read), a NaN gradient.
    expect_rpc_error(lambda: ssp_push(stub, w0, {"nope": GRADS["b"]}, sequence=2, base_version=2, clock=1,
                                      base_clock=1), grpc.StatusCode.INVALID_ARGUMENT, "unknown variable")
    nan = {**GRADS, "b": torch.tensor([1.0, float("nan"), 0.0])}
    expect_rpc_error(lambda: ssp_push(stub, w0, nan, sequence=2, base_version=2, clock=1, base_clock=1),
                     grpc.StatusCode.INVALID_ARGUMENT, "NaN")
    # worker-1 registers again by its session: a push of its old generation is fenced.
    w1b = ssp_register(stub, "worker-1", session=w1.session)
    expect_rpc_error(lambda: ssp_push(stub, w1, GRADS, sequence=2, base_version=2, clock=1, base_clock=1),
                     grpc.StatusCode.ABORTED, "re-register")
    ssp_push(stub, w0, GRADS, sequence=2, base_version=2, clock=1, base_clock=1)  # worker-0 at clock 2

    # worker-0 reads at clock 2; worker-1 is at clock 1 and S = 0: the pull waits for worker-1.
    pulled: list[ps_pb2.PullMessage] = []
    request = ps_pb2.PullRequest(worker_id=w0.worker_id, generation=w0.generation, session=w0.session, clock=2)
    reader = threading.Thread(target=lambda: pulled.extend(stub.Pull(request, timeout=RPC_TIMEOUT)))
    started = time.monotonic()
    reader.start()
    wait_until(lambda: status(stub).pulls_waiting == 1)
    # worker-1's push for clock 1, computed at clock 0: staleness 1 > S, dropped, and its clock
    # moves on, which releases the pull.
    assert ssp_push(stub, w1b, GRADS, sequence=1, base_version=0, clock=1, base_clock=0).action == "drop"
    reader.join(timeout=RPC_TIMEOUT)
    waited = time.monotonic() - started
    assert pulled and pulled[0].header.clock == 2

    checkpoint_id = int(time.time())
    assert stub.Checkpoint(ps_pb2.CheckpointRequest(checkpoint_id=checkpoint_id), timeout=RPC_TIMEOUT).complete
    written_at = time.time()
    broken.set()
    expect_rpc_error(lambda: stub.Checkpoint(ps_pb2.CheckpointRequest(checkpoint_id=checkpoint_id + 1),
                                             timeout=RPC_TIMEOUT), grpc.StatusCode.FAILED_PRECONDITION, "space")

    st = status(stub)
    scrape = Scrape(shard.metrics_url)

    # The contract: every family, its type and labels; the process collector beside them.
    for name, (kind, labels) in CONTRACT.items():
        family = scrape.families.get(name)
        assert family is not None, f"{name} is missing"
        assert family.type == kind, (name, family.type)
        assert family.documentation, f"{name} has no help"
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                assert set(sample.labels) - {"le"} == set(labels), (sample.name, sample.labels)
    # Nothing else, but the creation times prometheus_client's own histograms carry.
    shard_families = {n.removesuffix("_created") for n in scrape.families if n.startswith("psserver_")}
    assert shard_families == set(CONTRACT), shard_families ^ set(CONTRACT)
    assert scrape.value("process_resident_memory_bytes") > 0
    assert scrape.value("process_cpu_seconds_total") > 0

    assert scrape.value("psserver_info", shard_index="0", num_shards="1", mode="ssp") == 1
    pushes = scrape.values("psserver_pushes_total", "outcome")
    assert pushes == {"applied": 3, "scaled": 0, "dropped": 1, "duplicate": 1, "fenced": 1, "nonfinite": 1,
                      "rejected": 1}
    assert sum(pushes.values()) == st.pushes_received
    assert (st.pushes_applied, st.pushes_dropped, st.pushes_rejected) == (3, 1, 3)
    # Pushes whose bytes were read: three applied, the duplicate, the NaN one and the dropped one.
    assert scrape.values("psserver_push_bytes_total", "transport") == {"grpc": 6 * MODEL_BYTES, "lane": 0}
    assert scrape.values("psserver_pull_bytes_total", "transport") == {"grpc": MODEL_BYTES, "lane": 0}

    assert scrape.values("psserver_applied_staleness_bucket", "le") == {
        "0.0": 3, "1.0": 3, "2.0": 3, "4.0": 3, "8.0": 3, "16.0": 3, "+Inf": 3}
    assert scrape.value("psserver_applied_staleness_sum") == 0

    assert scrape.values("psserver_pull_waits_total", "worker") == {"worker-0": 0, "worker-1": 1, "worker-2": 0}
    assert 0 < scrape.value("psserver_pull_wait_seconds_total") <= waited
    assert scrape.value("psserver_version") == st.version == 3
    assert scrape.value("psserver_clock") == st.clock == 2
    assert scrape.values("psserver_workers", "state") == {"live": 2, "evicted": 0, "left": 1, "fenced": 0}
    assert scrape.value("psserver_evictions_total") == 0
    assert scrape.value("psserver_variable_bytes") == st.bytes_held == MODEL_BYTES
    assert scrape.value("psserver_optimizer_state_bytes") == st.optimizer_state_bytes
    assert scrape.value("psserver_inflight_push_bytes") == 0

    assert scrape.value("psserver_checkpoint_duration_seconds_count") == 1
    assert 0 < scrape.value("psserver_checkpoint_duration_seconds_sum") < RPC_TIMEOUT
    assert scrape.value("psserver_checkpoint_last_id") == checkpoint_id == st.last_checkpoint_id
    assert written_at - 60 < scrape.value("psserver_checkpoint_last_success_timestamp_seconds") <= written_at
    assert scrape.value("psserver_checkpoint_failures_total") == 1
    assert scrape.value("psserver_checkpoint_schedule_seconds") == 0
    # A static job: no data queue, every data series at 0.
    assert scrape.value("psserver_data_epoch") == 0 and scrape.value("psserver_data_tasks_requeued_total") == 0
    assert scrape.values("psserver_data_tasks", "state") == {"done": 0, "leased": 0, "queued": 0}
    assert scrape.values("psserver_data_examples", "state") == {"done": 0, "total": 0}

    # Every call timed by method and status code, the refused ones too.
    calls = {(s.labels["method"], s.labels["code"]): s.value
             for s in scrape.families["psserver_rpc_duration_seconds"].samples
             if s.name == "psserver_rpc_duration_seconds_count"}
    assert {k: v for k, v in calls.items() if k[0] != "Status"} == {
        ("Register", "OK"): 4, ("Leave", "OK"): 1, ("Initialize", "OK"): 1, ("Push", "OK"): 5,
        ("Push", "INVALID_ARGUMENT"): 2, ("Push", "ABORTED"): 1, ("Pull", "OK"): 1, ("Checkpoint", "OK"): 1,
        ("Checkpoint", "FAILED_PRECONDITION"): 1,
    }
    assert calls[("Status", "OK")] >= 2
    buckets = {s.labels["le"]: s.value for s in scrape.families["psserver_rpc_duration_seconds"].samples
               if s.name.endswith("_bucket") and s.labels["method"] == "Pull"}
    assert buckets["+Inf"] == 1 and buckets["0.0005"] == 0  # it waited

    for family in scrape.families.values():
        for sample in family.samples:
            assert math.isfinite(sample.value), sample
    promtool_check(scrape.text)


def test_a_restored_shard_keeps_the_checkpointed_counters_and_fences_every_worker(make_shard, open_stub, tmp_path):
    first = make_shard(checkpoint_dir=str(tmp_path))
    stub = open_stub(first.address)
    w0, w1 = ssp_register(stub, "worker-0"), ssp_register(stub, "worker-1")
    assert initialize(stub, w0).applied
    ssp_push(stub, w0, GRADS, sequence=1, base_version=0, clock=0, base_clock=0)
    ssp_push(stub, w0, GRADS, sequence=1, base_version=0, clock=0, base_clock=0)  # a duplicate
    ssp_push(stub, w1, GRADS, sequence=1, base_version=0, clock=0, base_clock=0)
    checkpoint_id = int(time.time())
    stub.Checkpoint(ps_pb2.CheckpointRequest(checkpoint_id=checkpoint_id), timeout=RPC_TIMEOUT)
    before = Scrape(first.metrics_url)

    restored = make_shard(checkpoint_dir=str(tmp_path), restore=True, shard_index=0, num_shards=1,
                          checkpoint_every="60s")
    after = Scrape(restored.metrics_url)
    assert after.values("psserver_workers", "state") == {"live": 0, "evicted": 0, "left": 0, "fenced": 2}
    # Applied updates and their staleness carry on; this process's traffic starts again.
    assert after.values("psserver_pushes_total", "outcome") == {
        **before.values("psserver_pushes_total", "outcome"), "duplicate": 0}
    assert before.value("psserver_pushes_total", outcome="duplicate") == 1
    for sample in ("psserver_applied_staleness_count", "psserver_applied_staleness_sum", "psserver_version"):
        assert after.value(sample) == before.value(sample), sample
    assert after.value("psserver_checkpoint_last_id") == checkpoint_id
    assert after.value("psserver_checkpoint_last_success_timestamp_seconds") == 0  # none written by this one
    assert after.value("psserver_checkpoint_schedule_seconds") == 60
    assert after.value("psserver_info", shard_index="0", num_shards="1", mode="ssp") == 1
    promtool_check(after.text)


def test_the_data_queue_is_exported_as_it_stands(make_shard, open_stub):
    shard = make_shard()
    stub = open_stub(shard.address)
    w0, w1 = register(stub, "worker-0")[0], register(stub, "worker-1")[0]
    assert initialize(stub, w0).applied
    # Two epochs of 10 examples in tasks of 4 (six tasks). worker-0 trains one task whole and
    # 1 example of the next; worker-1 leases two tasks, then leaves: both go back.
    first = data(stub, w0, want=2).tasks
    data(stub, w0, finished=[(first[0], 4), (first[1], 1)], want=1)
    data(stub, w1, want=2)
    stub.Leave(ps_pb2.LeaveRequest(worker_id=w1.worker_id, generation=w1.generation, session=w1.session),
               timeout=RPC_TIMEOUT)
    queue = status(stub).data
    scrape = Scrape(shard.metrics_url)
    assert scrape.value("psserver_data_epoch") == queue.epoch == 0
    assert scrape.values("psserver_data_tasks", "state") == {
        "done": queue.tasks_done, "leased": queue.tasks_leased, "queued": queue.tasks_queued} == {
        "done": 1, "leased": 1, "queued": 4}
    assert scrape.values("psserver_data_examples", "state") == {"done": 5, "total": PLAN.total}
    assert scrape.value("psserver_data_tasks_requeued_total") == queue.tasks_requeued == 1 + 2

    held = data(stub, w0).tasks
    w1, _ = register(stub, "worker-1")
    rest = data(stub, w1, want=MAX_HELD).tasks
    data(stub, w0, finished=[(t, t.end - t.start) for t in held])
    data(stub, w1, finished=[(t, t.end - t.start) for t in rest])
    scrape = Scrape(shard.metrics_url)
    assert status(stub).data.finished
    assert scrape.value("psserver_data_epoch") == 1  # the last epoch, once done
    # Six tasks done: not the first [4, 8), trained in part.
    assert scrape.values("psserver_data_tasks", "state") == {"done": 6, "leased": 0, "queued": 0}
    assert scrape.values("psserver_data_examples", "state") == {"done": 20, "total": 20}
    promtool_check(scrape.text)


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk-lanes", "grpc"])
def test_bytes_are_counted_by_the_transport_that_carried_them(make_shard, bulk):
    # 512 KiB on one shard: above the client's inline limit, so on a lane when lanes are on.
    spec = [VariableSpec("emb", (256, 512), FLOAT32), VariableSpec("bias", (8,), FLOAT32)]
    total = (256 * 512 + 8) * 4
    shard = make_shard()
    initial = {"emb": torch.zeros(256, 512), "bias": torch.zeros(8)}
    grads = {"emb": torch.full((256, 512), 0.25), "bias": torch.full((8,), -2.0)}
    options = ClientOptions(timeout=RPC_TIMEOUT, connect_timeout=RPC_TIMEOUT, bulk=bulk)
    with PSClient([shard.address], options) as client:
        client.wait_connected()
        assert client.register(spec, SGD, worker_name="worker-0", initial_values=initial)
        dest = {k: torch.zeros_like(v) for k, v in initial.items()}
        client.pull(dest)
        client.push(grads)
        client.pull(dest)
    scrape = Scrape(shard.metrics_url)
    used, unused = ("lane", "grpc") if bulk else ("grpc", "lane")
    assert scrape.values("psserver_push_bytes_total", "transport") == {used: total, unused: 0}
    assert scrape.values("psserver_pull_bytes_total", "transport") == {used: 2 * total, unused: 0}
    assert scrape.value("psserver_pushes_total", outcome="applied") == 1


def test_shards_in_one_process_keep_their_metrics_apart_and_stop_serving_them(make_shard, open_stub):
    a, b = make_shard(), make_shard()
    assert a.metrics_port != b.metrics_port
    register(open_stub(a.address), "worker-0")
    assert Scrape(a.metrics_url).value("psserver_workers", state="live") == 1
    assert Scrape(b.metrics_url).value("psserver_workers", state="live") == 0
    url = a.metrics_url
    a.stop(grace=0)
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=RPC_TIMEOUT)


def test_a_metrics_port_in_use_is_a_clear_error(make_shard):
    taken = make_shard()
    with pytest.raises(RuntimeError, match=f"metrics port 127.0.0.1:{taken.metrics_port}"):
        create_server(ServerConfig(port=0, metrics_port=taken.metrics_port))


def test_without_a_metrics_port_there_is_no_endpoint():
    shard = create_server(ServerConfig(port=0))
    try:
        assert shard.metrics_port is None and shard.metrics_url is None
    finally:
        shard.stop(grace=0)


def test_calls_refused_before_their_handler_are_timed_with_their_code(make_shard, open_stub, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("reader reader-token-0123456789abcdef\n")
    tokens.chmod(0o600)
    shard = make_shard(auth_token_file=str(tokens))
    stub = open_stub(shard.address)
    expect_rpc_error(lambda: status(stub), grpc.StatusCode.UNAUTHENTICATED)
    reader = [("authorization", "Bearer reader-token-0123456789abcdef")]
    stub.Status(ps_pb2.StatusRequest(), timeout=RPC_TIMEOUT, metadata=reader)
    expect_rpc_error(lambda: stub.Register(ps_pb2.RegisterRequest(), timeout=RPC_TIMEOUT, metadata=reader),
                     grpc.StatusCode.PERMISSION_DENIED)
    # A method the service does not have is not a label value: the set stays closed.
    channel = grpc.insecure_channel(shard.address)
    try:
        with pytest.raises(grpc.RpcError):
            channel.unary_unary("/pswire.v1.ParameterServer/Nope")(b"", timeout=RPC_TIMEOUT)
    finally:
        channel.close()
    scrape = Scrape(shard.metrics_url)
    calls = {(s.labels["method"], s.labels["code"]): s.value
             for s in scrape.families["psserver_rpc_duration_seconds"].samples
             if s.name == "psserver_rpc_duration_seconds_count"}
    assert calls == {("Status", "UNAUTHENTICATED"): 1, ("Status", "OK"): 1, ("Register", "PERMISSION_DENIED"): 1}
