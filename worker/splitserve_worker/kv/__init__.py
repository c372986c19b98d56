"""Moving a prompt's KV cache from a prefill worker into a decode worker's reserved blocks.

What both sides check first (compat fields and hash) is the contract's
(:mod:`splitserve.kv_compat`). Here:

- :mod:`.transport`: the sender / receiver interface and the registry of backends
  (``tcp``, ``grpc``, ``nixl``), imported lazily by name;
- :mod:`.layout`: pure block arithmetic over the pool ``[layers, 2, blocks, block_size,
  kv_heads, head_dim]``;
- :mod:`.lease`: reservations held under a lease, and what has arrived for each;
- :mod:`.faults`: the failure-injection knob and hold points the transports honour;
- the ``tcp`` backend (the fast path: one copy from the socket into the blocks):
  :mod:`.tcp_wire` (its frames, pure), :mod:`.tcp_socket` (blocking socket I/O),
  :mod:`.tcp_server` (the decode side's port),
  :mod:`.tcp_sender` (the prefill side's pooled connections); both over TLS when
  configured (:mod:`splitserve.tls`);
- the ``grpc`` backend (grpcio's own ``PushKV``, for any gRPC peer):
  :mod:`.grpc_sender`, :mod:`.kvwire` (its message without extra copies);
- shared by ``tcp`` and ``grpc``: :mod:`.span_sender` (layers into spans, a thread per
  stream) and :mod:`.span_receiver` (spans checked and placed in the blocks);
- :mod:`.head_split`: one push into a decode pool split over tensor-parallel ranks
  (each rank exactly its KV heads, over any backend's per-rank pushes);
- :mod:`.staging`: a device layer made readable off the engine thread (pinned host
  copies on a side stream, events the reading threads wait on);
- the ``nixl`` backend: :mod:`.nixl_backend`, :mod:`.nixl_receiver`, :mod:`.nixl_common`.

Imports the standard library, torch, grpcio (``grpc`` only), NIXL (``nixl`` only) and the
contract; never the worker's server, router or engine.
"""
