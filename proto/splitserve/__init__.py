"""splitserve's contract: what the operator and the worker (router and engine included)
must agree on, and nothing else.

- :mod:`splitserve.v1`: the gRPC contract between router, prefill and decode workers
  (generated from ``v1/worker.proto``; the generated code is committed).
- :mod:`splitserve.metric_names`: every metric name, kind, label and bucket splitserve
  exports, read by the workers that export them and by the operator's planner queries,
  dashboards and alerts.
- :mod:`splitserve.roles`: the roles a worker serves, and the metadata a worker that is
  switching its role marks its refusals with.
- :mod:`splitserve.role_balance`: when a switchable worker should change role (pure),
  decided alike by the operator's planner and by ``splitserve up --flex``.
- :mod:`splitserve.sampling`: a request's sampling parameters and their bounds, built by
  the router, sent by the worker client, read back by the worker and followed by the
  engine's sampler.
- :mod:`splitserve.prefix_hash`: the chained hash of KV blocks, computed alike by the
  engine (naming cached blocks) and the router (finding who holds a prefix).
- :mod:`splitserve.grpc_options`: the channel and server options and the token metadata
  every gRPC client and server of the worker contract uses.
- :mod:`splitserve.tls`: the TLS settings every part takes (the same flags on workers
  and router) and the ``ssl`` contexts and grpcio credentials made from them.
- :mod:`splitserve.kv_compat`: the fields that make two workers' KV caches
  interchangeable, their hash, and the check that names what differs.

Modules here import the standard library only (``v1`` also needs protobuf and grpcio,
and :mod:`.tls` makes grpcio's credentials), so either side can use them without the
other's dependencies.
"""
