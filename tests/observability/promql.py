"""What the observability tests read out of the shipped dashboard, alert rules and metric
reference: PromQL expressions, the metric names they use, and the contract's names.

Pure text handling, no Prometheus needed: the static tests use it on the files, the live tests
on what a real Prometheus loaded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "psgrpc.json"
DATASOURCES = ROOT / "docker" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROMETHEUS_DIR = ROOT / "docker" / "prometheus"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
METRICS_DOC = ROOT / "docs" / "metrics.md"

# Names PromQL gives meaning to that are not metrics. Functions are told apart by the "(" after them.
_KEYWORDS = frozenset({
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "offset", "inf", "nan", "atan2", "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk",
    "bottomk", "quantile", "count_values", "group",
})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w.:$])[A-Za-z_:][A-Za-z0-9_:]*")
_COMPARISON = ("==", "!=", ">=", "<=", ">", "<")
_SET_OPS = ("and", "or", "unless")
_MODIFIER = re.compile(r"\s*(?:bool\b)?\s*(?:(?:on|ignoring)\s*\([^()]*\))?\s*(?:(?:group_left|group_right)\s*(?:\([^()]*\))?)?")

# What the tests put for Grafana's variables: every job and instance, and a rate window that
# holds about ten samples at the tests' one-second scrape interval.
GRAFANA_VARIABLES = {"$__rate_interval": "10s", "${job}": ".*", "$job": ".*", "${instance}": ".*", "$instance": ".*"}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers that are not inside strings, label
    matchers, range brackets or label lists, are not followed by "(" (functions, aggregations)
    and are not keywords. Grafana variables (``$name``) are not names."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)
    text = _LABEL_LIST.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        name = match.group()
        rest = text[match.end():].lstrip()
        if rest.startswith("(") or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def operands(expr: str) -> list[str]:
    """Split an expression at its top-level (outside any bracket or string) comparison and set
    operators (``==``, ``>``, ``and``, ``or``, ...; with their ``bool``, ``on(...)``,
    ``group_left(...)`` modifiers) and return the pieces, stripped. An alert ``VALUE > THRESHOLD
    and on(job) CONDITION`` gives ``[VALUE, THRESHOLD, CONDITION]``: each piece that selects a
    metric is a query of its own that has data on a healthy cluster, where the alert does not
    fire."""
    pieces, depth, start, i = [], 0, 0, 0
    while i < len(expr):
        string = _STRING.match(expr, i)
        if string:
            i = string.end()
            continue
        char = expr[i]
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif depth == 0:
            op = next((c for c in _COMPARISON if expr.startswith(c, i)), None)
            if op is None and (i == 0 or not (expr[i - 1].isalnum() or expr[i - 1] == "_")):
                op = next((w for w in _SET_OPS if re.match(rf"{w}\b", expr[i:])), None)
            if op is not None:
                pieces.append(expr[start:i])
                i = _MODIFIER.match(expr, i + len(op)).end()
                start = i
                continue
        i += 1
    pieces.append(expr[start:])
    return [p.strip() for p in pieces if p.strip()]


def substitute(expr: str, rate_interval: str | None = None) -> str:
    """A Grafana query as Prometheus takes it, the variables replaced by :data:`GRAFANA_VARIABLES`
    (``$__rate_interval`` by ``rate_interval`` when given: four scrape intervals or more)."""
    values = dict(GRAFANA_VARIABLES, **({"$__rate_interval": rate_interval} if rate_interval else {}))
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(name, values[name])
    return expr


@dataclass(frozen=True)
class Query:
    where: str  # "panel 12 'Loss' target A", "alert PsserverShardDown"
    expr: str


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries(dashboard: dict) -> Iterator[Query]:
    """Every panel target's ``expr``, nested row panels included."""
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield Query(f"panel {panel['id']} {panel.get('title')!r} target {target.get('refId')}", target["expr"])


def _panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def all_panels(dashboard: dict) -> list[dict]:
    return list(_panels(dashboard["panels"]))


def variable_queries(dashboard: dict) -> Iterator[tuple[str, str, str]]:
    """``(variable, metric selector, label)`` of each ``label_values(SELECTOR, LABEL)`` variable."""
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query.strip())
        assert match, f"variable {variable['name']}: expected label_values(SELECTOR, LABEL), got {query!r}"
        yield variable["name"], match.group(1).strip(), match.group(2)


def alert_rules_text() -> list[tuple[str, str]]:
    """``(alert name, expr)`` of every rule in alerts.yml, read from its text: ``- alert: NAME``
    then ``expr: ONE LINE`` or ``expr: |`` and an indented block. (The live tests read the rules
    Prometheus itself loaded; promtool's count of rules guards this reader.)"""
    rules, name = [], None
    lines = ALERTS.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        alert = re.match(r"\s*-\s*alert:\s*(\S+)\s*$", line)
        expr = re.match(r"(\s*)expr:\s*(.*)$", line)
        if alert:
            name = alert.group(1)
        elif expr and name is not None:
            indent, value = len(expr.group(1)), expr.group(2).strip()
            if value in ("|", "|-", ">", ">-"):
                block = []
                i += 1
                while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                    block.append(lines[i].strip())
                    i += 1
                value = " ".join(b for b in block if b)
                rules.append((name, value))
                name = None
                continue
            rules.append((name, value.strip("'\"")))
            name = None
        i += 1
    return rules


@dataclass(frozen=True)
class ContractMetric:
    name: str
    type: str
    labels: tuple[str, ...]


def contract_metrics() -> dict[str, ContractMetric]:
    """The metric reference table of docs/metrics.md: rows ``| `name` | type | `label`, ... | ...``."""
    found = {}
    for line in METRICS_DOC.read_text().splitlines():
        match = re.match(r"\|\s*`((?:psserver|psworker)_\w+)`\s*\|\s*(counter|gauge|histogram|info)\s*\|([^|]*)\|", line)
        if match:
            labels = tuple(re.findall(r"`(\w+)`", match.group(3)))
            found[match.group(1)] = ContractMetric(match.group(1), match.group(2), labels)
    return found


def allowed_names(contract: dict[str, ContractMetric]) -> set[str]:
    """Series names a query may select: the contract's (a histogram's ``_bucket``, ``_sum`` and
    ``_count``), and Prometheus' ``up``; ``process_*`` are checked by prefix."""
    names = {"up"}
    for metric in contract.values():
        if metric.type == "histogram":
            names |= {f"{metric.name}_bucket", f"{metric.name}_sum", f"{metric.name}_count"}
        else:
            names.add(metric.name)
    return names


def unknown_names(expr: str, allowed: set[str]) -> set[str]:
    return {n for n in metric_names(expr) if n not in allowed and not n.startswith("process_")}
