"""A small Grafana dashboard model: just what our dashboards use, rendered to the
JSON Grafana (schema 39) and its sidecar load. Pure: no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24
"""Grafana's grid is 24 columns wide."""


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[Target, ...]
    unit: str = "short"
    kind: str = "timeseries"
    """``timeseries`` or ``stat``."""
    description: str = ""
    width: int = 12
    height: int = 8
    thresholds: tuple[tuple[float, str], ...] = ()
    """(value, colour) steps drawn as threshold lines/colours (first is the base)."""
    min: float | None = None
    max: float | None = None
    stack: bool = False


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Variable:
    name: str
    label: str
    query: str = ""
    """PromQL ``label_values(...)`` for a query variable; empty for the others."""
    kind: str = "query"
    """``query``, ``datasource`` or ``custom``."""
    options: tuple[str, ...] = ()
    """For ``custom``: the choices (the first is the default)."""
    description: str = ""


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    variables: tuple[Variable, ...] = ()
    tags: tuple[str, ...] = ("splitserve",)
    refresh: str = "30s"
    time_from: str = "now-1h"
    links: tuple[str, ...] = field(default=())
    """Other dashboards' uids to link to."""

    def panels(self) -> list[Panel]:
        return [p for row in self.rows for p in row.panels]


def _variable(v: Variable) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": v.name,
        "label": v.label,
        "description": v.description,
        "hide": 0,
        "skipUrlSync": False,
    }
    if v.kind == "datasource":
        return {
            **base,
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "options": [],
            "refresh": 1,
            "regex": "",
        }
    if v.kind == "custom":
        options = [{"text": o, "value": o, "selected": i == 0} for i, o in enumerate(v.options)]
        return {
            **base,
            "type": "custom",
            "query": ",".join(v.options),
            "current": {"text": v.options[0], "value": v.options[0], "selected": True},
            "options": options,
        }
    return {
        **base,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": v.query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "definition": v.query,
        "refresh": 2,
        "sort": 1,
        "current": {},
        "options": [],
        "regex": "",
        "includeAll": False,
        "multi": False,
    }


def _panel(p: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    steps = [
        {"color": colour, "value": None if i == 0 else value}
        for i, (value, colour) in enumerate(p.thresholds or ((0.0, "green"),))
    ]
    defaults: dict[str, Any] = {
        "unit": p.unit,
        "thresholds": {"mode": "absolute", "steps": steps},
        "color": {"mode": "palette-classic" if p.kind == "timeseries" else "thresholds"},
    }
    if p.min is not None:
        defaults["min"] = p.min
    if p.max is not None:
        defaults["max"] = p.max
    if p.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10 if p.stack else 0,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if p.stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": "line" if p.thresholds else "off"},
        }
        options: dict[str, Any] = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    else:
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
            "orientation": "auto",
            "justifyMode": "auto",
        }
    return {
        "id": panel_id,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": t.expr,
                "legendFormat": t.legend or "__auto",
                "range": True,
                "editorMode": "code",
            }
            for i, t in enumerate(p.targets)
        ],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
    }


def render(d: Dashboard) -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (deterministic: ids follow the layout)."""
    panels: list[dict[str, Any]] = []
    panel_id = 1
    y = 0
    for row in d.rows:
        panels.append(
            {
                "id": panel_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
                "panels": [],
            }
        )
        panel_id += 1
        y += 1
        x = 0
        line_height = 0
        for p in row.panels:
            if x + p.width > GRID_WIDTH:
                x, y = 0, y + line_height
                line_height = 0
            panels.append(_panel(p, panel_id, x, y))
            panel_id += 1
            x += p.width
            line_height = max(line_height, p.height)
        y += line_height
    return {
        "uid": d.uid,
        "title": d.title,
        "description": d.description,
        "tags": list(d.tags),
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "refresh": d.refresh,
        "time": {"from": d.time_from, "to": "now"},
        "timepicker": {},
        "annotations": {"list": []},
        "links": [
            {
                "type": "dashboards",
                "tags": ["splitserve"],
                "asDropdown": True,
                "title": "splitserve",
                "includeVars": True,
                "keepTime": True,
            }
        ]
        if d.links
        else [],
        "templating": {"list": [_variable(v) for v in d.variables]},
        "panels": panels,
    }


def expressions(rendered: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query in a rendered dashboard."""
    out = []
    for panel in rendered.get("panels", []):
        for target in panel.get("targets", []):
            out.append((str(panel.get("title")), str(target["expr"])))
    return out
