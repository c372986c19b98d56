"""Control: all of the operator's I/O. kopf registrations (:mod:`.handlers`) and what kopf
remembers of each object to detect changes (:mod:`.diffbase`), the
controller that routes each trigger (:mod:`.controller`, :mod:`.cache`,
:mod:`.serializer`, :mod:`.backoff`), one reconcile with server-side apply
(:mod:`.reconciler`, :mod:`.outcome`, :mod:`.bodies`, and :mod:`.ownership`: what a
field manager owns and whether an apply is due), the Kubernetes and Prometheus adapters
(:mod:`.k8s`, :mod:`.prometheus`), the autoscaling loop (:mod:`.autoscaling`), leader
election on a Lease (:mod:`.leader`), the liveness endpoint (:mod:`.health`), periodic
threads (:mod:`.periodic`), the operator's settings (:mod:`.config`) and running it
(:mod:`.runtime`).

May import kopf, kubernetes, httpx, the pure rooms (:mod:`~splitserve_operator.render`,
:mod:`~splitserve_operator.planner`, :mod:`~splitserve_operator.api`) and the contract
package; never the simulator or ``splitserve_worker``.
"""
