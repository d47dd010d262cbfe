"""A real Prometheus (Debian's ``prometheus`` package) and its ``promtool``, for the tests.

``tool(name)`` finds a binary; where it is missing the test fails when the ``CI`` environment
variable is set (``.ci/run`` installs the package) and is skipped otherwise. ``Prometheus``
runs one server on a free loopback port with a generated configuration and its storage under
the test's directory; ``PrometheusAPI`` answers queries through the HTTP API of any Prometheus
(the docker tier's, in a container). ``dashboard_query_list``, ``loaded_alert_queries`` and
``without_data`` list the dashboard's and the alert rules' queries and the ones without data.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import terminate
from tests.observability.promql import dashboard_queries, load_dashboard, metric_names, operands, substitute

INSTALL_HINT = "apt-get install -y --no-install-recommends prometheus (Debian's package, 2.42, has promtool too)"


def tool(name: str) -> str:
    """Path of ``prometheus`` or ``promtool``. Fails in CI when missing, skips elsewhere."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed: {INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def promtool(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def config(*, scrape_configs: list[dict], rule_files: list[str], interval: str = "1s") -> str:
    """A Prometheus configuration as YAML text (JSON, which YAML includes: no YAML library needed)."""
    return json.dumps({
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "rule_files": rule_files,
        "scrape_configs": scrape_configs,
    }, indent=2)


def file_sd_job_config(sd_file: Path) -> list[dict]:
    """One scrape job reading targets (and their ``job`` labels) from a file-based discovery file
    such as ``pscluster --metrics-sd-file`` writes."""
    return [{"job_name": "pscluster", "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": "1s"}]}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusError(AssertionError):
    pass


class PrometheusAPI:
    """A Prometheus server's HTTP API at ``url`` (one this test runs, or one in a container)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: str) -> dict | list:
        """``GET /api/v1/PATH?params``'s ``data``. Raises ``PrometheusError`` on an error answer."""
        query = urllib.parse.urlencode(params, doseq=True)
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query now; the result's series (a scalar answer as one series with no labels)."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        if data["resultType"] == "matrix":
            return [{"metric": s["metric"], "value": s["values"][-1]} for s in data["result"] if s["values"]]
        return data["result"]

    def finite_series(self, expr: str) -> list[dict]:
        """The series of ``query(expr)`` whose value is a finite number."""
        return [s for s in self.query(expr) if math.isfinite(float(s["value"][1]))]

    def value(self, expr: str) -> float | None:
        """The largest finite value ``expr`` has now, or None when it has none."""
        values = [float(s["value"][1]) for s in self.finite_series(expr)]
        return max(values) if values else None

    def targets(self) -> list[dict]:
        return self.api("targets", state="active")["activeTargets"]

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]


class Prometheus(PrometheusAPI):
    """One ``prometheus`` process. Use as a context manager; ``stop()`` is idempotent."""

    def __init__(self, directory: Path, config_text: str, *, start_timeout: float = 30.0) -> None:
        self.directory = directory
        self.config_file = directory / "prometheus.yml"
        self.config_file.write_text(config_text)
        self.log_path = directory / "prometheus.log"
        binary = tool("prometheus")
        for _attempt in range(3):  # the free port may be taken between our probe and its bind
            self.port = _free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            with open(self.log_path, "w") as log:
                self.popen = subprocess.Popen(
                    [binary, f"--config.file={self.config_file}", f"--storage.tsdb.path={directory / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h",
                     "--log.level=info"],
                    stdout=log, stderr=subprocess.STDOUT, cwd=directory,
                )
            if self._wait_ready(start_timeout):
                return
            if "address already in use" not in self.log():
                break
        raise PrometheusError(f"prometheus did not become ready within {start_timeout}s:\n{self.log()[-3000:]}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            try:
                self.popen.wait(timeout=0.2)  # paces the polling; returns at once if it died
                return False
            except subprocess.TimeoutExpired:
                pass
        self.stop()
        return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        terminate(self.popen)

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_for(predicate, timeout: float, what: str, *, pace: subprocess.Popen, explain=lambda: ""):
    """Poll ``predicate`` until it returns something truthy (returned), failing after ``timeout``
    seconds with ``what`` and ``explain()``; each pause waits on ``pace`` (Prometheus), so a dead
    Prometheus ends the wait at once."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{explain()}")
        try:
            pace.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            continue
        raise AssertionError(f"prometheus exited with {pace.returncode} while waiting for {what}")


def loaded_alert_queries(prom: PrometheusAPI) -> list[tuple[str, str]]:
    """``(where, query)``: each metric-selecting operand of each alerting rule Prometheus loaded."""
    queries = []
    for group in prom.api("rules", type="alert")["groups"]:
        for rule in group["rules"]:
            for i, piece in enumerate(operands(rule["query"])):
                if metric_names(piece):
                    queries.append((f"alert {rule['name']} operand {i}", piece))
    return queries


def dashboard_query_list(rate_interval: str | None = None) -> list[tuple[str, str]]:
    """``(where, query)``: every query of the Grafana dashboard, its variables substituted."""
    return [(q.where, substitute(q.expr, rate_interval)) for q in dashboard_queries(load_dashboard())]


def without_data(prom: PrometheusAPI, queries: list[tuple[str, str]]) -> list[str]:
    """The queries that return no series with a finite value now, with what they returned. A
    query Prometheus refuses (a syntax error) fails the test at once."""
    missing = []
    for where, expr in queries:
        try:
            series = prom.query(expr)
        except PrometheusError as exc:
            raise AssertionError(f"{where}: Prometheus refused {expr!r}: {exc}") from None
        if not any(math.isfinite(float(s["value"][1])) for s in series):
            missing.append(f"{where}: {expr}\n    -> {[(s['metric'], s['value'][1]) for s in series[:4]]}")
    return missing
