"""Control: all of the operator's I/O. kopf registrations (:mod:`.handlers`), the
controller that routes each trigger (:mod:`.controller`, :mod:`.cache`,
:mod:`.serializer`), one reconcile (:mod:`.reconciler`, :mod:`.outcome`,
:mod:`.bodies`, :mod:`.merge`), the Kubernetes and Prometheus adapters (:mod:`.k8s`,
:mod:`.prometheus`), the autoscaling loop (:mod:`.autoscaling`), the operator's
settings (:mod:`.config`) and running it in the foreground (:mod:`.runtime`).

May import kopf, kubernetes, httpx, the pure rooms (:mod:`~splitserve_operator.render`,
:mod:`~splitserve_operator.planner`, :mod:`~splitserve_operator.api`) and the contract
package; never the simulator or ``splitserve_worker``.
"""
