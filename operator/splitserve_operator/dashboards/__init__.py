"""Grafana dashboards and Prometheus alert rules as code: ``python -m
splitserve_operator.dashboards`` writes them into the chart
(``charts/splitserve/dashboards/*.json``, ``charts/splitserve/alerts/splitserve.rules.json``);
``--check`` fails when the committed files differ from what the builders produce
(:mod:`.export`, :mod:`.alerts`). Panels and alerts come from the contract's metric names
(:mod:`splitserve.metric_names`).

Pure: may import :mod:`splitserve_operator.api` and the contract package only.
"""
