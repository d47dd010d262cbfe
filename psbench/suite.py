"""One benchmark run: every planned section in order, each into its part of the results
document. A section that fails is recorded under ``errors`` and the others still run, so one
broken figure does not cost the rest of a long run.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

from psbench import baselines, environment
from psbench.checks import compute_checks
from psbench.config import Plan
from psbench.procs import Children
from psbench.ps import ADAM, GoodputResult, measure_goodput, measure_small_latency
from pswire.codec import DEFAULT_CHUNK_BYTES
from psworker.tasks import _mnist1d_arrays

__all__ = ["SCHEMA", "run"]

log = logging.getLogger(__name__)

SCHEMA = 1
"""Version of the results document's layout."""

MIB = 1 << 20
_MEMORY_SLACK_BYTES = 200 * MIB


class _Run:
    def __init__(self, plan: Plan, children: Children) -> None:
        self.plan = plan
        self.children = children
        self.results: dict = {}
        self.goodput: dict[tuple[int, int], GoodputResult] = {}
        # Paired references, kept from the baselines section to the end of the run.
        self.tcp: baselines.TcpClient | None = None
        self.echo: baselines.EchoClient | None = None

    def close(self) -> None:
        for client in (self.tcp, self.echo):
            if client is not None:
                client.close()

    # -- sections ------------------------------------------------------------------------------

    def baselines(self) -> dict:
        plan = self.plan
        tcp_server, tcp_port = self.children.start_server("tcp-sink", "psbench.servers", "tcp")
        grpc_server, grpc_port = self.children.start_server("bare-grpc", "psbench.servers", "grpc",
                                                            "--chunk-bytes", str(DEFAULT_CHUNK_BYTES))
        grpc_idle = grpc_server.rss_bytes()
        tcp = baselines.tcp_goodput(tcp_port, plan.baseline_bytes, reps=plan.transfer_reps,
                                    warmup=plan.transfer_warmup, server_cpu=tcp_server.cpu_seconds)
        up, down = baselines.grpc_stream_goodput(
            grpc_port, plan.baseline_bytes, DEFAULT_CHUNK_BYTES, reps=plan.transfer_reps,
            warmup=plan.transfer_warmup, server_cpu=grpc_server.cpu_seconds)
        # How much a server that does nothing with the bytes still buffers while streaming.
        grpc_growth = grpc_server.peak_rss_bytes() - grpc_idle
        echo = baselines.grpc_echo_latency(grpc_port, plan.small_bytes, calls=plan.latency_calls,
                                           warmup=plan.latency_warmup, server_cpu=grpc_server.cpu_seconds)
        # The servers stay up (until the run ends) for the references paired with PS figures.
        self.tcp = baselines.TcpClient(tcp_port)
        self.echo = baselines.EchoClient(grpc_port, plan.small_bytes)
        # A push + pull round moves the same bytes up and then down: its bare-gRPC equivalent.
        round_trip = 2 / (1 / up.bytes_per_second + 1 / down.bytes_per_second)
        return {
            "tcp": tcp.to_dict(),
            "grpc_stream": {
                "chunk_bytes": DEFAULT_CHUNK_BYTES,
                "upload": up.to_dict(),
                "download": down.to_dict(),
                "round_bytes_per_second": round_trip,
                "upload_ratio_to_tcp": up.bytes_per_second / tcp.bytes_per_second,
                "server_peak_rss_growth_bytes": grpc_growth,
            },
            "grpc_echo": {"payload_bytes": plan.small_bytes, **echo.to_dict()},
        }

    def goodput_section(self) -> list[dict]:
        base = self.results.get("baselines") or {}
        bare = base.get("grpc_stream", {}).get("round_bytes_per_second")
        tcp = base.get("tcp", {}).get("bytes_per_second")

        def row(result: GoodputResult) -> dict:
            out = result.to_dict()
            # Against the TCP transfers paired with the rounds: the same load on both sides.
            paired = result.reference_bytes_per_second or tcp
            out["ratio_to_tcp"] = result.bytes_per_second / paired if paired else None
            out["ratio_to_bare_grpc"] = result.bytes_per_second / bare if bare else None
            log.info("goodput %d MiB, %d shard(s), via %s: %.0f MiB/s (push %.0f, pull %.0f)", result.size_mib,
                     result.shards, result.transport, result.bytes_per_second / MIB,
                     result.push_bytes_per_second / MIB, result.pull_bytes_per_second / MIB)
            return out

        rows = [row(self._goodput(size, shards, self.plan.transfer_reps))
                for size in self.plan.sizes_mib for shards in self.plan.shard_counts]
        # The same transfer with every byte through gRPC: what the bulk lanes are worth.
        size = min(self.plan.sizes_mib, key=lambda s: (abs(s - 64), s))
        rows.append(row(measure_goodput(
            self.children, size, 1, reps=self.plan.transfer_reps, warmup=self.plan.transfer_warmup,
            reference=self.tcp and self.tcp.transfer, bulk=False,
        )))
        return rows

    def latency(self) -> dict:
        plan = self.plan
        result = measure_small_latency(self.children, plan.small_bytes, calls=plan.latency_calls,
                                       warmup=plan.latency_warmup, reference=self.echo and self.echo.call)
        echo = (self.results.get("baselines") or {}).get("grpc_echo")
        out = {"variable_bytes": result.variable_bytes}
        for name, cost in (("pull", result.pull), ("push", result.push)):
            row = cost.to_dict()
            # Against the echo calls paired with these calls: the same load on both sides.
            p50, p99 = ((cost.reference.p50_seconds, cost.reference.p99_seconds) if cost.reference
                        else (echo["p50_seconds"], echo["p99_seconds"]) if echo else (None, None))
            if p50 and p99:
                row["p50_ratio_to_echo"] = cost.latency.p50_seconds / p50
                row["p99_ratio_to_echo"] = cost.latency.p99_seconds / p99
            out[name] = row
        return out

    def memory(self) -> dict:
        size = max(self.plan.sizes_mib)
        # Reuse the goodput run of the same model when there was one: same shard, same work.
        reps = max(1, self.plan.transfer_reps // 2)
        result = self.goodput.get((size, 1)) or self._goodput(size, 1, reps)
        # The same model and rounds with Adam: what a shard adds to a stateful optimizer's bytes.
        # Reported beside the check, which stays on SGD (no state: the tightest target).
        adam = measure_goodput(self.children, size, 1, reps=reps, warmup=self.plan.transfer_warmup, optimizer=ADAM)
        return {"size_mib": size, "shards": 1, **_memory_figures(result), "adam": _memory_figures(adam)}

    def training(self) -> list[dict]:
        from psbench.training import measure_training

        self._training_data()
        return [measure_training(self.children, case, reps=self.plan.training_reps).to_dict()
                for case in self.plan.training]

    def tls(self) -> dict:
        from psbench.tls import make_pki, measure_tls_goodput, measure_tls_training

        plan = self.plan
        pki = make_pki(self.children.workdir)
        goodput = measure_tls_goodput(self.children, pki, plan.tls_size_mib, reps=plan.transfer_reps,
                                      warmup=plan.transfer_warmup)
        self._training_data()
        training = measure_tls_training(self.children, plan.tls_training, pki, reps=plan.training_reps)
        return {"mutual": True, "goodput": goodput, "training": training.to_dict()}

    def metrics(self) -> dict:
        from psbench.metrics import measure_metrics_training

        self._training_data()
        return {"training": [measure_metrics_training(self.children, case, reps=self.plan.metrics_reps).to_dict()
                             for case in self.plan.metrics_training]}

    def elastic(self) -> dict:
        from psbench.elastic import measure_elastic_jobs, measure_elastic_throughput

        self._training_data()
        throughput = measure_elastic_throughput(self.children, self.plan.elastic_training, reps=self.plan.elastic_reps)
        return {"throughput": throughput.to_dict(), **measure_elastic_jobs(self.children, self.plan.elastic_job)}

    def sparse(self) -> dict:
        from psbench.sparse import DenseReference, dense_reference, measure_dlrm, measure_steps, rows_figures

        bench = self.plan.sparse
        steps = measure_steps(self.children, bench)
        dlrm, runs = measure_dlrm(self.children, bench)
        dense = dense_reference(self.results.get("goodput"), bench.shards)
        if dense is None:
            # No goodput section in this run: the smallest model's push + pull rounds, measured now.
            size = min(self.plan.sizes_mib)
            result = measure_goodput(self.children, size, bench.shards, reps=self.plan.transfer_reps,
                                     warmup=self.plan.transfer_warmup)
            dense = DenseReference(result.bytes_per_second, size, bench.shards, "measured here")
        return {"steps": steps, "dlrm": dlrm, "rows": rows_figures(bench, runs, dense)}

    def scale(self) -> dict:
        from psbench.scale import measure_scale

        return measure_scale(self.children, self.plan.scale)

    # -- helpers -------------------------------------------------------------------------------

    def _training_data(self) -> None:
        # Generated here, once, into psworker's data cache, instead of for seconds in every worker
        # (a no-op once it is there; PSGRPC_CACHE_DIR=off leaves each worker to generate it).
        _mnist1d_arrays()

    def _goodput(self, size: int, shards: int, reps: int) -> GoodputResult:
        result = measure_goodput(self.children, size, shards, reps=reps, warmup=self.plan.transfer_warmup,
                                 reference=self.tcp and self.tcp.transfer)
        self.goodput[(size, shards)] = result
        return result

    def section(self, name: str, body: Callable[[], object]) -> None:
        log.info("section %s ...", name)
        started = time.monotonic()
        load = environment.load_average()
        try:
            self.results[name] = body()
        except Exception as exc:  # recorded, reported, and the run goes on with the next section
            log.exception("section %s failed", name)
            self.results.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
        self.results.setdefault("timing", {})[name] = {
            "seconds": round(time.monotonic() - started, 1), "load_average_before": load,
        }
        log.info("section %s done in %.0fs", name, time.monotonic() - started)


def _memory_figures(result: GoodputResult) -> dict:
    peak, held, idle = result.shard_peak_rss_bytes[0], result.shard_held_bytes[0], result.shard_idle_rss_bytes[0]
    return {
        "peak_rss_bytes": peak,
        "idle_rss_bytes": idle,
        "held_bytes": held,
        "ratio_to_held": peak / held,
        "target_bytes": int(1.5 * held + _MEMORY_SLACK_BYTES),
        "peak_minus_idle_ratio_to_held": (peak - idle) / held,
    }


def run(plan: Plan, workdir: Path) -> dict:
    """Run ``plan`` with children and scratch files in ``workdir``; returns the results document
    (sections, checks, environment). Every child is stopped before it returns."""
    started = time.time()
    doc: dict = {
        "schema": SCHEMA,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "plan": plan.to_dict(),
        "environment": environment.describe(),
    }
    doc["environment"]["load_average_at_start"] = environment.load_average()
    with Children(workdir) as children:
        runner = _Run(plan, children)
        bodies = {"baselines": runner.baselines, "goodput": runner.goodput_section, "latency": runner.latency,
                  "training": runner.training, "memory": runner.memory, "tls": runner.tls,
                  "metrics": runner.metrics, "elastic": runner.elastic, "sparse": runner.sparse,
                  "scale": runner.scale}
        try:
            for name in plan.sections:
                runner.section(name, bodies[name])
        finally:
            runner.close()
    doc.update(runner.results)
    doc["environment"]["load_average_at_end"] = environment.load_average()
    doc["duration_seconds"] = round(time.time() - started, 1)
    doc["checks"] = [c.to_dict() for c in compute_checks(doc)]
    _require_finite(doc)
    return doc


def _require_finite(value, path: str = "") -> None:
    """JSON has no NaN or infinity: a figure that came out so is a bug here, caught now."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"result {path or '(root)'} is {value}")
    if isinstance(value, dict):
        for key, item in value.items():
            _require_finite(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _require_finite(item, f"{path}[{index}]")
