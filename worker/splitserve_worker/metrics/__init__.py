"""Metrics: Prometheus objects for the contract's metric names (:mod:`splitserve.metric_names`)
in :mod:`.registry`, the ``/metrics`` server, and GPU series through NVML."""
