"""Metrics: names defined once (:mod:`.names`), Prometheus objects in :mod:`.registry`."""
