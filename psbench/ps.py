"""Measurements against real ``psserver`` processes, driven with the public client
``psworker.client.PSClient`` as a worker would: goodput of push + pull rounds (also of several
setups served at once, their rounds alternated: TLS against plaintext), latency of small pulls
and pushes, and a shard's peak memory against the bytes it holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from psbench.procs import Child, Children
from psbench.stats import LatencySummary, median, repetitions
from pswire.optim import OptimizerConfig
from pswire.placement import model_spec
from pswire.security import ClientSecurity
from psworker.client import ClientOptions, PSClient

__all__ = ["ADAM", "CallCost", "GoodputResult", "LatencyResult", "Setup", "bench_model", "measure_goodput",
           "measure_goodput_alternated", "measure_small_latency", "start_shards"]

MIB = 1 << 20
_COLUMNS = 1024  # a row of the big matrix is 4 KiB of float32
_SMALL_VARIABLES = ("bias_a", "bias_b")

# SGD without momentum keeps no optimizer state and applies in one in-place op, so the figures
# measure moving bytes, not arithmetic.
_SGD = OptimizerConfig(name="sgd", lr=1e-3)
ADAM = OptimizerConfig(name="adam", lr=1e-3)
"""An optimizer with state (two moments per variable) for the shard-memory figure beside SGD's."""


def bench_model(size_mib: int) -> dict[str, torch.Tensor]:
    """A model of exactly ``size_mib`` MiB of float32: one ``(rows, 1024)`` matrix and two small
    vectors, like a wide layer with its biases. Raises ``ValueError`` below 1 MiB."""
    if size_mib < 1:
        raise ValueError(f"model size must be >= 1 MiB, got {size_mib}")
    rows = size_mib * MIB // (4 * _COLUMNS) - len(_SMALL_VARIABLES)
    model = {"weight": torch.full((rows, _COLUMNS), 0.5)}
    for name in _SMALL_VARIABLES:
        model[name] = torch.full((_COLUMNS,), 0.5)
    return model


def start_shards(children: Children, count: int, *extra: str, timeout: float = 120.0) -> list[tuple[Child, str]]:
    """Start ``count`` shards on loopback ports chosen at run time; returns (child, address)."""
    launched = [children.launch_server(f"shard{i}", "psserver", "--host", "127.0.0.1", *extra) for i in range(count)]
    return [(child, f"127.0.0.1:{children.wait_port(child, port_file, timeout)}") for child, port_file in launched]


def _client(addresses: list[str], *, bulk: bool = True, security: ClientSecurity | None = None) -> PSClient:
    # Deadlines generous enough for a loaded two-core machine moving hundreds of MiB.
    return PSClient.connected(addresses, ClientOptions(timeout=120.0, min_bandwidth=5e6, connect_timeout=120.0,
                                                       bulk=bulk, security=security))


@dataclass(frozen=True)
class GoodputResult:
    """Push + pull rounds of one model on one set of shards, and what the shards held."""

    size_mib: int
    shards: int
    bytes_per_round: int
    """Bytes pushed plus bytes pulled in one round (twice the model)."""
    round_seconds: list[float]
    push_seconds: list[float]
    pull_seconds: list[float]
    init_seconds: float
    """Registration with the upload of the initial values (not part of the goodput)."""
    shard_idle_rss_bytes: list[int]
    """Each shard's resident memory right after start, before it held anything."""
    shard_peak_rss_bytes: list[int]
    """Each shard's peak resident memory (VmHWM) after the rounds."""
    shard_held_bytes: list[int]
    """Variables plus optimizer state each shard reported holding."""
    client_cpu_seconds: float
    """CPU time of this (client) process per timed round, all threads."""
    shard_cpu_seconds: float
    """CPU time of all shards together per timed round."""
    reference_seconds: list[float]
    """The paired reference transfer of ``bytes_per_round`` run before each timed round (empty
    without a reference)."""
    transport: str = "lanes"
    """``lanes``: large bytes on the bulk lanes (the default); ``grpc``: every byte through gRPC."""
    tls: bool = False
    """Shards and client talked (mutual) TLS, on gRPC and the lanes alike."""

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_per_round / median(self.round_seconds)

    @property
    def reference_bytes_per_second(self) -> float | None:
        return self.bytes_per_round / median(self.reference_seconds) if self.reference_seconds else None

    @property
    def cpu_seconds_per_mib(self) -> float:
        """Client plus shard CPU seconds per MiB moved: unlike the goodput, barely changed by
        other processes competing for the cores."""
        return (self.client_cpu_seconds + self.shard_cpu_seconds) / (self.bytes_per_round / MIB)

    @property
    def push_bytes_per_second(self) -> float:
        return self.bytes_per_round / 2 / median(self.push_seconds)

    @property
    def pull_bytes_per_second(self) -> float:
        return self.bytes_per_round / 2 / median(self.pull_seconds)

    def to_dict(self) -> dict:
        return {
            "size_mib": self.size_mib,
            "shards": self.shards,
            "transport": self.transport,
            "tls": self.tls,
            "bytes_per_round": self.bytes_per_round,
            "bytes_per_second": self.bytes_per_second,
            "push_bytes_per_second": self.push_bytes_per_second,
            "pull_bytes_per_second": self.pull_bytes_per_second,
            "reps": len(self.round_seconds),
            "round_seconds": repetitions(self.round_seconds),
            "init_seconds": round(self.init_seconds, 3),
            "shard_idle_rss_bytes": self.shard_idle_rss_bytes,
            "shard_peak_rss_bytes": self.shard_peak_rss_bytes,
            "shard_held_bytes": self.shard_held_bytes,
            "client_cpu_seconds_per_round": self.client_cpu_seconds,
            "shard_cpu_seconds_per_round": self.shard_cpu_seconds,
            "cpu_seconds_per_mib": self.cpu_seconds_per_mib,
            "paired_tcp_bytes_per_second": self.reference_bytes_per_second,
            "paired_tcp_seconds": repetitions(self.reference_seconds),
            "push_seconds": repetitions(self.push_seconds),
            "pull_seconds": repetitions(self.pull_seconds),
        }


Reference = Callable[[], float]
"""A paired baseline (one TCP transfer, one echo call) that returns its own seconds."""


class _Paired:
    """Runs a reference before each measured call; keeps its times, and the client CPU it used
    so that it can be left out of the measured calls' CPU."""

    def __init__(self, reference: Reference | None) -> None:
        self._reference = reference
        self.seconds: list[float] = []
        self.cpu_seconds = 0.0

    def __call__(self, *, record: bool = True) -> None:
        """Run the reference once; ``record=False`` (warm-up, before any CPU meter starts)
        keeps neither its time nor its CPU."""
        if self._reference is None:
            return
        cpu = time.process_time()
        seconds = self._reference()
        if record:
            self.cpu_seconds += time.process_time() - cpu
            self.seconds.append(seconds)


@dataclass(frozen=True, kw_only=True)
class Setup:
    """How the shards of a goodput measurement start and how the client reaches them."""

    bulk: bool = True
    """Bytes above 256 KiB per shard on the bulk lanes; False: shards with ``--bulk-port -1``,
    every byte through gRPC."""
    optimizer: OptimizerConfig = _SGD
    """The shards' update rule (SGD without momentum by default: no state, one in-place op)."""
    shard_flags: tuple[str, ...] = ()
    """More ``psserver`` flags (``--tls-cert ...``)."""
    security: ClientSecurity | None = None
    """The client's TLS material, for shards started with TLS flags."""

    @property
    def tls(self) -> bool:
        return self.security is not None and self.security.tls


class _Rounds:
    """Fresh shards serving one registered model of ``size_mib`` MiB, and a client that runs
    push + pull rounds on it. Leaving the ``with`` block closes the client and stops the shards."""

    def __init__(self, children: Children, size_mib: int, shards: int, setup: Setup) -> None:
        self.size_mib = size_mib
        self.setup = setup
        self._children = children
        self._shards = shards
        self._stack = ExitStack()

    def __enter__(self) -> "_Rounds":
        setup = self.setup
        extra = (() if setup.bulk else ("--bulk-port", "-1")) + setup.shard_flags
        try:
            self.started = start_shards(self._children, self._shards, *extra)
            for child, _ in self.started:
                self._stack.callback(self._children.stop, child)
            self.idle = [child.rss_bytes() for child, _ in self.started]
            model = bench_model(self.size_mib)
            self.nbytes = sum(t.numel() * t.element_size() for t in model.values())
            self._grads = {name: torch.full_like(t, 1e-3) for name, t in model.items()}
            self._dest = {name: torch.empty_like(t) for name, t in model.items()}
            self.client = self._stack.enter_context(
                _client([address for _, address in self.started], bulk=setup.bulk, security=setup.security))
            began = time.perf_counter()
            self.client.register(model_spec(model.items()), setup.optimizer, worker_name="psbench",
                                 initial_values=model)
            self.init_seconds = time.perf_counter() - began
            del model  # the shards hold it now; keep this process's memory out of their way
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @property
    def shard_children(self) -> list[Child]:
        return [child for child, _ in self.started]

    def round(self) -> tuple[float, float]:
        """One push of a full gradient, then a pull of every variable; their seconds."""
        t0 = time.perf_counter()
        self.client.push(self._grads)
        t1 = time.perf_counter()
        self.client.pull(self._dest, skip_unchanged=False)
        return t1 - t0, time.perf_counter() - t1

    def result(self, push: list[float], pull: list[float], client_cpu: float, shard_cpu: float,
               reference_seconds: list[float]) -> GoodputResult:
        """The figures of the timed rounds, with what the shards hold and their peak memory now.
        Raises ``RuntimeError`` if the shards do not hold the whole model."""
        statuses = self.client.status()
        peak = [child.peak_rss_bytes() for child in self.shard_children]
        held = [s.bytes_held + s.optimizer_state_bytes for s in statuses]
        if sum(s.bytes_held for s in statuses) != self.nbytes:
            raise RuntimeError(f"the shards report holding {sum(s.bytes_held for s in statuses)} bytes "
                               f"of a {self.nbytes}-byte model")
        return GoodputResult(self.size_mib, self._shards, 2 * self.nbytes, [a + b for a, b in zip(push, pull)],
                             push, pull, self.init_seconds, self.idle, peak, held, client_cpu, shard_cpu,
                             reference_seconds, "lanes" if self.setup.bulk else "grpc", self.setup.tls)


def measure_goodput(
    children: Children, size_mib: int, shards: int, *, reps: int, warmup: int,
    reference: Callable[[int], float] | None = None, bulk: bool = True, optimizer: OptimizerConfig = _SGD,
) -> GoodputResult:
    """Start ``shards`` fresh shards, register a ``size_mib`` model, then time ``warmup`` +
    ``reps`` rounds of a push of a full gradient followed by a pull of every variable.
    ``reference(nbytes)``, when given, runs before each round with the round's byte count (a
    TCP transfer: the ratio's other side under the same load). The shards are stopped before
    returning. ``bulk=False``: shards without bulk lanes, every byte through gRPC. ``optimizer``:
    the shards' update rule (SGD without momentum by default: no state, one in-place op). Raises
    ``pswire.errors.PSError`` or ``ChildError``."""
    with _Rounds(children, size_mib, shards, Setup(bulk=bulk, optimizer=optimizer)) as rounds:
        paired = _Paired(None if reference is None else lambda: reference(2 * rounds.nbytes))
        for _ in range(warmup):
            paired(record=False)
            rounds.round()
        push, pull = [], []
        cpu = _CpuMeter(rounds.shard_children)
        for _ in range(reps):
            paired()
            seconds = rounds.round()
            push.append(seconds[0])
            pull.append(seconds[1])
        client_cpu, shard_cpu = cpu.per_call(reps, exclude=paired.cpu_seconds)
        return rounds.result(push, pull, client_cpu, shard_cpu, paired.seconds)


def measure_goodput_alternated(
    children: Children, size_mib: int, shards: int, setups: Sequence[Setup], *, reps: int, warmup: int,
) -> list[GoodputResult]:
    """The goodput of one model under each of ``setups``, all served at once, their rounds
    alternated: each repetition runs one round of every setup, in an order that rotates, so
    that a change in the machine's load touches them alike and round ``i`` of each result
    comes from the same repetition. Client CPU is counted round by round, shard CPU over all
    rounds (a setup's shards idle while another's rounds run). Raises like :func:`measure_goodput`."""
    with ExitStack() as stack:
        rigs = [stack.enter_context(_Rounds(children, size_mib, shards, setup)) for setup in setups]
        for _ in range(warmup):
            for rig in rigs:
                rig.round()
        push: list[list[float]] = [[] for _ in rigs]
        pull: list[list[float]] = [[] for _ in rigs]
        client_cpu = [0.0] * len(rigs)
        meters = [_CpuMeter(rig.shard_children) for rig in rigs]
        for rep in range(reps):
            for k in range(len(rigs)):
                i = (rep + k) % len(rigs)
                cpu = time.process_time()
                seconds = rigs[i].round()
                client_cpu[i] += time.process_time() - cpu
                push[i].append(seconds[0])
                pull[i].append(seconds[1])
        shard_cpu = [meter.per_call(reps)[1] for meter in meters]
        return [rig.result(push[i], pull[i], client_cpu[i] / reps, shard_cpu[i], [])
                for i, rig in enumerate(rigs)]


class _CpuMeter:
    """CPU time used by this process and by some children from now on."""

    def __init__(self, children: list[Child]) -> None:
        self._children = children
        self._client = time.process_time()
        self._shards = sum(child.cpu_seconds() for child in children)

    def per_call(self, calls: int, *, exclude: float = 0.0) -> tuple[float, float]:
        """(this process, the children together) CPU seconds per call since construction,
        leaving out ``exclude`` seconds this process spent on something else meanwhile."""
        client = time.process_time() - self._client - exclude
        shards = sum(child.cpu_seconds() for child in self._children) - self._shards
        return client / calls, shards / calls


@dataclass(frozen=True)
class CallCost:
    """Latency of one kind of small call, and the CPU time it costs on each side."""

    latency: LatencySummary
    client_cpu_seconds: float
    """CPU time of this (client) process per call."""
    shard_cpu_seconds: float
    """CPU time of the shard per call."""
    reference: LatencySummary | None
    """The paired reference calls (one before each measured call), if any."""

    def to_dict(self) -> dict:
        out = {**vars(self.latency), "client_cpu_seconds_per_call": self.client_cpu_seconds,
               "shard_cpu_seconds_per_call": self.shard_cpu_seconds}
        if self.reference is not None:
            out["paired_echo_p50_seconds"] = self.reference.p50_seconds
            out["paired_echo_p99_seconds"] = self.reference.p99_seconds
        return out


@dataclass(frozen=True)
class LatencyResult:
    variable_bytes: int
    pull: CallCost
    push: CallCost


def measure_small_latency(
    children: Children, variable_bytes: int, *, calls: int, warmup: int, reference: Reference | None = None
) -> LatencyResult:
    """Latency of sequential pulls (every byte sent, nothing skipped) and pushes of a job that
    holds one ``variable_bytes`` variable on one shard; ``reference`` (an echo call), when
    given, runs before each call. Raises like :func:`measure_goodput`."""
    ((child, address),) = start_shards(children, 1)
    try:
        value = torch.zeros(variable_bytes // 4)
        grad = torch.full_like(value, 1e-3)
        with _client([address]) as client:
            client.register(model_spec([("small", value)]), _SGD, worker_name="psbench",
                            initial_values={"small": value})
            dest = {"small": torch.empty_like(value)}
            pull = _cost(lambda: client.pull(dest, skip_unchanged=False), child, calls, warmup, reference)
            push = _cost(lambda: client.push({"small": grad}), child, calls, warmup, reference)
        return LatencyResult(variable_bytes, pull, push)
    finally:
        children.stop(child)


def _cost(call: Callable[[], object], shard: Child, calls: int, warmup: int, reference: Reference | None) -> CallCost:
    paired = _Paired(reference)
    for _ in range(warmup):
        paired(record=False)
        call()
    seconds = []
    for _ in range(calls):
        paired()
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    # CPU in a pass of its own: gRPC finishes a call on background threads after it returns,
    # and that work would land in the reference's time if the two were interleaved.
    cpu = _CpuMeter([shard])
    for _ in range(calls):
        call()
    client_cpu, shard_cpu = cpu.per_call(calls)
    return CallCost(LatencySummary.of(seconds), client_cpu, shard_cpu,
                    LatencySummary.of(paired.seconds) if paired.seconds else None)
