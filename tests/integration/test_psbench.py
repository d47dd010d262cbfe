"""``psbench --quick`` runs every section against real processes, prints the table and writes a
JSON document whose every figure is a positive finite number (CPU times may round to zero).
Timings are not asserted: this machine's load decides them."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SECTIONS = ("baselines", "goodput", "latency", "training", "memory", "tls", "metrics")


def _numbers(value, path: str):
    """Every number under ``value`` (booleans are not figures) with its path."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, (int, float)):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _numbers(item, f"{path}[{index}]")


def _plausible(path: str, n: float) -> bool:
    """Positive and finite; CPU times come in clock ticks (10 ms), so a quick run's few small
    calls may round to 0, and a server may not grow while 16 MiB stream through it."""
    leaf = path.rsplit(".", 1)[-1]
    return math.isfinite(n) and (n > 0 or (n == 0 and ("cpu" in leaf or "growth" in leaf)))


def test_quick_run_reports_every_section(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli("psbench", "--quick", "--out", str(out), "--keep-logs", str(tmp_path / "logs"), timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    doc = json.loads(out.read_text())
    assert "errors" not in doc, doc["errors"]
    for section in SECTIONS:
        assert doc.get(section), f"section {section} is missing or empty"
        numbers = list(_numbers(doc[section], section))
        assert numbers, f"section {section} holds no figures"
        bad = [(path, n) for path, n in numbers if not _plausible(path, n)]
        assert not bad, f"figures that are not positive and finite: {bad}"

    assert {g["shards"] for g in doc["goodput"]} == {1, 2}
    assert {g["transport"] for g in doc["goodput"]} == {"lanes", "grpc"}  # the lanes and gRPC alone
    assert all(g["ratio_to_tcp"] > 0 for g in doc["goodput"])
    assert doc["latency"]["pull"]["p50_ratio_to_echo"] > 0
    assert doc["training"][0]["cluster_samples_per_second"] > 0
    # Held: the variables, plus SGD's few bytes of step counters.
    assert 0 <= doc["memory"]["held_bytes"] - (doc["memory"]["size_mib"] << 20) < 4096
    # With Adam: the variables and their two moments (and step counters), on a shard of its own.
    assert 0 <= doc["memory"]["adam"]["held_bytes"] - 3 * (doc["memory"]["size_mib"] << 20) < 4096
    assert doc["memory"]["adam"]["peak_rss_bytes"] > doc["memory"]["adam"]["held_bytes"]

    # The same rounds and training with mutual TLS (gRPC and lanes) and in plaintext.
    tls = doc["tls"]
    assert (tls["goodput"]["plain"]["tls"], tls["goodput"]["tls"]["tls"]) == (False, True)
    assert tls["goodput"]["plain"]["transport"] == tls["goodput"]["tls"]["transport"] == "lanes"
    assert len(tls["training"]["plain_reps"]) == len(tls["training"]["tls_reps"]) == 1

    # The same training with every process's metrics on and scraped, and with none.
    metrics = doc["metrics"]["training"]
    assert [m["parameters"] for m in metrics] == [15_210] and len(metrics[0]["on_reps"]) == 1
    assert metrics[0]["scrapes"]["shard"] >= 2 and metrics[0]["scrapes"]["worker"] >= 2
    assert not metrics[0]["failures"]

    checks = {c["id"]: c for c in doc["checks"]}
    assert set(checks) == {"1", "2", "2b", "3", "3b", "3c", "4", "5", "6", "7"}
    assert all(isinstance(c["passed"], bool) for c in checks.values()), checks

    env = doc["environment"]
    for key in ("python", "torch", "grpcio", "protobuf", "numpy", "psgrpc", "cpu_model", "usable_cores"):
        assert env[key], key

    for heading in ("Baselines", "PS goodput", "Small operations", "Training", "Shard memory", "The cost of TLS",
                    "The cost of metrics", "Checks"):
        assert heading in proc.stdout, f"table lacks {heading!r}:\n{proc.stdout}"


def test_only_runs_the_sections_asked_and_their_baselines(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli("psbench", "--quick", "--only", "latency", "--out", str(out), timeout=200)
    assert proc.returncode == 0, proc.stderr[-5000:]
    doc = json.loads(out.read_text())
    assert doc["plan"]["sections"] == ["baselines", "latency"]
    assert "goodput" not in doc and "training" not in doc
    checks = {c["id"]: c["passed"] for c in doc["checks"]}
    assert checks["4"] in (True, False) and checks["1"] is None


def test_bad_flags_are_usage_errors():
    proc = run_cli("psbench", "--only", "goodput,nonsense", timeout=60)
    assert proc.returncode == 2
    assert "nonsense" in proc.stderr
