"""The autoscaling loop: every tick, Prometheus in (:mod:`..prometheus`), the pure
planner's decision out to the cluster (:mod:`.loop`), with its knobs (:mod:`.config`),
what it writes back (:mod:`.status`: the status patch, the condition, the Events), the
operator's own series (:mod:`.metrics`) and its kopf timer (:mod:`.handlers`).

Part of :mod:`splitserve_operator.control`, under the same import rules.
"""
