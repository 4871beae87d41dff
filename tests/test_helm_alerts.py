"""The chart's alerts (metrics.prometheusRule), rendered by Helm's own engine: every rule parses
as PromQL and reads only series the operator exports, under the labels Prometheus stores once it
scrapes them through the chart's ServiceMonitor (the target's `job` and `namespace` come first,
so the operator's own `namespace` and `job` labels become `exported_namespace` and
`exported_job`), and every selector names this release's operator."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python
import prometheus_client
import promql_parser
import pytest
import yaml

from huorn.operator import metrics

CHART = Path(__file__).resolve().parents[1] / "helm" / "huorn"
NAMESPACE = "huorn-system"
# What a ServiceMonitor's scrape puts on every series it stores, besides the metric's own labels.
TARGET_LABELS = {"job", "namespace", "instance", "pod", "service", "endpoint", "container"}
RENAMED = {"job": "exported_job", "namespace": "exported_namespace"}
ENABLED = {"metrics": {"serviceMonitor": {"enabled": True},
                       "prometheusRule": {"enabled": True, "labels": {"release": "prom"}}}}


def _render(values: dict[str, Any]) -> list[dict[str, Any]]:
    files = helm_python.Chart.load(CHART).render(values, name="huorn", namespace=NAMESPACE)
    return [d for path, text in files.items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def _stored_series() -> dict[str, set[str]]:
    """Each series name the operator's registry exposes, with its labels as Prometheus stores
    them after the scrape (renamed where a target label takes the name), plus `up`."""
    registry = metrics.OperatorMetrics()
    series: dict[str, set[str]] = {"up": set(TARGET_LABELS)}
    for collector in vars(registry).values():
        if not isinstance(collector, prometheus_client.metrics.MetricWrapperBase):
            continue
        names = collector._labelnames  # the declared label names
        child = collector.labels(*["x"] * len(names)) if names else collector
        child.inc() if hasattr(child, "inc") else child.observe(1.0)
        labels = {RENAMED.get(n, n) for n in names} | TARGET_LABELS
        for family in collector.collect():
            for sample in family.samples:
                series[sample.name] = labels | ({"le"} if sample.name.endswith("_bucket") else set())
    return series


def _alerts() -> list[dict[str, Any]]:
    (rule,) = [d for d in _render(ENABLED) if d["kind"] == "PrometheusRule"]
    assert rule["metadata"]["namespace"] == NAMESPACE and rule["metadata"]["labels"]["release"] == "prom"
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def test_no_rule_unless_asked_and_none_without_the_scrape_it_reads() -> None:
    assert not [d for d in _render({}) if d["kind"] == "PrometheusRule"]
    # without the ServiceMonitor nothing produces `up`: HuornOperatorDown would fire from the install on
    with pytest.raises(helm_python.HelmRenderError, match=r"needs metrics\.serviceMonitor\.enabled"):
        _render({"metrics": {"prometheusRule": {"enabled": True}}})
    # with no operator pod to run, the chart does not alert that none runs (found by review)
    scaled_to_zero = {**ENABLED, "replicaCount": 0}
    (rule,) = [d for d in _render(scaled_to_zero) if d["kind"] == "PrometheusRule"]
    assert "HuornOperatorDown" not in {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}


def test_the_down_alert_names_its_release() -> None:
    """absent() returns a series without labels: the alert carried only alertname and severity,
    so namespace routing missed it and two releases' alerts read as one (found by review)."""
    (down,) = [a for a in _alerts() if a["alert"] == "HuornOperatorDown"]
    assert (down["labels"]["namespace"], down["labels"]["job"]) == (NAMESPACE, "huorn-metrics")


def test_every_rule_but_the_down_alert_reads_the_leader_only() -> None:
    """A standby keeps the gauges it set while it led (kopf pauses its handlers): read from every
    pod, a demoted leader's Stalled job or short InferenceJob fired for ever (found by review)."""
    for alert in _alerts():
        if alert["alert"] in ("HuornOperatorDown", "HuornReconcileErrors"):  # `up`; a counter's rate
            continue
        gauges = alert["expr"].count("huorn_") - alert["expr"].count("huorn_leader")
        assert alert["expr"].count("and on (pod) (huorn_leader{") == gauges, alert["expr"]


def test_every_alert_reads_series_the_operator_exports_under_their_stored_labels() -> None:
    series = _stored_series()
    docs = _render(ENABLED)
    (service,) = [d for d in docs if d["kind"] == "Service"
                  and any(p["name"] == "metrics" for p in d["spec"]["ports"])]
    alerts = _alerts()
    assert {a["alert"] for a in alerts} == {
        "HuornOperatorDown", "HuornReconcileErrors", "HuornJobStalled",
        "HuornInferenceJobReplicasNotReady", "HuornLineWaitsOnUnusableNodes"}
    for alert in alerts:
        expr = promql_parser.parse(alert["expr"])  # a syntax error raises here
        selected: set[str] = set()
        grouped: list[str] = []

        def visit(node: Any, alert: dict[str, Any] = alert, selected: set[str] = selected,
                  grouped: list[str] = grouped) -> bool:
            if isinstance(node, promql_parser.VectorSelector):
                assert node.name in series, (alert["alert"], node.name)
                matchers = {m.name: m.value for m in node.matchers.matchers}
                assert set(matchers) <= series[node.name], (alert["alert"], node.name, matchers)
                # this release's operator: its metrics Service (the scrape's job) and namespace
                assert (matchers.get("job"), matchers.get("namespace")) == (
                    service["metadata"]["name"], NAMESPACE), (alert["alert"], matchers)
                selected.update(series[node.name])
            elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
                grouped.extend(node.modifier.labels)
                # a series whose own `job`/`namespace` were renamed is grouped by the renamed
                # ones: by `job`/`namespace` alone it would be grouped by the scrape target (one
                # operator), not by the InferenceJob it counts
                inner: list[str] = []
                promql_parser.walk(node.expr, lambda n: inner.append(n.name)
                                   if isinstance(n, promql_parser.VectorSelector) else None)
                if any(set(RENAMED.values()) & series[name] for name in inner):
                    assert set(RENAMED.values()) <= set(node.modifier.labels), (alert["alert"],
                                                                                node.modifier.labels)
            elif isinstance(node, promql_parser.BinaryExpr) and node.modifier and node.modifier.matching:
                grouped.extend(node.modifier.matching.labels)
            return True

        promql_parser.walk(expr, visit)
        assert set(grouped) <= selected, (alert["alert"], set(grouped) - selected)


@pytest.mark.parametrize("field", ["summary", "description"])
def test_every_alert_says_what_and_how_bad(field: str) -> None:
    for alert in _alerts():
        assert alert["labels"]["severity"] in ("critical", "warning", "info") and alert["for"]
        text = alert["annotations"][field]
        assert text and "{{ ." not in text and "{{-" not in text, text  # no Helm template left over
        # Prometheus' own templates survive Helm's: each names a label the alert's series keep
        for label in [part.split("}}")[0].strip() for part in text.split("{{ $labels.")[1:]]:
            assert label in {"kind", "exported_namespace", "exported_job", "virtual_cluster"}, (alert, label)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian: prometheus) is not installed")
def test_the_alerts_fire_as_promtool_evaluates_them(tmp_path: Path) -> None:
    """Evaluated by Prometheus' own engine on series as the scrape stores them: a demoted leader's
    frozen gauges fire nothing, the leader's short InferenceJob and its line waiting on unusable
    nodes fire, and HuornOperatorDown carries the release's namespace and job."""
    (rule,) = [d for d in _render(ENABLED) if d["kind"] == "PrometheusRule"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    shutil.copy(Path(__file__).parent / "data" / "prometheusrule_cases.yaml", tmp_path / "cases.yaml")
    done = subprocess.run(["promtool", "test", "rules", "cases.yaml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
