"""Pure rendering: an InferenceService spec in, the desired Kubernetes objects out
(:mod:`.manifests`; names and labels in :mod:`.names`, replica counts and who may
write them in :mod:`.replicas`, the pools' scalable WorkerPools in :mod:`.pools`, the
worker and router command lines in :mod:`.commands`, the Deployments in
:mod:`.workloads`, the objects around them in :mod:`.support`, the router's URL and
HTTPRoute in :mod:`.routes`, pod security in :mod:`.security`).

No kopf, no Kubernetes client, no gRPC here (``.importlinter`` enforces it), so every
field's effect is testable with plain dicts. May import :mod:`splitserve_operator.api`
and the contract package only.
"""
