"""psbench's pure parts: statistics, the plan a configuration resolves to, the benchmark
model's size, the checks and the table, on synthetic results (no processes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from psbench.checks import compute_checks
from psbench.config import BenchConfig, parse_args, training_case
from psbench.report import render
from psbench.stats import LatencySummary, median, percentile

MIB = 1 << 20


@given(st.lists(st.floats(min_value=0, max_value=1e6), min_size=1, max_size=50), st.floats(min_value=0, max_value=100))
def test_percentile_matches_numpy(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-9)


def test_statistics_refuse_nothing_to_summarise():
    with pytest.raises(ValueError):
        median([])
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    summary = LatencySummary.of([0.001, 0.002, 0.003])
    assert summary.p50_seconds == 0.002 and summary.calls == 3


def test_only_brings_the_baselines_its_ratios_need():
    assert parse_args(["--only", "goodput"], env={}).plan().sections == ("baselines", "goodput")
    assert parse_args(["--only", "training"], env={}).plan().sections == ("training",)
    assert parse_args([], env={}).plan().sections == ("baselines", "goodput", "latency", "training", "memory")


def test_quick_plan_is_small_and_flags_override_it():
    plan = parse_args(["--quick", "--sizes", "8,2", "--reps", "4"], env={}).plan()
    assert plan.sizes_mib == (2, 8) and plan.transfer_reps == 4 and plan.training_reps == 4
    # The widest model runs twice: as it is and with bf16 on the wire.
    assert [(c.width, c.wire_dtype) for c in plan.training] == [(100, "none"), (100, "bf16")]
    assert parse_args([], env={"PSBENCH_REPS": "7"}).plan().transfer_reps == 7


@pytest.mark.parametrize("kwargs", [{"only": "nope"}, {"reps": 0}, {"sizes": "4,x"}, {"sizes": "4,4"},
                                    {"widths": "0"}, {"out": ""}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        BenchConfig(**kwargs)


def test_training_steps_shrink_as_models_grow():
    small, large = training_case(100), training_case(2048)
    assert small.parameters == 15_210 and large.parameters == 4_300_810
    assert small.local_steps > large.local_steps and small.worker_steps > large.worker_steps


def test_bench_model_is_exactly_the_size_asked():
    from psbench.ps import bench_model

    for size in (1, 4, 64):
        model = bench_model(size)
        assert sum(t.numel() * t.element_size() for t in model.values()) == size * MIB
    with pytest.raises(ValueError):
        bench_model(0)


def _doc(**sections) -> dict:
    doc = {
        "started_at": "2026-01-01T00:00:00Z", "duration_seconds": 1.0, "plan": {"quick": False},
        "environment": {"cpu_model": "test cpu", "usable_cores": 2, "python": "3", "torch": "2",
                        "grpcio": "1", "protobuf": "7"},
        **sections,
    }
    doc["checks"] = [c.to_dict() for c in compute_checks(doc)]
    return doc


def _goodput(size: int, shards: int, rate: float) -> dict:
    return {"size_mib": size, "shards": shards, "bytes_per_second": rate, "ratio_to_tcp": rate / 1000,
            "ratio_to_bare_grpc": rate / 500, "push_bytes_per_second": rate, "pull_bytes_per_second": rate,
            "paired_tcp_bytes_per_second": 1000.0, "cpu_seconds_per_mib": 0.004}


def _rate(value: float) -> dict:
    return {"bytes_per_second": value, "cpu_seconds_per_mib": 0.001}


def test_checks_pass_fail_and_not_measured():
    doc = _doc(
        baselines={"tcp": {**_rate(1000.0), "bytes_per_transfer": MIB},
                   "grpc_stream": {"chunk_bytes": MIB, "upload": _rate(500.0), "download": _rate(500.0),
                                   "round_bytes_per_second": 500.0},
                   "grpc_echo": {"payload_bytes": 4096, "p50_seconds": 0.001, "p99_seconds": 0.002,
                                 "client_cpu_seconds_per_call": 3e-4, "server_cpu_seconds_per_call": 4e-4}},
        goodput=[_goodput(4, 1, 600.0), _goodput(64, 1, 550.0), _goodput(256, 1, 500.0), _goodput(4, 2, 100.0)],
        memory={"size_mib": 256, "peak_rss_bytes": 700 * MIB, "idle_rss_bytes": 200 * MIB,
                "held_bytes": 256 * MIB, "ratio_to_held": 700 / 256, "target_bytes": 584 * MIB,
                "adam": {"peak_rss_bytes": 1200 * MIB, "idle_rss_bytes": 200 * MIB, "held_bytes": 768 * MIB,
                         "ratio_to_held": 1200 / 768, "target_bytes": 1352 * MIB}},
    )
    checks = {c["id"]: c for c in doc["checks"]}
    assert checks["1"]["passed"] is True and checks["1"]["value"] == pytest.approx(0.55)
    assert checks["2"]["passed"] is False and checks["2"]["value"] == pytest.approx(500 / 600)
    assert checks["2b"]["passed"] is None  # one size with 2 shards
    assert checks["3"]["passed"] is None and checks["4"]["passed"] is None
    assert checks["5"]["passed"] is False
    text = render(doc)
    for heading in ("Baselines", "PS goodput", "Shard memory", "Checks", "FAIL", "n/a"):
        assert heading in text
    assert "Adam" in text and "1,352 MiB" in text  # beside the check, which stays on SGD


def test_latency_check_uses_the_paired_echo():
    pull = {"p50_seconds": 0.002, "p99_seconds": 0.004, "paired_echo_p50_seconds": 0.001,
            "paired_echo_p99_seconds": 0.002, "p50_ratio_to_echo": 2.0, "p99_ratio_to_echo": 2.0,
            "client_cpu_seconds_per_call": 1e-3, "shard_cpu_seconds_per_call": 1e-3}
    doc = _doc(latency={"variable_bytes": 4096, "pull": pull, "push": pull})
    check = next(c for c in doc["checks"] if c["id"] == "4")
    assert check["passed"] is False and check["value"] == 2.0 and "2.00 / 1.00 ms" in check["detail"]
    assert "Small operations" in render(doc)
