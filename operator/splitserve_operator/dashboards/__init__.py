"""Grafana dashboards as code: ``python -m splitserve_operator.dashboards`` writes them
into the chart (``charts/splitserve/dashboards/*.json``); ``--check`` fails when the
committed files differ from what the builder produces (:mod:`.export`). Panels come
from the contract's metric names (:mod:`splitserve.metric_names`).

Pure: may import :mod:`splitserve_operator.api` and the contract package only.
"""
