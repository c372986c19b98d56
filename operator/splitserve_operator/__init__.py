"""splitserve operator: reconciles InferenceServices into prefill, decode and router
Deployments and rescales the pools from Prometheus.

Rooms, each importing only from those below it (``.importlinter`` holds the order):

- :mod:`.commands`: the ``splitserve operator`` and ``splitserve advise`` commands;
- :mod:`.control`: every kopf, API-server and Prometheus call;
- :mod:`.render`, :mod:`.planner`, :mod:`.dashboards`: pure cores, independent of
  each other;
- :mod:`.api`: the InferenceService model;
- :mod:`.sim`: the simulator, pure and standing alone (its users are ``advise``,
  the benches and the tests).

Nothing here imports ``splitserve_worker``: what both sides need is in the contract
package, :mod:`splitserve`.
"""
