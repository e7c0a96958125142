"""ops/: the alert rules and the dashboard query only metrics pipeline/metrics.py defines (their PromQL
parsed with promql-parser), cover what the issue lists, the Prometheus config scrapes every stage port
the CLI assigns, Grafana's provisioning finds the dashboard, promtool accepts the config and rules, and the
rules' unit tests (ops/alerts.test.yml, `promtool test rules`) pass. File checks, milliseconds (promtool: a
second). tests/test_observability_e2e.py checks the same names
against a real scrape of a running pipeline."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml  # PyYAML: a dependency of transformers, so always in the venv
from prometheus_client.metrics import MetricWrapperBase

from config import config_from_dict
from ops import promql
from pipeline import metrics
from rollstream.cli import stage_port
from stages import STAGE_NAMES

OPS = promql.OPS
# The sample names prometheus_client exposes per metric type (a Counter's bare name is never exposed).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def exposed_names() -> set[str]:
    """Every sample name the metrics module can expose, from its prometheus_client objects."""
    objects = [v for v in vars(metrics).values() if isinstance(v, MetricWrapperBase)]
    objects += list(metrics.TRAIN_GAUGES.values()) + list(metrics.EVAL_GAUGES.values())
    names: set[str] = set()
    for obj in objects:
        for family in obj.describe():  # one family; its name has no _total, its type says which suffixes
            names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def unknown_names(expr: str, known: set[str]) -> set[str]:
    """rollstream_* names an expression reads that the metrics module never exposes."""
    return {n for n in promql.metric_names(expr) if n.startswith("rollstream_")} - known


def test_exposed_names_follow_prometheus_client() -> None:
    known = exposed_names()
    assert "rollstream_records_in_total" in known
    assert "rollstream_records_in" not in known  # the bare counter name returns nothing in PromQL
    assert {"rollstream_handle_seconds_bucket", "rollstream_handle_seconds_count"} <= known
    assert "rollstream_train_kl" in known
    # The checker itself rejects a name that is not defined, and reads names only where PromQL has them.
    expr = 'rate(rollstream_bogus_total{run="x", stage="rollstream_not_a_name"}[1m]) + rollstream_train_kl'
    assert unknown_names(expr, known) == {"rollstream_bogus_total"}
    assert promql.metric_names('time() - max by (stage) (up offset 5m)') == {"up"}
    with pytest.raises(ValueError, match="does not parse"):
        promql.metric_names("sum by (run (rollstream_train_kl)")


# The alerts the issue asks for: name -> a metric its expression must read.
REQUIRED_ALERTS = {
    "RollstreamTargetDown": "up",  # stage down: the process is gone
    "RollstreamWorkerStopped": "rollstream_worker_up",  # stage down: its loop ended
    "RollstreamQueueLagGrowing": "rollstream_queue_lag",
    "RollstreamDeadLetters": "rollstream_records_dead_lettered_total",
    "RollstreamStalenessAtLimit": "rollstream_max_staleness",
    "RollstreamNoOptimizerStep": "rollstream_train_step",
    "RollstreamRewardErrorRate": "rollstream_reward_errors_total",
    "RollstreamNaNLossSkipped": "rollstream_train_nan_skipped_total",
    # The weights group (#29): rounds failing, members unreachable or outside it, none at all, a worker behind.
    "RollstreamWeightRoundsFailing": "rollstream_weight_rounds_failed_total",
    "RollstreamWeightMemberUnreachable": "rollstream_weight_member_errors_total",
    "RollstreamWeightMembersOutsideGroup": "rollstream_weight_group_members",
    "RollstreamWeightGroupEmpty": "rollstream_weight_group_members",
    "RollstreamRolloutVersionBehind": "rollstream_rollout_policy_version",
}


def test_alert_rules_are_complete_and_use_defined_metrics() -> None:
    known = exposed_names()
    rules = promql.alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)), "alert names must be unique"
    for rule in rules:
        assert set(rule) >= {"alert", "expr", "for", "labels", "annotations"}, rule.get("alert")
        assert re.fullmatch(r"\d+[smh]", str(rule["for"])), (rule["alert"], rule["for"])
        assert rule["labels"].get("severity") in ("warning", "critical"), rule["alert"]
        assert rule["annotations"].get("summary"), rule["alert"]
        assert unknown_names(rule["expr"], known) == set(), rule["alert"]
    by_name = {rule["alert"]: rule for rule in rules}
    for alert, metric in REQUIRED_ALERTS.items():
        assert alert in by_name, f"missing alert {alert}"
        assert metric in promql.metric_names(by_name[alert]["expr"]), alert
    # The thresholds: lag growing for 5 m, reward errors over 5 %, no optimizer step for 10 m.
    assert by_name["RollstreamQueueLagGrowing"]["for"] == "5m"
    assert "[5m]" in by_name["RollstreamQueueLagGrowing"]["expr"]
    assert by_name["RollstreamRewardErrorRate"]["expr"].endswith("> 0.05")
    assert "[10m]" in by_name["RollstreamNoOptimizerStep"]["expr"]
    # #29: a rollout worker's version behind the learner by more than max_staleness, for minutes.
    behind = by_name["RollstreamRolloutVersionBehind"]
    assert "rollstream_max_staleness" in promql.metric_names(behind["expr"]) and behind["for"] == "5m"


# Per row, panel titles (lower-cased substrings) the issue asks for.
REQUIRED_PANELS = {
    "Pipeline": ["throughput", "queue depth", "lag", "staleness", "drops", "dead letters", "weight-sync"],
    "Training": ["reward", "accuracy per function", "kl", "clip ratio", "lengths", "grad_norm", "learning_rate"],
    "Weights group": ["members", "epoch", "round time p50 / p99", "bytes/s", "failed weights rounds by reason",
                      "member errors by reason", "version per rollout worker"],
}
# Grafana's built-in panel types the dashboard may use (an unknown type renders as "panel plugin not found").
PANEL_TYPES = {"timeseries", "heatmap", "stat", "gauge", "bargauge", "table", "text", "barchart", "histogram"}


def test_dashboard_panels_query_defined_metrics() -> None:
    known = exposed_names()
    doc = json.loads(promql.DASHBOARD.read_text())
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["run"]["type"] == "query"
    queries = promql.dashboard_queries()
    assert unknown_names(queries["$run"][0], known) == set()
    panels = promql.dashboard_panels()
    assert len(panels) >= 25
    queried: set[str] = set()
    for panel in panels:
        assert panel["type"] in PANEL_TYPES, (panel["title"], panel["type"])
        # The datasource variable: the same file works provisioned and imported by hand.
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        exprs = queries[panel["title"]]
        assert exprs, f"panel {panel['title']!r} has no query"
        for expr in exprs:
            assert unknown_names(expr, known) == set(), (panel["title"], expr)
            assert 'run="$run"' in expr, (panel["title"], expr)  # every panel follows the run picker
            queried |= promql.metric_names(expr)
    rows = [p["title"] for p in doc["panels"] if p["type"] == "row"]
    assert rows[0] == "Pipeline" and rows[-1] == "Training"
    # Panels belong to the row above them (grid order).
    by_row: dict[str, list[str]] = {}
    current = ""
    for panel in sorted(doc["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"])):
        if panel["type"] == "row":
            current = panel["title"]
        else:
            by_row.setdefault(current, []).append(panel["title"].lower())
    for row, wanted in REQUIRED_PANELS.items():
        for piece in wanted:
            assert any(piece in title for title in by_row[row]), f"row {row} has no {piece!r} panel"
    assert any(p["type"] == "heatmap" and "staleness" in p["title"].lower() for p in panels)
    # Every training gauge of ms-swift's names has a panel.
    assert {g.describe()[0].name for g in metrics.TRAIN_GAUGES.values()} <= queried
    # So has every weights metric (the group's, and the engines' load time), as its exposed sample names.
    weights = {n for n in known if n.startswith("rollstream_weight_")}
    assert weights - queried <= {n for n in weights if n.endswith(("_count", "_sum", "_created"))}
    assert {"rollstream_weight_round_seconds_bucket", "rollstream_weight_sync_seconds_bucket"} <= queried


def test_grafana_provisioning_loads_the_dashboard() -> None:
    dashboards = yaml.safe_load((OPS / "grafana/provisioning/dashboards/rollstream.yml").read_text())
    provider = dashboards["providers"][0]
    assert dashboards["apiVersion"] == 1 and provider["type"] == "file"
    # Grafana expands $VARS in provisioning files; the documented value is ops/grafana itself.
    assert provider["options"]["path"] == "${ROLLSTREAM_GRAFANA_DIR}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROLLSTREAM_GRAFANA_DIR", str(OPS / "grafana"))
        resolved = Path(os.path.expandvars(provider["options"]["path"]))
    assert (resolved / "rollstream.json").is_file()
    datasources = yaml.safe_load((OPS / "grafana/provisioning/datasources/prometheus.yml").read_text())
    source = datasources["datasources"][0]
    assert source["type"] == "prometheus" and source["url"] == "http://127.0.0.1:9090"
    scrape = yaml.safe_load((OPS / "prometheus.yml").read_text())["global"]["scrape_interval"]
    assert source["jsonData"]["timeInterval"] == scrape


def test_prometheus_scrapes_every_stage_port() -> None:
    doc = yaml.safe_load((OPS / "prometheus.yml").read_text())
    assert doc["global"]["scrape_interval"] == "5s"
    assert doc["rule_files"] == ["alerts.yml"]
    targets = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in doc["scrape_configs"]
    }
    cfg = config_from_dict({"reward": {"reward_funcs": ["accuracy"]}, "run": {"metrics_port": 9400}})  # the P the file documents
    for stage in STAGE_NAMES:  # the ports `rollstream worker` actually binds
        assert targets[f"rollstream-{stage}"] == [f"127.0.0.1:{stage_port(cfg, stage)}"]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        # `make test` installs Debian's prometheus package (promtool) when apt can; say so when it could not.
        pytest.skip("promtool not found: `apt-get install prometheus` (make test tries) to run this check")
    return path


@pytest.mark.parametrize("what, file", [("config", "prometheus.yml"), ("rules", "alerts.yml")])
def test_promtool_accepts_ops_files(what: str, file: str) -> None:
    done = subprocess.run([promtool(), "check", what, str(OPS / file)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    # The check above can fail: a rule with a PromQL syntax error is refused.
    bad = tmp_path / "bad.yml"
    bad.write_text("groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: sum by (run (up)\n")
    done = subprocess.run(
        [promtool(), "check", "rules", str(bad)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode != 0


# Alerts older than their unit tests (ops/alerts.test.yml): every newer alert has a case that fires and one
# that does not. Remove a name here when its case is written.
UNTESTED_ALERTS = {
    "RollstreamTargetDown", "RollstreamWorkerStopped", "RollstreamWorkerStalled", "RollstreamDeadLetters",
    "RollstreamStaleDrops", "RollstreamRewardErrorRate", "RollstreamQueueLagGrowing", "RollstreamPendingNotAcked",
    "RollstreamNoOptimizerStep", "RollstreamStalenessAtLimit", "RollstreamNaNLossSkipped",
}


def test_alert_unit_tests_cover_the_rules() -> None:
    rules = {rule["alert"] for rule in promql.alert_rules()}
    doc = yaml.safe_load((OPS / "alerts.test.yml").read_text())
    assert doc["rule_files"] == ["alerts.yml"]
    fires: set[str] = set()
    silent: set[str] = set()
    for case in doc["tests"]:
        for check in case["alert_rule_test"]:
            # promtool passes an empty expectation for an alert name no rule has: the name must exist.
            assert check["alertname"] in rules, check["alertname"]
            (fires if check["exp_alerts"] else silent).add(check["alertname"])
    assert UNTESTED_ALERTS <= rules and not UNTESTED_ALERTS & (fires | silent), "update UNTESTED_ALERTS"
    assert rules - UNTESTED_ALERTS <= fires & silent, f"alerts without a firing and a silent case: {sorted((rules - UNTESTED_ALERTS) - (fires & silent))}"


def promtool_test_rules(test_file: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [promtool(), "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60, check=False
    )


def test_promtool_alert_unit_tests_pass() -> None:
    done = promtool_test_rules(OPS / "alerts.test.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_promtool_alert_unit_tests_can_fail(tmp_path: Path) -> None:
    # The same tests against a rule that misses a failure counter born at 3 between two scrapes (plain
    # increase(), which needs two samples): the case that expects the alert fails.
    rules = (OPS / "alerts.yml").read_text()
    term = "(rollstream_weight_rounds_failed_total unless rollstream_weight_rounds_failed_total offset 10m) or "
    assert term in rules
    (tmp_path / "alerts.yml").write_text(rules.replace(term, ""))
    shutil.copy(OPS / "alerts.test.yml", tmp_path / "alerts.test.yml")
    done = promtool_test_rules(tmp_path / "alerts.test.yml")
    assert done.returncode != 0
    assert "RollstreamWeightRoundsFailing" in done.stdout + done.stderr
