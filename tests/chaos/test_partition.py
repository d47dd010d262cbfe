"""A worker cut off by a real network partition: it runs in its own network namespace, joined to
the host by a veth pair, and the link is taken down for several leases. The shards evict it and
the others go on without it; once the link is back, its late (old-generation) gradient is never
applied, it re-registers, finishes its steps, and every push is accounted for exactly once.

Whether the worker's own late gradient reaches a shard depends on where the cut catches it (a
refused heartbeat or pull may tell it first, and then it drops the gradient unsent), so a second
process in the namespace plays that gradient deterministically: a push with the worker's
first-generation header, sent just after the cut and retried (as a worker retries) until the
link is back. Run as ``python -m tests.chaos.test_partition HOST:PORT,...``, this module is
that process."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import pytest

from pswire import errors
from pswire.codec import Part
from pswire.placement import model_spec
from pswire.v1 import ps_pb2
from psworker.client import ClientOptions, PSClient, ShardClient, parse_addresses
from psworker.config import parse_args
from psworker.retry import retrying
from psworker.tasks import load_task
from tests.conftest import ROOT, child_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

IP = shutil.which("ip") or "/usr/sbin/ip"
LEASE = 2.0
PARTITION = 4 * LEASE
"""How long the link stays down: long past the lease, and well short of the workers' RPC deadline
(--rpc-timeout, 30 s): a push or pull stalled past it fails with DEADLINE_EXCEEDED, which ends
the worker instead of leading it to re-register."""
STALENESS = 1
TASK = "mnist1d-mlp"
NS_STEPS = 200
HOST_STEPS = 300
"""More than the partitioned worker's: the workers start together (see ``_gate``) and under SSP
the others can be at most S + 1 steps ahead of it when it is cut off, so they still have work
left when it is evicted, whatever the machine's speed."""
CUT_AFTER = 10
"""Pushes the partitioned worker must have made on every shard before the link goes down."""

_links = itertools.count()


def _ip(*args: str) -> None:
    proc = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")


@dataclass(frozen=True)
class Link:
    """A network namespace joined to the host by a veth pair."""

    netns: str
    host_dev: str
    host_addr: str
    ns_addr: str

    def set(self, up: bool) -> None:
        # The host end: the namespace's packets to the shards are then dropped silently (no
        # carrier), as on a cut cable; the host's own traffic to host_addr goes through `lo`.
        _ip("link", "set", self.host_dev, "up" if up else "down")


@pytest.fixture
def link():
    """A fresh namespace and veth pair (names unique per process and test), removed afterwards
    whatever happens."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if not os.access(IP, os.X_OK):
        pytest.skip(f"no `ip` command ({IP}): iproute2 is not installed")
    pid, n = os.getpid() % 100000, next(_links)
    netns, host_dev, ns_dev = f"pstest-{pid}-{n}", f"psv{pid}{n}h", f"psv{pid}{n}n"
    base = 4 * (n % 64)
    host_addr, ns_addr = f"10.213.{pid % 256}.{base + 1}", f"10.213.{pid % 256}.{base + 2}"
    try:
        _ip("netns", "add", netns)
    except RuntimeError as exc:
        pytest.skip(f"`ip netns` is unavailable here: {exc}")
    try:
        _ip("link", "add", host_dev, "type", "veth", "peer", "name", ns_dev)
        _ip("link", "set", ns_dev, "netns", netns)
        _ip("addr", "add", f"{host_addr}/30", "dev", host_dev)
        _ip("link", "set", host_dev, "up")
        _ip("-n", netns, "addr", "add", f"{ns_addr}/30", "dev", ns_dev)
        _ip("-n", netns, "link", "set", ns_dev, "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        yield Link(netns, host_dev, host_addr, ns_addr)
    finally:
        # Deleting the namespace destroys its veth end, and with it the host's (done here too,
        # in case the namespace lingers while a process still holds it).
        for args in (("link", "del", host_dev), ("netns", "del", netns)):
            subprocess.run([IP, *args], capture_output=True, timeout=30)


@dataclass
class Worker:
    name: str
    popen: subprocess.Popen
    out_path: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def result(self, timeout: float) -> dict:
        self.popen.wait(timeout=timeout)
        assert self.popen.returncode == 0, f"{self.name} exited {self.popen.returncode}:\n{self.log()[-4000:]}"
        lines = [l for l in self.out_path.read_text().splitlines() if l.startswith("{")]
        return json.loads(lines[-1])


def _flags(ps: str) -> list[str]:
    return ["--ps", ps, "--num-workers", "3", "--threads", "1", "--task", TASK, "--mode", "ssp",
            "--staleness", str(STALENESS)]


def _start_worker(directory: Path, ps: str, index: int, steps: int, prefix: tuple[str, ...] = ()) -> Worker:
    name = f"worker-{index}"
    out_path, log_path = directory / f"{name}.out", directory / f"{name}.log"
    with open(out_path, "w") as out, open(log_path, "w") as log:
        popen = subprocess.Popen(
            [*prefix, sys.executable, "-m", "psworker", *_flags(ps), "--worker-index", str(index),
             "--progress", "log", "--steps", str(steps)],
            stdout=out, stderr=log, env=child_env(), cwd=ROOT,
        )
    return Worker(name, popen, out_path, log_path)


def _gate(ps: str) -> PSClient:
    """Define the job (the workers' model, optimizer and SSP setting) as a member that never
    pushes: nobody gets more than S + 1 clocks ahead of it, so the workers, however far apart
    they start, wait for one another until it leaves."""
    config = parse_args([*_flags(ps), "--worker-index", "0"], env={})
    task = load_task(TASK, seed=config.seed)
    values = {name: p.detach().contiguous() for name, p in task.model.named_parameters()}
    optimizer = config.optimizer_config(
        default_name=task.defaults.optimizer, default_lr=task.defaults.lr, default_momentum=task.defaults.momentum
    )
    # Spread over both shards as the workers spread it (tests/conftest.py SPREAD).
    client = PSClient(ps, ClientOptions(timeout=10, connect_timeout=30, pack_below=0))
    client.wait_connected()
    # The job identity psworker's training loop registers with.
    client.register(model_spec(values.items()), optimizer, worker_name="gate", job_fingerprint=f"task={TASK}",
                    initial_values=values, consistency=config.consistency())
    return client


def late_push(ps: str) -> None:
    """The late gradient, run inside the namespace once the job is defined. Connects to every
    shard and learns its parts, prints ``ready``, then reads one JSON line from stdin (per shard:
    the worker id, generation and clock to impersonate) and pushes a zero gradient of every part
    with that header to all shards at once. Prints one JSON line: each shard's answer."""
    options = ClientOptions(timeout=90, connect_timeout=60)
    clients = [ShardClient(address, options) for address in parse_addresses(ps)]
    parts: list[list[Part]] = []
    for client in clients:
        client.wait_connected(options.connect_timeout)
        parts.append([Part.from_proto(p) for p in client.status().parts])
        if not parts[-1]:
            raise RuntimeError(f"shard {client.address} holds no job yet")
    print("ready", flush=True)
    who = json.loads(sys.stdin.readline())

    def one(index: int) -> dict:
        header = ps_pb2.TensorHeader(
            worker_id=who[index]["worker_id"], generation=who[index]["generation"], sequence=1 << 40,
            base_version=0, parts=[p.to_proto() for p in parts[index]], clock=who[index]["clock"], base_clock=0,
        )
        buffers = [memoryview(bytes(p.nbytes)) for p in parts[index]]
        try:
            # As a worker does: a push cut off by the partition is retried until the link heals.
            reply = retrying(lambda: clients[index].push(header, buffers), options, clients[index].address, "late push")
        except errors.PSError as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
        return {"action": reply.action, "version": reply.version}

    with futures.ThreadPoolExecutor(len(clients)) as pool:
        answers = list(pool.map(one, range(len(clients))))
    print(json.dumps(answers), flush=True)


def _wait_until(predicate, timeout: float, what: str, logs=()):
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()  # never set: a timed pause between polls
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {w.name}:\n{w.log()[-2000:]}" for w in logs)
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{tails}")
        pause.wait(0.05)


def _entry(status, name: str):
    (entry,) = [w for w in status.workers if w.worker_name == name]
    return entry


def _on_every_shard(client: PSClient, predicate):
    """A poll for ``_wait_until``: every shard's status once ``predicate`` holds on all of them."""
    def poll():
        statuses = client.status()
        return statuses if all(predicate(s) for s in statuses) else None
    return poll


def test_partitioned_worker_is_evicted_fenced_and_rejoins(shards, link, tmp_path):
    a, b = shards(2, "--host", link.host_addr, "--lease-timeout", str(LEASE))
    ps = f"{link.host_addr}:{a.port},{link.host_addr}:{b.port}"
    gate = _gate(ps)
    admin = PSClient(ps, ClientOptions(timeout=5, connect_timeout=10))
    status = admin.status
    logs: list[Worker] = []  # every process started, for cleanup and for failure messages
    try:
        workers = [_start_worker(tmp_path, ps, i, HOST_STEPS) for i in range(2)]
        logs += workers
        cut = _start_worker(tmp_path, ps, 2, NS_STEPS, prefix=(IP, "netns", "exec", link.netns))
        workers.append(cut)
        logs.append(cut)
        late_out, late_log = tmp_path / "late-push.out", tmp_path / "late-push.log"
        with open(late_out, "w") as out, open(late_log, "w") as log:
            late = Worker("late-push", subprocess.Popen(
                [IP, "netns", "exec", link.netns, sys.executable, "-m", "tests.chaos.test_partition", ps],
                stdin=subprocess.PIPE, stdout=out, stderr=log, text=True, env=child_env(), cwd=ROOT,
            ), late_out, late_log)
        logs.append(late)
        _wait_until(
            lambda: all(len(s.workers) == 4 for s in status()) and late_out.read_text().startswith("ready"),
            180, "every worker to join and the late pusher to connect", logs,
        )
        gate.leave()
        gate.close()
        _wait_until(
            _on_every_shard(admin, lambda s: _entry(s, cut.name).pushes >= CUT_AFTER),
            120, f"{cut.name} (in namespace {link.netns}) to push {CUT_AFTER} times to every shard", logs,
        )
        link.set(up=False)
        down_at = time.monotonic()
        before = status()
        # A gradient of the worker's first generation, now in flight in the stalled connection.
        late.popen.stdin.write(json.dumps([
            {"worker_id": _entry(s, cut.name).worker_id, "generation": _entry(s, cut.name).generation,
             "clock": _entry(s, cut.name).clock} for s in before
        ]) + "\n")
        late.popen.stdin.close()
        for s in before:
            assert _entry(s, cut.name).live and s.workers_evicted == 0
            # The SSP bound: nobody is more than S + 1 clocks ahead of the worker being cut off.
            assert max(w.clock for w in s.workers if w.live) <= _entry(s, cut.name).clock + STALENESS + 1

        evicted = _wait_until(
            _on_every_shard(admin, lambda s: s.workers_evicted == 1), PARTITION, f"the shards to evict {cut.name}", logs,
        )
        evict_seconds = time.monotonic() - down_at
        for s in evicted:
            gone = _entry(s, cut.name)
            assert gone.evicted and not gone.live and gone.generation == 1
        # Lease plus one reaper period (a quarter lease) plus scheduling slack.
        assert evict_seconds <= LEASE * 1.25 + 1.5, evict_seconds

        # SSP membership shrank at once: the others, held back by the silent worker until now,
        # move on while it is still cut off.
        clock_at_evict = min(s.clock for s in evicted)
        moved = _wait_until(
            _on_every_shard(admin, lambda s: s.clock >= clock_at_evict + 5),
            PARTITION, "the other workers to advance 5 clocks without the cut-off one", logs,
        )
        assert all(_entry(s, cut.name).pushes == _entry(e, cut.name).pushes for s, e in zip(moved, evicted))
        # Hold the partition for its full length (a scenario duration, not a synchronisation).
        threading.Event().wait(max(0.0, PARTITION - (time.monotonic() - down_at)))
        assert cut.popen.poll() is None, f"{cut.name} ended while cut off:\n{cut.log()[-3000:]}"
        link.set(up=True)
        healed_at = time.monotonic()
        down_seconds = healed_at - down_at

        seen: dict[str, float] = {}  # event -> seconds after the heal it was first seen

        def recovered() -> bool:
            if "late" not in seen and len(late_out.read_text().splitlines()) >= 2:
                seen["late"] = time.monotonic() - healed_at
            if "rejoin" not in seen and all(
                _entry(s, cut.name).generation >= 2 and _entry(s, cut.name).live for s in status()
            ):
                seen["rejoin"] = time.monotonic() - healed_at
            return len(seen) == 2

        _wait_until(recovered, 90, f"{cut.name} to re-register and the late push to be answered", logs)
        late.popen.wait(timeout=30)
        answers = json.loads(late_out.read_text().splitlines()[-1])

        results = {w.name: w.result(timeout=300) for w in workers}
        final = status()
    finally:
        admin.close()
        gate.close()
        for w in logs:
            if w.popen.poll() is None:
                w.popen.kill()
                w.popen.wait(timeout=30)

    assert results[cut.name]["steps"] == NS_STEPS and results[cut.name]["rejoins"] >= 1
    assert [results[f"worker-{i}"]["steps"] for i in range(2)] == [HOST_STEPS] * 2
    assert [results[f"worker-{i}"]["rejoins"] for i in range(2)] == [0, 0]
    cut_log = cut.log()
    assert f"{cut.name} re-registered and pulled" in cut_log, cut_log[-3000:]
    # The late first-generation gradient was refused as fenced (ABORTED), never applied.
    assert [a.get("error") for a in answers] == ["FencedError"] * 2, answers

    # Every step pushes once to each shard. The cut-off worker lost at most one gradient per
    # rejoin: the one of the step in which it learnt it was fenced off (by a refused heartbeat,
    # push or pull; after a refused pull, that step's push had been applied before the cut). Each
    # shard applies its slice of a push on its own, so a cut in the middle of a push's fan-out
    # leaves it applied on one shard and refused on the other: the counts may differ by shard.
    rejoins = results[cut.name]["rejoins"]
    counts = [(s.address, [(w.worker_name, w.generation, w.pushes) for w in s.workers], s.pushes_applied,
               s.pushes_dropped, s.pushes_rejected, s.pushes_received) for s in final]
    cut_pushes = [_entry(s, cut.name).pushes for s in final]
    assert all(NS_STEPS - rejoins <= n <= NS_STEPS for n in cut_pushes), (rejoins, counts)
    for s in final:
        assert s.workers_evicted == 1, s.workers_evicted
        entry = _entry(s, cut.name)
        assert entry.generation == 1 + rejoins and not entry.evicted and not entry.live
        assert [_entry(s, f"worker-{i}").pushes for i in range(2)] == [HOST_STEPS] * 2
        # Each push handled once: applied or dropped as stale, never both, never twice.
        handled = sum(w.pushes for w in s.workers)
        assert s.pushes_applied + s.pushes_dropped == handled, (s.pushes_applied, s.pushes_dropped, handled)
        assert s.version == s.pushes_applied
        # Refused: the late push, and at most one push of the worker's per rejoin.
        assert 1 <= s.pushes_rejected <= 1 + rejoins, (s.pushes_rejected, rejoins)
        # Received = handled + refused (+ retries acknowledged again: none here).
        assert s.pushes_received == handled + s.pushes_rejected, (s.pushes_received, handled, s.pushes_rejected)
    print(
        f"\npartition: cut at clock {_entry(before[0], cut.name).clock} of {NS_STEPS}; "
        f"link down {down_seconds:.1f}s (lease {LEASE}s); evicted {evict_seconds:.2f}s after the cut; "
        f"others advanced clock {clock_at_evict} -> {min(s.clock for s in moved)} while it was cut off; "
        f"re-registered {seen['rejoin']:.2f}s after the link came back (rejoins: {rejoins}); "
        f"late push answered {seen['late']:.2f}s after the heal: {[a.get('error') for a in answers]}; "
        f"gradients the cut-off worker lost per shard: {[NS_STEPS - n for n in cut_pushes]}; "
        f"per shard applied/dropped/rejected/received "
        f"{[(s.pushes_applied, s.pushes_dropped, s.pushes_rejected, s.pushes_received) for s in final]}"
    )


if __name__ == "__main__":
    late_push(sys.argv[1])
