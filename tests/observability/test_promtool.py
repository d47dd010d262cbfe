"""promtool on the shipped Prometheus files: the compose configuration and the tests' own
generated one are valid, the alert rules load, and each alert fires on the synthetic series of
alerts_test.yml and stays silent on the healthy ones. Fails (in CI) or skips (elsewhere) when
promtool is missing."""

from __future__ import annotations

import re

import pytest

from tests.observability.prom import config, file_sd_job_config, promtool
from tests.observability.promql import ALERTS, PROMETHEUS_DIR, alert_rules_text

pytestmark = pytest.mark.timeout(120)


def test_compose_config_is_valid():
    result = promtool("check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout + result.stderr


def test_generated_config_is_valid(tmp_path):
    sd_file = tmp_path / "targets.json"
    sd_file.write_text('[{"targets": ["127.0.0.1:9"], "labels": {"job": "psserver"}}]')
    path = tmp_path / "prometheus.yml"
    path.write_text(config(scrape_configs=file_sd_job_config(sd_file), rule_files=[str(ALERTS)]))
    result = promtool("check", "config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_are_valid():
    result = promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    found = re.search(r"SUCCESS: (\d+) rules found", result.stdout + result.stderr)
    # The tests' own reader of alerts.yml (tests.observability.promql) sees every rule promtool does.
    assert found and int(found.group(1)) == len(alert_rules_text()), result.stdout


def test_each_alert_fires_on_its_synthetic_series_and_not_on_healthy_ones():
    result = promtool("test", "rules", "alerts_test.yml", cwd=PROMETHEUS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname:\s*(\w+)", (PROMETHEUS_DIR / "alerts_test.yml").read_text()))
    assert tested == {name for name, _ in alert_rules_text()}, "every alert has a unit test"
