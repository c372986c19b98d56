"""Metrics the worker alone needs: GPU series through NVML (:mod:`.gpu`). The metric
names, their Prometheus objects and the ``/metrics`` server are the contract's
(:mod:`splitserve.metric_names`, :mod:`splitserve.metric_registry`,
:mod:`splitserve.metric_server`), shared with the operator."""
