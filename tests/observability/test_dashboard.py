"""The shipped Grafana dashboard and provisioning, read as files: a valid dashboard whose
panels have unique ids and use the provisioned data source or the $datasource variable, and
whose every query (and every alert rule's) selects only metrics that docs/metrics.md lists."""

from __future__ import annotations

import re

import pytest

from tests.observability.promql import (
    DATASOURCES, alert_rules_text, all_panels, allowed_names, contract_metrics, dashboard_queries, load_dashboard,
    metric_names, operands, substitute, unknown_names, variable_queries,
)

pytestmark = pytest.mark.timeout(60)

VARIABLE_DS = {"type": "prometheus", "uid": "${datasource}"}


def provisioned_uid() -> str:
    match = re.search(r"^\s*uid:\s*(\S+)\s*$", DATASOURCES.read_text(), re.M)
    assert match, f"{DATASOURCES} names no uid"
    return match.group(1)


def test_the_contract_table_lists_every_metric_family():
    contract = contract_metrics()
    shard = {n for n in contract if n.startswith("psserver_")}
    worker = {n for n in contract if n.startswith("psworker_")}
    assert len(shard) == 28 and len(worker) == 12, sorted(contract)
    assert contract["psserver_table_rows"].labels == ("state",) and contract["psserver_table_rows"].type == "gauge"
    assert contract["psworker_table_rows_total"].type == "counter"
    assert contract["psserver_rpc_duration_seconds"].labels == ("method", "code")
    assert contract["psserver_data_tasks"].labels == ("state",) and contract["psserver_data_tasks"].type == "gauge"
    assert contract["psserver_data_tasks_requeued_total"].type == "counter"
    assert contract["psworker_step_phase_seconds"].type == "histogram"


def test_dashboard_structure():
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    assert all(isinstance(i, int) and i > 0 for i in ids)
    for panel in panels:
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= grid.keys() and grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["title"], panel["id"]
        if panel["type"] == "row":
            assert not panel.get("targets"), f"row {panel['title']!r} has queries"
            continue
        assert panel["type"] in {"timeseries", "stat", "heatmap", "bargauge", "gauge", "table"}, panel["type"]
        assert panel.get("description"), f"panel {panel['title']!r} does not say what it shows"
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
    # No two panels overlap on the grid.
    cells = {}
    for panel in panels:
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_every_panel_uses_the_provisioned_datasource_or_the_variable():
    dashboard = load_dashboard()
    uid = provisioned_uid()
    allowed = [VARIABLE_DS, {"type": "prometheus", "uid": uid}]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["datasource"]["current"]["value"] == uid
    for panel in all_panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] in allowed, f"panel {panel['title']!r}: {panel['datasource']}"
        for target in panel["targets"]:
            assert target.get("datasource", panel["datasource"]) in allowed, f"{panel['title']!r} {target['refId']}"
    for name in ("job", "instance"):
        assert variables[name]["datasource"] in allowed


def test_queries_are_filtered_by_the_variables_not_hard_coded_names():
    dashboard = load_dashboard()
    for query in dashboard_queries(dashboard):
        for selector in re.findall(r"\b[a-z_:][\w:]*\{[^}]*\}", query.expr):
            assert 'job=~"$job"' in selector and 'instance=~"$instance"' in selector, (query.where, selector)
        assert not re.search(r'\b(job|instance)\s*=\s*"', query.expr), f"{query.where} names a job or instance"
        assert "$__interval" not in query.expr, f"{query.where}: use $__rate_interval"
    assert [v for v, _, _ in variable_queries(dashboard)] == ["job", "instance"]


def test_dashboard_queries_use_only_contract_metrics():
    allowed = allowed_names(contract_metrics())
    queries = list(dashboard_queries(load_dashboard()))
    assert len(queries) >= 30
    used = set()
    for query in queries:
        names = metric_names(query.expr)
        assert names, f"{query.where} selects no metric: {query.expr}"
        assert not unknown_names(query.expr, allowed), f"{query.where}: {unknown_names(query.expr, allowed)}"
        used |= names
    # Everything the issue asks a panel for is plotted.
    for name in ("psworker_samples_total", "psworker_loss", "psworker_test_accuracy",
                 "psworker_step_phase_seconds_sum", "psserver_pull_wait_seconds_total", "psserver_pull_waits_total",
                 "psserver_applied_staleness_bucket", "process_resident_memory_bytes", "process_cpu_seconds_total",
                 "psserver_variable_bytes", "psserver_optimizer_state_bytes", "psserver_inflight_push_bytes",
                 "psserver_rpc_duration_seconds_count", "psserver_workers", "psserver_evictions_total",
                 "psserver_checkpoint_last_success_timestamp_seconds", "psserver_checkpoint_duration_seconds_sum",
                 "psserver_checkpoint_failures_total", "psserver_pushes_total", "psserver_push_bytes_total",
                 "psserver_pull_bytes_total", "psserver_version", "psserver_clock", "psserver_learning_rate",
                 "psworker_retries_total",
                 "psworker_rejoins_total", "psserver_checkpoint_last_id", "psserver_data_epoch", "psserver_data_tasks",
                 "psserver_data_examples", "psserver_data_tasks_requeued_total"):
        assert name in used, f"no panel plots {name}"


def test_alert_rules_use_only_contract_metrics_and_split_into_queries():
    allowed = allowed_names(contract_metrics())
    rules = alert_rules_text()
    assert {name for name, _ in rules} >= {
        "PsserverShardDown", "PsserverWorkerEvicted", "PsworkerNoProgress", "PsserverCheckpointStale",
        "PsserverStalenessAtBound", "PsserverRPCErrors"}
    for name, expr in rules:
        assert not unknown_names(expr, allowed), f"{name}: {unknown_names(expr, allowed)}"
        pieces = operands(expr)
        assert len(pieces) >= 2 and metric_names(pieces[0]), f"{name}: no VALUE OP THRESHOLD shape: {pieces}"


def test_promql_helpers():
    assert metric_names('sum by (le, job) (rate(a_bucket{job=~"$job", le="+Inf"}[$__rate_interval])) / on(job) '
                        "group_left(worker) max by (job, worker) (b_info) > 1e-3") == {"a_bucket", "b_info"}
    assert metric_names("time() - x offset 5m and bool y") == {"x", "y"}
    assert operands('a{x=">"} > bool on(j) group_left(k) 3 * b and on() (c < 2) unless d') == [
        'a{x=">"}', "3 * b", "(c < 2)", "d"]
    assert substitute('r{job=~"$job", instance=~"${instance}"}[$__rate_interval]') == 'r{job=~".*", instance=~".*"}[10s]'
