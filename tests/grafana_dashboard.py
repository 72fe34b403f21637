"""The checked-in Grafana dashboard (docs/grafana/kvserve.json): its structure, and the metric names
its PromQL queries read. Test modules check those names against a real scrape."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "kvserve.json"
METRIC = re.compile(r"kvserve:[a-zA-Z0-9_:]+")


def load() -> dict:
    """The dashboard, checked for what Grafana needs to import it."""
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["type"] in ("timeseries", "stat") and p["targets"], p["title"]
        for t in p["targets"]:
            assert t["refId"] and balanced(t["expr"]), (p["title"], t["expr"])
    return dash


def balanced(expr: str) -> bool:
    depth: list[str] = []
    pairs = {")": "(", "]": "[", "}": "{"}
    for c in expr:
        if c in "([{":
            depth.append(c)
        elif c in pairs and (not depth or depth.pop() != pairs[c]):
            return False
    return not depth and expr.count('"') % 2 == 0


def metric_names(dash: dict) -> set[str]:
    """Every metric name the queries (and the variables) name, as a scrape spells it (`_total`, `_bucket`)."""
    names = {m for p in dash["panels"] for t in p.get("targets", ()) for m in METRIC.findall(t["expr"])}
    for v in dash["templating"]["list"]:
        names |= set(METRIC.findall(json.dumps(v.get("query", ""))))
    return names
