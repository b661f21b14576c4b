"""The Grafana dashboard and the Prometheus/Grafana config files, checked against the Metrics registry."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from planner.watch import WatchGauges
from router.metrics import Metrics
from tests.observability.dashboard import (
    BUILTIN_VARIABLES,
    REPO,
    exposed_names,
    label_matchers,
    load_dashboard,
    metrics_in,
    query_panels,
    targets,
    variables,
)
from tests.observability.factories import drive_every_hook

DEPLOY = REPO / "deploy"


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return load_dashboard()


@pytest.fixture(scope="module")
def metrics() -> Metrics:
    m = Metrics("tiny")
    drive_every_hook(m)
    # `pdserve serve --autoscale` puts the planner's gauges in the router's registry
    WatchGauges(None, registry=m.registry).record(1.0, {"prefill": 1, "decode": 1}, None, [])
    return m


def test_dashboard_is_a_grafana_10_dashboard(dashboard):
    assert dashboard["schemaVersion"] >= 38  # Grafana 10.0
    assert dashboard["uid"] == "pdserve" and dashboard["title"]
    ids = [p["id"] for p in query_panels(dashboard)]
    assert len(ids) == len(set(ids))
    for p in query_panels(dashboard):
        assert p["type"] in ("timeseries", "stat", "gauge", "bargauge", "table", "heatmap"), p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0, p["title"]


def test_panels_do_not_overlap(dashboard):
    cells: dict[tuple[int, int], str] = {}
    for p in dashboard["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


def test_template_variables_are_defined(dashboard):
    defined = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert defined["datasource"]["type"] == "datasource" and defined["datasource"]["query"] == "prometheus"
    for name in ("worker", "pool"):
        v = defined[name]
        assert v["type"] == "query" and v["multi"] and v["includeAll"] and v["allValue"] == ".*", name
    texts = [t.expr for t in targets(dashboard)] + [v.get("definition", "") for v in defined.values()]
    for text in texts:
        unknown = variables(text) - set(defined) - BUILTIN_VARIABLES
        assert not unknown, f"{text}: undefined variables {unknown}"


def test_every_panel_has_a_query(dashboard):
    panels = query_panels(dashboard)
    assert len(panels) >= 10
    for p in panels:
        assert p.get("targets"), f"panel {p['title']!r} has no query"
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"], p["title"]


def test_every_referenced_metric_exists_with_the_labels_it_is_filtered_by(dashboard, metrics):
    exposed = exposed_names(metrics.registry)
    labels: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in fam.samples:
            labels.setdefault(s.name, set()).update(s.labels)
    for t in targets(dashboard):
        names = metrics_in(t.expr)
        assert names, f"{t.panel}/{t.ref_id}: no pdserve metric in {t.expr}"
        for name in names:
            assert name in exposed, f"{t.panel}/{t.ref_id}: {name} is not in the Metrics registry"
        for name, label in label_matchers(t.expr):
            assert label in labels[name], f"{t.panel}/{t.ref_id}: {name} has no label {label!r}"


def test_the_dashboard_covers_every_metric(dashboard, metrics):
    used = {exposed_names(metrics.registry)[n] for t in targets(dashboard) for n in metrics_in(t.expr)}
    families = set(exposed_names(metrics.registry).values())
    assert families - used == set()


def test_prometheus_config_scrapes_pdserve():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "pdserve"]
    assert job["metrics_path"] == "/metrics"
    assert "127.0.0.1:9400" in job["static_configs"][0]["targets"]
    promtool = shutil.which("promtool")
    if promtool is not None:  # shipped with the Debian prometheus package CI installs
        subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                       check=True, capture_output=True, timeout=60)


def test_grafana_provisioning_names_a_prometheus_datasource_and_the_dashboards_folder():
    prov = DEPLOY / "grafana" / "provisioning"
    sources = yaml.safe_load((prov / "datasources" / "pdserve.yaml").read_text())
    assert sources["apiVersion"] == 1
    assert [d["type"] for d in sources["datasources"]] == ["prometheus"]
    providers = yaml.safe_load((prov / "dashboards" / "pdserve.yaml").read_text())
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
