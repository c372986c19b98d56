"""The autoscaling loop: every tick, Prometheus in (:mod:`..prometheus`), the pure
planner's decision out to the cluster (:mod:`.loop`), with its knobs (:mod:`.config`),
what it writes back (:mod:`.status`: its part of the status, the condition, the Events), the
operator's own series (:mod:`.metrics`), the switchable pods of a ``spec.flex`` (:mod:`.flex`:
their split, read from and switched by their role label) and its clock, one operator-wide task
(:mod:`.schedule`; no kopf timer, so no finalizer on the services it scales).

Part of :mod:`splitserve_operator.control`, under the same import rules.
"""
