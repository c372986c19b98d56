"""The dashboards as the chart ships them: each one rendered to its JSON model, and the
exact text of its file."""

from __future__ import annotations

import json
from typing import Any

from splitserve_operator.dashboards.content import DASHBOARDS
from splitserve_operator.dashboards.grafana import render


def build_all() -> dict[str, dict[str, Any]]:
    """File name -> rendered dashboard JSON model."""
    return {name: render(build()) for name, build in DASHBOARDS.items()}


def dump(model: dict[str, Any]) -> str:
    """The exact text committed for a dashboard (stable key order, trailing newline)."""
    return json.dumps(model, indent=2, sort_keys=True) + "\n"
