"""psbench's pure parts: statistics, the plan a configuration resolves to, the benchmark
model's size, the checks and the table, on synthetic results (no processes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from psbench.checks import compute_checks
from psbench.config import METRICS_RUN_FACTOR, BenchConfig, parse_args, training_case
from psbench.ps import GoodputResult
from psbench.report import render
from psbench.metrics import MetricsTrainingResult, ScrapeStats, metrics_url_in
from psbench.tls import TlsTrainingResult, goodput_comparison
from psbench.stats import LatencySummary, median, median_ratio, percentile

MIB = 1 << 20


@given(st.lists(st.floats(min_value=0, max_value=1e6), min_size=1, max_size=50), st.floats(min_value=0, max_value=100))
def test_percentile_matches_numpy(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-9)


def test_median_ratio_pairs_figures_measured_together():
    # Each pair shares its load: the median of the ratios, not the ratio of the medians (0.5).
    assert median_ratio([1.0, 10.0, 3.0], [2.0, 10.0, 3.0]) == 1.0
    for numerators, denominators in (([], []), ([1.0], [1.0, 2.0]), ([1.0], [0.0])):
        with pytest.raises(ValueError):
            median_ratio(numerators, denominators)


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
    assert parse_args(["--only", "tls"], env={}).plan().sections == ("tls",)
    assert parse_args([], env={}).plan().sections == ("baselines", "goodput", "latency", "training", "memory",
                                                      "tls", "metrics", "elastic", "sparse", "scale")
    assert parse_args(["--only", "sparse"], env={}).plan().sections == ("sparse",)
    assert parse_args(["--only", "scale"], env={}).plan().sections == ("scale",)


def test_quick_plan_is_small_and_flags_override_it():
    plan = parse_args(["--quick", "--sizes", "8,2", "--reps", "4"], env={}).plan()
    assert plan.sizes_mib == (2, 8) and plan.transfer_reps == 4 and plan.training_reps == 4
    # The widest model runs twice: as it is and with bf16 on the wire.
    assert [(c.width, c.wire_dtype) for c in plan.training] == [(100, "none"), (100, "bf16")]
    assert parse_args([], env={"PSBENCH_REPS": "7"}).plan().transfer_reps == 7


def test_a_full_run_times_transfers_after_the_lanes_have_settled():
    # The first rounds on fresh lanes run slower while their sockets' buffers grow, against a
    # TCP connection warm all run; 5 timed rounds left check 1's ratio spread 0.05 (docs/benchmarks.md).
    full, quick = parse_args([], env={}).plan(), parse_args(["--quick"], env={}).plan()
    assert (full.transfer_warmup, full.transfer_reps) == (3, 20)
    assert (quick.transfer_warmup, quick.transfer_reps) == (1, 2)


def test_tls_measures_the_size_nearest_64_mib_and_the_widest_model():
    full, quick = parse_args([], env={}).plan(), parse_args(["--quick"], env={}).plan()
    assert (full.tls_size_mib, full.tls_training.parameters) == (64, 4_300_810)
    assert (quick.tls_size_mib, quick.tls_training.width) == (4, 100)
    plan = parse_args(["--sizes", "8,256", "--widths", "100,1024"], env={}).plan()
    assert (plan.tls_size_mib, plan.tls_training.width) == (8, 1024)
    assert plan.to_dict()["tls_training"]["width"] == 1024


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
        goodput=[_goodput(4, 1, 600.0), _goodput(64, 1, 850.0), _goodput(256, 1, 500.0), _goodput(4, 2, 100.0)],
        memory={"size_mib": 256, "peak_rss_bytes": 700 * MIB, "idle_rss_bytes": 200 * MIB,
                "held_bytes": 256 * MIB, "ratio_to_held": 700 / 256, "target_bytes": 584 * MIB,
                "adam": {"peak_rss_bytes": 1200 * MIB, "idle_rss_bytes": 200 * MIB, "held_bytes": 768 * MIB,
                         "ratio_to_held": 1200 / 768, "target_bytes": 1352 * MIB}},
    )
    checks = {c["id"]: c for c in doc["checks"]}
    assert checks["1"]["passed"] is True and checks["1"]["value"] == pytest.approx(0.85)
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


def _rounds(seconds: list[float], tls: bool) -> GoodputResult:
    """A 1 MiB model's rounds, push and pull taking half of each."""
    half = [t / 2 for t in seconds]
    return GoodputResult(1, 1, 2 * MIB, seconds, half, half, 0.1, [50 * MIB], [60 * MIB], [MIB],
                         client_cpu_seconds=0.002, shard_cpu_seconds=0.004 if tls else 0.002,
                         reference_seconds=[], tls=tls)


def _workers(*rates: float) -> list[dict]:
    return [{"samples_per_second": r, "samples": 6400, "seconds": 6400 / r} for r in rates]


def test_tls_comparison_pairs_each_tls_figure_with_the_plaintext_one_beside_it():
    goodput = goodput_comparison(_rounds([0.01, 0.01, 0.04], False), _rounds([0.02, 0.02, 0.04], True))
    # Rounds 1 and 2 halve the goodput; round 3 (a loaded moment for both) does not count twice.
    assert goodput["ratio"] == pytest.approx(0.5) and goodput["cpu_ratio"] == pytest.approx(1.5)
    assert goodput["plain"]["tls"] is False and goodput["tls"]["tls"] is True
    training = TlsTrainingResult(training_case(2048), plain=[_workers(800, 800), _workers(400, 400)],
                                 tls=[_workers(700, 700), _workers(360, 360)], plain_shard_cpu_seconds=[2.0, 2.0],
                                 tls_shard_cpu_seconds=[3.0, 3.0], workers=2, shards=2)
    row = training.to_dict()
    assert row["ratio"] == pytest.approx((0.875 + 0.9) / 2) and row["plain_samples_per_second"] == 1200
    assert row["parameters"] == 4_300_810 and row["plain_reps"] == [1600, 800]
    assert row["tls_shard_cpu_ms_per_step"] == pytest.approx(1e3 * 3.0 / 200)


@pytest.mark.parametrize(("ratio", "passed"), [(0.9, True), (0.7, False)])
def test_tls_check_and_table(ratio, passed):
    training = {"width": 2048, "parameters": 4_300_810, "shards": 2, "workers": 2,
                "plain_samples_per_second": 1000.0, "tls_samples_per_second": 1000.0 * ratio, "ratio": ratio,
                "plain_shard_cpu_ms_per_step": 20.0, "tls_shard_cpu_ms_per_step": 30.0}
    goodput = goodput_comparison(_rounds([0.01, 0.01], False), _rounds([0.02, 0.02], True))
    doc = _doc(tls={"mutual": True, "goodput": goodput, "training": training})
    check = next(c for c in doc["checks"] if c["id"] == "6")
    assert check["passed"] is passed and check["value"] == ratio and check["threshold"] == 0.8
    assert check["detail"] == f"{1000 * ratio:.0f} / 1000 samples/s"  # at the size the criterion names
    text = render(doc)
    assert "The cost of TLS" in text and "0.50" in text and f"{ratio:.2f}" in text
    # Left out, the check is not measured; a smaller model stands in with a note.
    assert next(c for c in _doc()["checks"] if c["id"] == "6")["passed"] is None
    small = _doc(tls={"training": {**training, "width": 100, "parameters": 15_210}})
    assert "(at 15210 parameters)" in next(c for c in small["checks"] if c["id"] == "6")["detail"]


def test_metrics_measures_the_narrowest_and_widest_models_in_pairs():
    full, quick = parse_args([], env={}).plan(), parse_args(["--quick"], env={}).plan()
    assert [c.parameters for c in full.metrics_training] == [15_210, 4_300_810] and full.metrics_reps == 5
    # Runs long enough for a scrape a second to land several times in each.
    assert [c.worker_steps for c in full.metrics_training] == [
        round(METRICS_RUN_FACTOR * training_case(w).worker_steps) for w in (100, 2048)
    ]
    # About 6 s of training per worker by the step estimates (4 s for the training section).
    assert [round(c.worker_steps * (0.9e-3 + 10e-9 * c.parameters)) for c in full.metrics_training] == [6, 6]
    assert [c.width for c in quick.metrics_training] == [100] and quick.metrics_reps == 1
    assert parse_args(["--reps", "2", "--widths", "1024"], env={}).plan().metrics_reps == 2
    assert parse_args(["--widths", "1024"], env={}).plan().to_dict()["metrics_training"][0]["width"] == 1024


def test_metrics_comparison_pairs_each_run_with_metrics_with_the_run_without_beside_it():
    stats = ScrapeStats(scrapes={"shard": 20, "worker": 12}, gone={"worker": 2}, seconds=[0.002, 0.004],
                        bytes=[1500, 1700])
    result = MetricsTrainingResult(training_case(2048), off=[_workers(800, 800), _workers(400, 400)],
                                   on=[_workers(784, 784), _workers(400, 400)], off_shard_cpu_seconds=[2.0, 2.0],
                                   on_shard_cpu_seconds=[2.2, 2.2], scrapes=[stats, stats],
                                   shard_idle_rss_bytes={"off": 55 * MIB, "on": 58 * MIB}, workers=2, shards=2)
    row = result.to_dict()
    assert row["ratio"] == pytest.approx((0.98 + 1.0) / 2) and row["off_samples_per_second"] == 1200
    assert row["scrapes"] == {"shard": 40, "worker": 24} and row["gone"] == {"worker": 4} and row["failures"] == {}
    assert row["median_scrape_seconds"] == pytest.approx(0.003) and row["median_scrape_bytes"] == 1600
    assert row["on_shard_cpu_ms_per_step"] == pytest.approx(1e3 * 2.2 / 200)


def test_a_metrics_address_is_read_from_a_process_log(tmp_path):
    log = tmp_path / "shard.log"
    log.write_text("2026 INFO psserver[1] psserver.server: metrics on http://127.0.0.1:40123/metrics\n"
                   "... metrics on http://127.0.0.1:1/metrics\n")
    assert metrics_url_in(log) == "http://127.0.0.1:40123/metrics"
    log.write_text("no address yet")
    assert metrics_url_in(log) is None and metrics_url_in(tmp_path / "missing.log") is None


def _metrics_run(width: int, parameters: int, on: float, off: float) -> dict:
    return {"width": width, "parameters": parameters, "shards": 2, "workers": 2, "off_samples_per_second": off,
            "on_samples_per_second": on, "ratio": on / off, "off_shard_cpu_ms_per_step": 10.0,
            "on_shard_cpu_ms_per_step": 10.5, "scrapes": {"shard": 20, "worker": 10}, "failures": {},
            "gone": {}, "median_scrape_seconds": 0.003, "median_scrape_bytes": 1600,
            "shard_idle_rss_bytes": {"off": 55 * MIB, "on": 58 * MIB}}


@pytest.mark.parametrize(("small", "large", "passed"), [(990.0, 980.0, True), (990.0, 960.0, False),
                                                         (960.0, 1000.0, False)])
def test_metrics_check_holds_both_models_within_3_percent(small, large, passed):
    doc = _doc(metrics={"training": [_metrics_run(100, 15_210, small, 1000.0),
                                     _metrics_run(2048, 4_300_810, large, 1000.0)]})
    check = next(c for c in doc["checks"] if c["id"] == "7")
    assert check["passed"] is passed and check["value"] == pytest.approx(min(small, large) / 1000)
    assert check["threshold"] == 0.97 and check["comparison"] == ">="
    assert check["detail"] == f"15K {small:.0f} / 1000 samples/s; 4.3M {large:.0f} / 1000 samples/s"
    text = render(doc)
    assert "The cost of metrics" in text and "58.0 MiB on" in text and "scrapes: 40 of shards" in text
    # Left out, not measured; a quick run's one small model says the large one was not.
    assert next(c for c in _doc()["checks"] if c["id"] == "7")["passed"] is None
    quick = _doc(metrics={"training": [_metrics_run(100, 15_210, small, 1000.0)]})
    assert next(c for c in quick["checks"] if c["id"] == "7")["detail"].endswith("4.3M not measured")


def test_sparse_plan_is_the_issues_sizes_and_quick_is_small():
    full, quick = parse_args([], env={}).plan().sparse, parse_args(["--quick"], env={}).plan().sparse
    assert (full.small_rows, full.large_rows, full.dim, full.batch, full.features, full.zipf, full.id_range) == \
        (100_000, 10_000_000, 64, 256, 4, 1.1, 100_000)
    assert (full.steps, full.step_reps, full.dlrm_rows, full.dlrm_reps) == (200, 5, 1_000_000, 3)
    assert full.dlrm_local_steps == full.dlrm_workers * full.dlrm_worker_steps
    assert quick.steps < full.steps and quick.dlrm_worker_steps < full.dlrm_worker_steps
    assert (quick.step_reps, quick.dlrm_reps) == (1, 1)
    reps = parse_args(["--reps", "2"], env={}).plan()
    assert (reps.sparse.step_reps, reps.sparse.dlrm_reps) == (2, 2) and reps.to_dict()["sparse"]["step_reps"] == 2


def test_sparse_batches_are_fixed_distinct_ids_both_tables_hold():
    from psbench.config import QUICK_SPARSE
    from psbench.sparse import zipf_batches

    batches = zipf_batches(QUICK_SPARSE)
    assert len(batches) == QUICK_SPARSE.warmup + QUICK_SPARSE.steps
    for ids, grads in batches:
        assert ids.dtype == np.int64 and np.all(np.diff(ids) > 0)  # sorted, each id once
        assert 0 <= ids[0] and ids[-1] < QUICK_SPARSE.id_range
        assert grads.shape == (ids.size, QUICK_SPARSE.dim) and grads.dtype == np.float32
    # Zipf: the hot ids are in nearly every batch, and a batch touches far fewer rows than ids.
    assert all(0 in ids for ids, _ in batches)
    assert 200 < np.mean([ids.size for ids, _ in batches]) < QUICK_SPARSE.batch * QUICK_SPARSE.features
    again = zipf_batches(QUICK_SPARSE)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(batches, again))


def test_sparse_dense_reference_is_the_smallest_model_on_two_shards_on_the_lanes():
    from psbench.sparse import dense_reference

    goodput = [_goodput(4, 1, 600.0), _goodput(64, 2, 900.0), _goodput(4, 2, 700.0),
               {**_goodput(1, 2, 100.0), "transport": "grpc"}]
    reference = dense_reference(goodput)
    assert (reference.bytes_per_second, reference.size_mib, reference.source) == (700.0, 4, "goodput section")
    assert dense_reference(None) is None and dense_reference([_goodput(4, 1, 600.0)]) is None


def _sparse(ratio: float, cluster: float) -> dict:
    def table(rows: int, seconds: float) -> dict:
        return {"rows": rows, "step_seconds": seconds, "row_bytes_per_second": 2 * 500 * 256 / seconds,
                "shard_cpu_seconds_per_step": 0.004, "shard_peak_rss_bytes": [70 * MIB, 70 * MIB]}

    return {
        "steps": {"steps": 200, "batch": 256, "features": 4, "zipf": 1.1, "id_range": 100_000, "rows_per_step": 500.0,
                  "dim": 64, "optimizer": "adagrad", "shards": 2, "ratio": ratio,
                  "tables": [table(100_000, 0.004), table(10_000_000, 0.004 * ratio)]},
        "dlrm": {"task": "dlrm-synth", "rows": 1_000_000, "batch_size": 256, "shards": 2, "workers": 2,
                 "local_samples_per_second": 200_000.0, "cluster_samples_per_second": 200_000.0 * cluster,
                 "ratio_to_local": cluster, "local_test_auc": 0.82, "cluster_test_auc": 0.81, "teacher_auc": 0.845,
                 "teacher_dense_auc": 0.796},
        "rows": {"rows_pushed_per_second": 120_000.0, "rows_pulled_per_second": 120_000.0,
                 "bytes_per_second": 60 * MIB, "dense_bytes_per_second": 700 * MIB, "dense_size_mib": 4,
                 "dense_shards": 2, "dense_source": "goodput section", "ratio_to_dense": 60 / 700},
    }


@pytest.mark.parametrize(("ratio", "cluster", "passed"), [(1.02, 0.6, (True, True)), (1.5, 0.2, (False, False))])
def test_sparse_checks_and_table(ratio, cluster, passed):
    doc = _doc(sparse=_sparse(ratio, cluster))
    checks = {c["id"]: c for c in doc["checks"]}
    assert (checks["9"]["passed"], checks["9b"]["passed"]) == passed
    assert checks["9"]["value"] == ratio and (checks["9"]["comparison"], checks["9"]["threshold"]) == ("<=", 1.3)
    assert checks["9b"]["value"] == cluster and (checks["9b"]["comparison"], checks["9b"]["threshold"]) == (">=", 0.5)
    assert checks["9b"]["detail"].endswith("test AUC 0.810 / 0.820, teacher 0.845")
    text = render(doc)
    assert "step time against table size" in text and "cluster against local" in text
    assert f"{ratio:.2f}" in text and "0.09" in text and "700 MiB/s" in text
    # Left out (or failed), the checks are not measured.
    assert [c["passed"] for c in _doc()["checks"] if c["id"].startswith("9")] == [None, None]
    no_dense = _sparse(ratio, cluster)
    no_dense["rows"].update(dense_bytes_per_second=None, ratio_to_dense=None)
    assert "no dense figure" in render(_doc(sparse=no_dense))


# -- scale -------------------------------------------------------------------------------------------

def test_scale_plan_is_the_issues_grid_and_quick_is_small():
    from psbench.config import ScaleBench

    full, quick = parse_args([], env={}).plan().scale, parse_args(["--quick"], env={}).plan().scale
    assert (full.widths, full.shard_counts, full.workers, full.compute_ms) == ((1024, 2048), (1, 2), (1, 2, 4, 8), 50.0)
    assert [training_case(w).parameters for w in full.widths] == [1_101_834, 4_300_810]
    # The whole grid stays within a few minutes: counts x passes x (warm-up + timed window).
    timed = len(full.widths) * len(full.shard_counts) * len(full.workers) * full.reps
    assert timed * (full.warmup_seconds + full.seconds) <= 360
    assert quick.max_workers < full.max_workers and quick.seconds < full.seconds and quick.reps == 1
    assert 1 in quick.workers and len(quick.widths) * len(quick.shard_counts) == 1
    assert parse_args(["--reps", "2"], env={}).plan().scale.reps == 2
    assert parse_args([], env={}).plan().to_dict()["scale"]["workers"] == (1, 2, 4, 8)
    # Ascending, then descending: drift in the load does not always favour the same end.
    assert ScaleBench(workers=(4, 1, 2), reps=3).passes() == [(1, 2, 4), (4, 2, 1), (1, 2, 4)]


@pytest.mark.parametrize("kwargs", [{"workers": (2, 4)}, {"workers": (1, 1, 2)}, {"widths": ()},
                                    {"shard_counts": (0,)}, {"seconds": 0}, {"compute_ms": -1}, {"reps": 0}])
def test_bad_scale_settings_are_refused(kwargs):
    from psbench.config import ScaleBench

    with pytest.raises(ValueError):
        ScaleBench(**kwargs)


def test_a_workers_window_counts_from_its_first_completed_step_to_its_last():
    from psbench.scale import window_figures

    window = window_figures([10.0, 10.06, 10.12, 10.18, 10.30], [0.01, 0.01, 0.02, 0.01, 0.07],
                            [1.0, 1.004, 1.008, 1.012, 1.016])
    assert window.steps == 5 and window.steps_per_second == pytest.approx(4 / 0.3)
    assert window.exchange_seconds == 0.01 and window.exchange_p90_seconds == pytest.approx(0.05)
    assert window.client_cpu_seconds_per_step == pytest.approx(0.004)
    with pytest.raises(ValueError):
        window_figures([10.0], [0.01], [1.0])
    with pytest.raises(ValueError):
        window_figures([10.0, 10.0], [0.01, 0.01], [1.0, 1.0])


def _pass(rates: list[float], cpu: list[float], updates: list[int], seconds: float = 5.0):
    from psbench.scale import PassFigures, WorkerWindow

    return PassFigures([WorkerWindow(int(r * seconds), r, 0.005, 0.008, 0.003) for r in rates], cpu, updates,
                       seconds, 1.5 * seconds)


def test_scale_efficiency_pairs_each_count_with_one_worker_of_the_same_pass():
    from psbench.scale import point_figures

    # Pass 2 ran on a slower machine for everybody: its ratio still counts as measured together.
    single = [_pass([18.0], [0.2, 0.2], [90, 90]), _pass([9.0], [0.1, 0.1], [45, 45])]
    four = [_pass([17.0] * 4, [0.7, 0.7], [340, 340]), _pass([8.0] * 4, [0.4, 0.4], [160, 160])]
    point = point_figures(4, four, single, batch=64, model_bytes=4 * MIB, shard_bytes=[2 * MIB, 2 * MIB])
    assert point["efficiency_reps"] == pytest.approx([68 / 72, 32 / 36])
    assert point["efficiency"] == pytest.approx((68 / 72 + 32 / 36) / 2)
    assert point["samples_per_second"] == pytest.approx(64 * (68 + 32) / 2)
    assert point["shard_cpu_seconds_per_update_reps"] == pytest.approx([1.4 / 680, 0.8 / 320])
    # Each shard moves its 2 MiB up and down per update.
    assert point["shard_cpu_seconds_per_mib"] == pytest.approx(point["shard_cpu_seconds_per_update"] / 4)
    assert point["shard_cpu_cores"] == pytest.approx((0.7 + 0.4) / 2 / 5)
    assert point["bytes_per_second"] == pytest.approx((68 + 32) / 2 * 8 * MIB)
    assert point["machine_busy_cores"] == pytest.approx(1.5)
    assert point_figures(1, single, single, batch=64, model_bytes=MIB, shard_bytes=[MIB])["efficiency"] == 1.0


def test_linear_fit_recovers_a_line():
    from psbench.scale import linear_fit

    assert linear_fit([4.0, 8.0, 16.0, 32.0], [0.5 + 0.25 * x for x in (4, 8, 16, 32)]) == pytest.approx((0.5, 0.25))
    with pytest.raises(ValueError):
        linear_fit([4.0, 4.0], [1.0, 2.0])


def test_scale_cost_fits_split_calls_from_bytes():
    from psbench.scale import cost_fits

    def run(width: int, shards: int) -> dict:
        model_bytes = 4 * training_case(width).parameters
        moved = 2 * model_bytes / MIB
        # Under load an update costs a little more or less than alone: the fit goes between.
        return {"width": width, "shards": shards, "model_bytes": model_bytes, "points": [
            {"workers": n, "shard_cpu_seconds_per_update": 1.5e-3 + 3e-4 * moved / shards + noise,
             "client_cpu_seconds_per_step": 1.3e-3 * shards + 1.6e-4 * moved - noise}
            for n, noise in ((1, 1e-4), (8, -1e-4))]}

    fits = cost_fits([run(w, s) for w in (1024, 2048) for s in (1, 2)])
    assert fits == pytest.approx({"shard_seconds_per_update": 1.5e-3, "shard_seconds_per_mib": 3e-4,
                                  "client_seconds_per_call": 1.3e-3, "client_seconds_per_mib": 1.6e-4})
    assert cost_fits([run(1024, 2)]) is None  # a quick run: one model, one shard count


def test_the_sizing_rule_inflates_the_exchange_with_the_cores_load():
    from psbench.scale import predicted_exchange

    rule = {"compute_seconds": 0.05, "uncontended_seconds": 0.005, "cpu_per_step": 0.01, "cores": 2.0}
    one = predicted_exchange(1, **rule)
    # E = E0 / (1 - U) with U = X * cpu / cores and X = workers / (compute + E), solved together.
    assert one == pytest.approx(0.005 / (1 - 1 / (0.05 + one) * 0.01 / 2), rel=1e-9)
    eight = predicted_exchange(8, **rule)
    assert eight == pytest.approx(0.005 / (1 - 8 / (0.05 + eight) * 0.01 / 2), rel=1e-9)
    assert one < eight < predicted_exchange(64, **rule)
    # Past the cores' capacity, throughput is the capacity: cores / CPU per step.
    assert 64 / (0.05 + predicted_exchange(64, **rule)) < 2.0 / 0.01
    assert predicted_exchange(8, **rule, external_cores=1.0) > eight
    assert predicted_exchange(1, **rule, external_cores=2.0) == float("inf")


def test_predicted_efficiency_is_one_for_one_worker_and_falls_with_more():
    from psbench.scale import predict

    run = _scale_doc(0.8)["runs"][1]
    for point in run["points"]:
        point["external_cores"] = 0.0
    fits = {"shard_seconds_per_update": 1.5e-3, "shard_seconds_per_mib": 3e-4, "client_seconds_per_call": 1.3e-3,
            "client_seconds_per_mib": 1.6e-4}
    predict([run], fits, 0.05, 2.0)
    one, eight = run["points"]
    assert one["predicted_efficiency"] == pytest.approx(1.0)
    assert one["predicted_exchange_seconds"] == pytest.approx(0.006)  # the one worker's own
    assert 0.5 < eight["predicted_efficiency"] < 1.0
    # Other load beside the eight workers lowers their prediction; beside the one, raises it.
    alone = eight["predicted_efficiency"]
    eight["external_cores"] = 0.5
    predict([run], fits, 0.05, 2.0)
    loaded = eight["predicted_efficiency"]
    eight["external_cores"], one["external_cores"] = 0.0, 0.5
    predict([run], fits, 0.05, 2.0)
    assert loaded < alone < eight["predicted_efficiency"] and one["predicted_efficiency"] == 1.0


def test_the_scale_control_file_is_replaced_whole(tmp_path):
    from psbench.scale import _read_control, write_control

    path = tmp_path / "control"
    assert _read_control(path) is None
    write_control(path, {"phase": 1, "active": 2, "start": 1.0, "end": 2.0})
    write_control(path, {"phase": 2, "stop": True})
    assert _read_control(path) == {"phase": 2, "stop": True}
    assert [p.name for p in tmp_path.iterdir()] == ["control"]


def _scale_doc(efficiency: float, *, workers: int = 8, width: int = 1024, compute_ms: float = 50.0) -> dict:
    def point(n: int, eff: float) -> dict:
        return {"workers": n, "samples_per_second": 1100.0 * n * eff, "efficiency": eff, "step_seconds": 0.056,
                "exchange_seconds": 0.006, "client_cpu_seconds_per_step": 0.0035,
                "shard_cpu_seconds_per_update": 0.0024, "shard_cpu_cores": 0.05 * n,
                "bytes_per_second": 1e8 * n, "machine_busy_cores": 0.3 * n}

    parameters = training_case(width).parameters
    runs = [{"width": width, "parameters": parameters, "model_bytes": 4 * parameters, "shards": shards,
             "points": [point(1, 1.0), point(workers, efficiency - 0.1 * (shards == 1))]} for shards in (1, 2)]
    return {"compute_ms": compute_ms, "batch": 64, "seconds": 5.0, "warmup_seconds": 1.5, "reps": 3, "runs": runs,
            "cpu_fit": {"shard_seconds_per_update": 4e-4, "shard_seconds_per_mib": 5e-4,
                        "client_seconds_per_call": 1.2e-3, "client_seconds_per_mib": 1.5e-4}}


@pytest.mark.parametrize(("efficiency", "passed"), [(0.9, True), (0.8, False)])
def test_scale_check_is_the_1m_mlp_on_2_shards_at_8_workers(efficiency, passed):
    doc = _doc(scale=_scale_doc(efficiency))
    check = next(c for c in doc["checks"] if c["id"] == "10")
    assert check["passed"] is passed and check["value"] == efficiency  # 2 shards, not the 1-shard run
    assert (check["comparison"], check["threshold"]) == (">=", 0.85)
    assert check["detail"] == f"{8800 * efficiency:.0f} / (8 x 1100) samples/s; shard CPU 2.40 ms per update"
    text = render(doc)
    assert "Scaling: workers whose step is push_pull" in text and "0.40 ms per update + 0.500 ms per MiB" in text
    assert "a worker 1.20 ms per shard called + 0.150 ms per MiB" in text
    assert f"{efficiency:.2f}" in text and "W=1024 (1.1M, 4.2 MiB)" in text


def test_scale_check_names_its_stand_ins_and_is_not_measured_without_the_section():
    assert next(c for c in _doc()["checks"] if c["id"] == "10")["passed"] is None
    quick = next(c for c in _doc(scale=_scale_doc(0.95, workers=2))["checks"] if c["id"] == "10")
    assert quick["passed"] is True and quick["detail"].endswith("(at 2 workers)")
    other = next(c for c in _doc(scale=_scale_doc(0.95, width=2048, compute_ms=20.0))["checks"] if c["id"] == "10")
    assert other["detail"].endswith("(at 4300810 parameters, 20 ms compute)")


def test_the_cnn_emulates_an_accelerator_in_training_steps_only(monkeypatch):
    # The elastic section's accuracy runs: a training forward pass sleeps compute_ms (compute the
    # 2 cores do not share); an evaluation does not, and the variables are those of the plain task.
    import torch

    from psbench import tasks
    from psworker.tasks import load_task

    slept: list[float] = []
    monkeypatch.setattr(tasks.time, "sleep", slept.append)
    plain = load_task("psbench.tasks:mnist1d_cnn", seed=3)
    emulated = load_task("psbench.tasks:mnist1d_cnn", seed=3, options={"compute_ms": "30"})
    assert plain.model.state_dict().keys() == emulated.model.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.model.state_dict().values(), emulated.model.state_dict().values()))
    x = emulated.train[0][:8]
    emulated.model.train()
    emulated.model(x)
    plain.model.train()
    plain.model(x)
    assert slept == [0.03]
    emulated.model.eval()
    emulated.model(x)
    assert slept == [0.03]
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ValueError, match="compute_ms must be a finite number >= 0"):
            tasks.mnist1d_cnn(0, compute_ms=bad)


def test_the_elastic_job_refuses_settings_it_cannot_run():
    from psbench.config import ELASTIC_JOB, ElasticJob

    assert ELASTIC_JOB.compute_ms > 0 and ELASTIC_JOB.scaling_runs >= 1
    for bad in ({"compute_ms": -1.0}, {"compute_ms": float("nan")}, {"scaling_runs": 0}):
        with pytest.raises(ValueError, match="compute_ms >= 0 and scaling_runs >= 1"):
            ElasticJob(steps=8, workers=2, fewer=1, runs=1, **bad)
