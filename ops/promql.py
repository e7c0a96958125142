"""The PromQL of the ops files, parsed: which metric names the dashboard and the alert rules read.

Used by the tests to check every name against a real ``/metrics`` scrape of a running pipeline.
Parsing uses ``promql-parser`` (the Rust PromQL parser of GreptimeDB, a dev dependency), so a name is a
name because the grammar says so, not because a regex matched.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

OPS = Path(__file__).resolve().parent
DASHBOARD = OPS / "grafana" / "rollstream.json"
ALERTS = OPS / "alerts.yml"
PROMETHEUS = OPS / "prometheus.yml"

# Grafana's variables -> values PromQL parses (the run picker is inside a quoted matcher already).
_GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}
_LABEL_VALUES = re.compile(r"label_values\((?P<metric>[a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*[a-zA-Z_]+\)")


def metric_names(expr: str) -> set[str]:
    """Every metric name a PromQL expression selects (``up``, ``rollstream_...``); raises ValueError
    when it does not parse."""
    import promql_parser

    for var, value in _GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    try:
        tree = promql_parser.parse(expr)
    except Exception as exc:  # the binding raises a bare Exception subclass per error
        raise ValueError(f"PromQL does not parse: {expr!r}: {exc}") from exc
    names: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if type(node).__name__ == "VectorSelector":
            if node.name:
                names.add(node.name)
            continue
        for attr in ("lhs", "rhs", "expr", "args", "vector_selector", "param"):
            child = getattr(node, attr, None)
            if child is None:
                continue
            stack.extend(child if isinstance(child, list) else [child])
    return names


def dashboard_panels(path: Path = DASHBOARD) -> list[dict[str, Any]]:
    """The dashboard's panels with queries (rows, and panels nested in collapsed rows, flattened)."""
    doc = json.loads(path.read_text())
    flat = []
    for panel in doc["panels"]:
        flat.append(panel)
        flat.extend(panel.get("panels", []))
    return [p for p in flat if p["type"] != "row"]


def dashboard_queries(path: Path = DASHBOARD) -> dict[str, list[str]]:
    """Panel title -> its PromQL expressions, plus the template variables' metric queries."""
    doc = json.loads(path.read_text())
    queries = {p["title"]: [t["expr"] for t in p.get("targets", []) if t.get("expr")] for p in dashboard_panels(path)}
    for var in doc.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            match = _LABEL_VALUES.fullmatch(var["definition"])
            if match is None:
                raise ValueError(f"template variable {var['name']}: cannot read its query {var['definition']!r}")
            queries[f"${var['name']}"] = [match["metric"]]
    return queries


def alert_rules(path: Path = ALERTS) -> list[dict[str, Any]]:
    import yaml

    doc = yaml.safe_load(path.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def all_metric_names() -> set[str]:
    """Every metric name the dashboard and the alert rules read."""
    names: set[str] = set()
    for exprs in dashboard_queries().values():
        for expr in exprs:
            names |= metric_names(expr)
    for rule in alert_rules():
        names |= metric_names(rule["expr"])
    return names
