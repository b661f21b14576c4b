"""Reading `deploy/grafana/pdserve.json` the way Grafana does: its panels' queries and its variables."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

from prometheus_client import CollectorRegistry

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "pdserve.json"
# Grafana's own variables a query may use without defining them
BUILTIN_VARIABLES = {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms"}
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_count", "_sum", "_created")}

_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
_METRIC = re.compile(r"\bpdserve_\w+")
_SELECTOR = re.compile(r"\b(pdserve_\w+)\{([^}]*)\}")
_MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"")


class Target(NamedTuple):
    panel: str
    ref_id: str
    expr: str


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def targets(dashboard: dict) -> list[Target]:
    """Every query of every panel (rows' nested panels included); rows themselves hold none."""
    out = []
    for panel in _panels(dashboard["panels"]):
        for t in panel.get("targets", []):
            out.append(Target(panel["title"], t["refId"], t.get("expr", "")))
    return out


def _panels(panels: list[dict]) -> list[dict]:
    flat = []
    for p in panels:
        flat.append(p)
        flat.extend(_panels(p.get("panels", [])))
    return flat


def query_panels(dashboard: dict) -> list[dict]:
    return [p for p in _panels(dashboard["panels"]) if p["type"] != "row"]


def variables(text: str) -> set[str]:
    return {a or b for a, b in _VARIABLE.findall(text)}


def substitute(expr: str, values: dict[str, str]) -> str:
    """What Grafana sends Prometheus: `$name` and `${name}` replaced by the given concrete values."""
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        assert name in values, f"no value for ${name} in {expr}"
        return values[name]

    return _VARIABLE.sub(one, expr)


def metrics_in(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def label_matchers(expr: str) -> list[tuple[str, str]]:
    """(metric, label) for every label matcher of every pdserve selector in `expr`."""
    return [(metric, label) for metric, body in _SELECTOR.findall(expr) for label in _MATCHER.findall(body)]


def exposed_names(registry: CollectorRegistry) -> dict[str, str]:
    """Every series name the registry can expose (with the `_total`/`_bucket`/... suffixes) -> its family."""
    names = {}
    for family in registry.collect():
        for suffix in SUFFIXES[family.type]:
            names[family.name + suffix] = family.name
    return names
