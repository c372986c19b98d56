"""The autoscaling loop: every tick, Prometheus in (:mod:`..prometheus`), the pure
planner's decision out to the cluster (:mod:`.loop`), with its knobs (:mod:`.config`),
what it writes back (:mod:`.status`: its part of the status, the condition, the Events), the
operator's own series (:mod:`.metrics`) and its clock, one operator-wide task
(:mod:`.schedule`; no kopf timer, so no finalizer on the services it scales).

Part of :mod:`splitserve_operator.control`, under the same import rules.
"""
