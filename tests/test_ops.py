"""ops/: the alert rules and the dashboard query only metrics pipeline/metrics.py defines, and the
Prometheus config scrapes every stage port the CLI assigns. Pure file checks, milliseconds."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import yaml  # PyYAML: a dependency of transformers, so always in the venv
from prometheus_client.metrics import MetricWrapperBase

from pipeline import metrics
from pipeline.cli import _stage_port
from stages import STAGE_NAMES

OPS = Path(__file__).resolve().parent.parent / "ops"
METRIC_NAME = re.compile(r"\brollstream_[a-z_]+")
# The sample names prometheus_client exposes per metric type (a Counter's bare name is never exposed).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def exposed_names() -> set[str]:
    """Every sample name the metrics module can expose, from its prometheus_client objects."""
    objects = [v for v in vars(metrics).values() if isinstance(v, MetricWrapperBase)]
    objects += list(metrics.TRAIN_GAUGES.values())
    names: set[str] = set()
    for obj in objects:
        for family in obj.describe():  # one family; its name has no _total, its type says which suffixes
            names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def unknown_names(promql: str, known: set[str]) -> set[str]:
    return set(METRIC_NAME.findall(promql)) - known


def load_alert_rules() -> list[dict]:
    doc = yaml.safe_load((OPS / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard_panels() -> list[dict]:
    doc = json.loads((OPS / "grafana-dashboard.json").read_text())
    # Rows are panels too, with no queries of their own; a collapsed row nests its panels.
    flat = []
    for panel in doc["panels"]:
        flat.append(panel)
        flat.extend(panel.get("panels", []))
    return [p for p in flat if p["type"] != "row"]


def test_exposed_names_follow_prometheus_client() -> None:
    known = exposed_names()
    assert "rollstream_records_in_total" in known
    assert "rollstream_records_in" not in known  # the bare counter name returns nothing in PromQL
    assert {"rollstream_handle_seconds_bucket", "rollstream_handle_seconds_count"} <= known
    assert "rollstream_train_kl" in known
    # The checker itself rejects a name that is not defined.
    assert unknown_names('rate(rollstream_bogus_total{run="x"}[1m]) + rollstream_train_kl', known) == {
        "rollstream_bogus_total"
    }


def test_alert_rules_are_complete_and_use_defined_metrics() -> None:
    known = exposed_names()
    rules = load_alert_rules()
    assert len(rules) >= 5
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)), "alert names must be unique"
    for rule in rules:
        assert set(rule) >= {"alert", "expr", "for", "labels", "annotations"}, rule.get("alert")
        assert re.fullmatch(r"\d+[smh]", str(rule["for"])), (rule["alert"], rule["for"])
        assert rule["labels"].get("severity") in ("warning", "critical"), rule["alert"]
        assert rule["annotations"].get("summary"), rule["alert"]
        assert unknown_names(rule["expr"], known) == set(), rule["alert"]
    exprs = " ".join(rule["expr"] for rule in rules)
    for needed in (
        "rollstream_worker_up",
        "rollstream_records_dead_lettered_total",
        "rollstream_stale_dropped_total",
        "rollstream_learner_version",
    ):
        assert needed in exprs


def test_dashboard_panels_query_defined_metrics() -> None:
    known = exposed_names()
    doc = json.loads((OPS / "grafana-dashboard.json").read_text())
    assert doc["__inputs"][0]["name"] == "DS_PROMETHEUS"
    run_var = next(v for v in doc["templating"]["list"] if v["name"] == "run")
    assert unknown_names(run_var["definition"], known) == set()
    panels = dashboard_panels()
    assert len(panels) >= 20
    queried: set[str] = set()
    for panel in panels:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        exprs = [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
        assert exprs, f"panel {panel['title']!r} has no query"
        for expr in exprs:
            assert unknown_names(expr, known) == set(), (panel["title"], expr)
            assert "$run" in expr, (panel["title"], expr)  # every panel follows the run picker
            queried.update(METRIC_NAME.findall(expr))
    rows = [p["title"] for p in doc["panels"] if p["type"] == "row"]
    assert rows == ["Pipeline", "Staleness", "Rollout", "Reward", "Training"]
    # Every training gauge of ms-swift's names has a panel.
    assert {g.describe()[0].name for g in metrics.TRAIN_GAUGES.values()} <= queried


def test_prometheus_scrapes_every_stage_port() -> None:
    doc = yaml.safe_load((OPS / "prometheus.yml").read_text())
    assert doc["global"]["scrape_interval"] == "5s"
    assert doc["rule_files"] == ["alerts.yml"]
    targets = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in doc["scrape_configs"]
    }
    cfg = SimpleNamespace(run=SimpleNamespace(metrics_port=9400))  # the P the file documents
    for stage in STAGE_NAMES:  # the ports `rollstream worker` actually binds
        assert targets[f"rollstream-{stage}"] == [f"127.0.0.1:{_stage_port(cfg, stage)}"]
