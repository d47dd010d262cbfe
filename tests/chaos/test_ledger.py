"""The ps-lite ledger check against real shard processes: many workers push known integer
increments while duplicates and retries are injected, and the final value of every variable
equals its initial value minus the sum of the acknowledged increments, exactly.

Faults injected, each on some of the workers:

- duplicates: every push sent twice with the same (worker id, generation, sequence) header; the
  second is acknowledged with the first's reply and not applied;
- lost replies: a TCP proxy between the worker and a shard forwards the push, then cuts the
  connection when the shard's reply starts (so the shard applied it and the worker never heard);
  the client's own retry resends it and the shard acknowledges it again without applying it;
- lost requests: the proxy cuts the connection as the push starts (the shard never sees it);
  the retry is the first copy the shard gets, and is applied once;
- late duplicates: after training, a push far older than the dedupe window and one inside it
  are sent again; the old one is refused (its outcome is no longer known, so it is never
  acknowledged as applied), the recent one acknowledged with its reply, and neither applied.

With SGD at lr = 1 a gradient g changes a variable by exactly -g; the increments are integers in
float64, so every sum is exact and any push applied twice (or lost) shows in the final values.
"""

from __future__ import annotations

import socket
import threading
from collections import Counter
from concurrent import futures
from dataclasses import dataclass, field

import pytest
import torch

from pswire import errors
from pswire.consistency import Consistency
from pswire.optim import OptimizerConfig
from pswire.placement import model_spec
from psworker.client import ClientOptions, PSClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WORKERS = 8
STEPS = 80
"""Pushes per worker and shard: more than the shards' dedupe window (64), so the late duplicate
of the first push comes from beyond the window."""
FAULT_EVERY = 7
"""A proxied worker loses the request or the reply of every FAULT_EVERY-th push (on one shard)."""
SHAPES = {"a": (5,), "b": (3, 4), "c": (7,), "d": (2, 2, 2)}
OPTIMIZER = OptimizerConfig(name="sgd", lr=1.0)
OPTIONS = ClientOptions(timeout=30, connect_timeout=30, retry_timeout=60, lane_calls=False, pack_below=0)
"""The faults are injected into gRPC's HTTP/2 frames, so the small calls stay on gRPC (a lost reply
on a bulk lane: tests/security/test_lane_calls.py), and the model is spread over both shards,
as the tests' workers spread theirs (tests/conftest.py SPREAD)."""

_HEADERS = 1
"""HTTP/2 frame type of a request's or a reply's start (gRPC sends a reply's headers only once
the handler has returned, so a push is handled by the time its reply's HEADERS frame leaves)."""
_PREFACE = len(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")


def initial_values() -> dict[str, torch.Tensor]:
    return {
        name: torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) * 10 + 1000
        for name, shape in SHAPES.items()
    }


def increment(worker: int, step: int, name: str) -> torch.Tensor:
    """The gradient worker ``worker`` pushes at ``step``: integers unique to (worker, step)."""
    shape = SHAPES[name]
    base = (worker + 1) * 1000 + step
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) + base


class FlakyProxy:
    """Forwards TCP connections from a local port to a shard, reading HTTP/2 frame by frame, and
    can cut a connection at the next request start (``arm("request")``) or reply start
    (``arm("reply")``). Only one RPC at a time runs on the connection when it is armed."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()  # guards _armed, cuts and _sockets
        self._armed: str | None = None
        self.cuts: Counter[str] = Counter()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def arm(self, where: str) -> None:
        with self._lock:
            self._armed = where

    def armed(self) -> str | None:
        with self._lock:
            return self._armed

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self._target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()  # the client sees the connection drop, and reconnects
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst, direction in ((client, upstream, "request"), (upstream, client, "reply")):
                threading.Thread(target=self._pump, args=(src, dst, direction, (client, upstream)),
                                 name=f"proxy-{direction}", daemon=True).start()

    def _take(self, direction: str) -> bool:
        with self._lock:
            if self._armed != direction:
                return False
            self._armed = None
            self.cuts[direction] += 1
            return True

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str, pair) -> None:
        buffer, preface = b"", _PREFACE if direction == "request" else 0
        try:
            while data := src.recv(1 << 16):
                buffer += data
                out = b""
                if preface:
                    out, buffer, preface = buffer[:preface], buffer[preface:], max(0, preface - len(buffer))
                while len(buffer) >= 9:
                    end = 9 + int.from_bytes(buffer[:3], "big")
                    if len(buffer) < end:
                        break
                    frame, buffer = buffer[:end], buffer[end:]
                    if frame[3] == _HEADERS and self._take(direction):
                        raise ConnectionAbortedError(f"cut at the {direction} start")
                    out += frame
                dst.sendall(out)
        except OSError:
            pass
        for sock in pair:  # either side ending ends both: the client sees the connection drop
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()


class DuplicatingShard:
    """Stands in for one session's ShardClient: sends every push twice with the same header and
    checks that the second is acknowledged with the first's reply."""

    def __init__(self, inner, stats: "Stats", shard: int) -> None:
        self._inner, self._stats, self._shard = inner, stats, shard
        self.sent: list = []
        """(header, buffers, reply) of every push, in order."""

    def push(self, header, buffers):
        reply = self._inner.push(header, buffers)
        again = self._inner.push(header, buffers)
        assert (again.version, again.staleness, again.action) == (reply.version, reply.staleness, reply.action)
        self._stats.add(duplicates=Counter({self._shard: 1}))
        self.sent.append((header, [bytes(b) for b in buffers], reply))
        return reply

    def __getattr__(self, name):
        return getattr(self._inner, name)


@dataclass
class Stats:
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards the counters below
    applied: Counter = field(default_factory=Counter)
    """Shard -> acknowledged pushes the shard reported as applied."""
    dropped: Counter = field(default_factory=Counter)
    """Shard -> acknowledged pushes the shard reported as dropped (ssp, too stale)."""
    duplicates: Counter = field(default_factory=Counter)
    """Shard -> extra copies of handled pushes that reached the shard (acknowledged again)."""
    per_worker: Counter = field(default_factory=Counter)
    """(worker name, shard) -> acknowledged pushes."""

    def add(self, **counts: Counter) -> None:
        with self.lock:
            for name, counter in counts.items():
                getattr(self, name).update(counter)


def _train(index: int, addresses: list[str], consistency: Consistency, stats: Stats, proxies) -> dict[str, torch.Tensor]:
    """One worker: pull, push this step's known increments, repeat. Returns the sum of the
    increments the shards acknowledged as applied, per variable."""
    name = f"worker-{index}"
    values = initial_values()
    ledger = {n: torch.zeros(SHAPES[n], dtype=torch.float64) for n in SHAPES}
    with PSClient(addresses, OPTIONS) as client:
        client.wait_connected()
        client.register(model_spec(values.items()), OPTIMIZER, worker_name=name, job_fingerprint="ledger",
                        initial_values=values, consistency=consistency)
        placement = client.placement
        held = [{p.name for p in parts} for parts in placement.shards]
        duplicating = index in (2, 3)
        if duplicating:
            # Reading the client's private sessions is the test's way in below the retry logic.
            for shard, session in enumerate(client._sessions):
                session.client = DuplicatingShard(session.client, stats, shard)
        try:
            for step in range(1, STEPS + 1):
                client.pull(values)
                if proxies and step % FAULT_EVERY == 0:
                    proxies[step // FAULT_EVERY % len(proxies)].arm("reply" if index in (4, 5) else "request")
                grads = {n: increment(index, step, n) for n in SHAPES}
                replies = client.push(grads)
                for shard, reply in enumerate(replies):
                    assert reply is not None and reply.action in ("apply", "drop"), reply
                    stats.add(**{"applied" if reply.action == "apply" else "dropped": Counter({shard: 1})},
                              per_worker=Counter({(name, shard): 1}))
                    if reply.action == "apply":
                        for n in held[shard]:
                            ledger[n] += grads[n]
            assert not any(p.armed() for p in proxies), "an injected fault never fired"
            if duplicating:
                # Late duplicates: the first push, beyond the dedupe window by now, is refused (its
                # outcome is no longer known, so it is never acknowledged as applied), and a recent
                # one must get its original reply again. Neither is applied again.
                for shard, session in enumerate(client._sessions):
                    first, recent = session.client.sent[0], session.client.sent[-3]
                    with pytest.raises(errors.PreconditionError, match="not known"):
                        session.client._inner.push(first[0], [memoryview(b) for b in first[1]])
                    again = session.client._inner.push(recent[0], [memoryview(b) for b in recent[1]])
                    stats.add(duplicates=Counter({shard: 2}))
                    assert (again.version, again.action) == (recent[2].version, recent[2].action)
        finally:
            client.leave()  # so that no ssp peer waits on this worker, even when it failed
    return ledger


@pytest.mark.parametrize(
    "consistency",
    [Consistency(), Consistency(mode="ssp", staleness=2)],
    ids=["async", "ssp"],
)
def test_final_values_equal_the_sum_of_acknowledged_pushes(shards, consistency):
    started = shards(2, "--lease-timeout", "0")  # no leases: no heartbeats share the proxied connections
    direct = [s.address for s in started]
    proxies = {i: [FlakyProxy(a) for a in direct] for i in (4, 5, 6, 7)}
    stats = Stats()
    try:
        with futures.ThreadPoolExecutor(WORKERS) as pool:
            jobs = [
                pool.submit(_train, i, [p.address for p in proxies[i]] if i in proxies else direct,
                            consistency, stats, proxies.get(i, []))
                for i in range(WORKERS)
            ]
            ledgers = [job.result(timeout=240) for job in jobs]
    finally:
        for pair in proxies.values():
            for proxy in pair:
                proxy.close()

    expected = initial_values()
    for ledger in ledgers:
        for n in SHAPES:
            expected[n] -= ledger[n]
    final = {n: torch.full(SHAPES[n], float("nan"), dtype=torch.float64) for n in SHAPES}
    with PSClient(direct, OPTIONS) as reader:
        reader.set_placement(model_spec(final.items()))
        reader.pull(final, skip_unchanged=False, wait=False)
        status = reader.status()
    for n in SHAPES:
        assert torch.equal(final[n], expected[n]), (n, final[n], expected[n])

    cuts = Counter()
    shard_cuts = [Counter(), Counter()]
    for pair in proxies.values():
        for shard, proxy in enumerate(pair):
            cuts.update(proxy.cuts)
            shard_cuts[shard].update(proxy.cuts)
    faults = len(proxies) * (STEPS // FAULT_EVERY)
    assert cuts["reply"] + cuts["request"] == faults, cuts
    for shard, s in enumerate(status):
        assert s.pushes_rejected == 2  # each duplicating worker's late copy from beyond the window
        assert s.pushes_applied == stats.applied[shard] and s.pushes_dropped == stats.dropped[shard]
        assert s.version == s.pushes_applied
        # Every copy that reached the shard is accounted for: handled once, or acknowledged again.
        # A lost reply's retry reached it twice; a lost request's first copy never did.
        assert s.pushes_received == (
            stats.applied[shard] + stats.dropped[shard] + stats.duplicates[shard] + shard_cuts[shard]["reply"]
        ), (s.pushes_received, stats, shard_cuts[shard])
        for w in s.workers:
            assert w.pushes == stats.per_worker[(w.worker_name, shard)] == STEPS, (w.worker_name, w.pushes)
    assert sum(stats.applied.values()) + sum(stats.dropped.values()) == WORKERS * STEPS * len(status)
    print(
        f"\nledger ({consistency.describe()}): {WORKERS} workers x {STEPS} pushes x {len(status)} shards; "
        f"applied {dict(stats.applied)}, dropped {dict(stats.dropped)}, duplicates acknowledged again "
        f"{dict(stats.duplicates)}, replies lost and retried {cuts['reply']}, requests lost and retried "
        f"{cuts['request']}; received per shard {[s.pushes_received for s in status]}; final values exact"
    )
