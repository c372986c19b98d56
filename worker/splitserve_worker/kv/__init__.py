"""Moving a prompt's KV cache from a prefill worker into a decode worker's reserved blocks.

- :mod:`.compat`: what a KV cache is, and the check both sides make before any byte moves;
- :mod:`.layout`: pure block arithmetic over the pool ``[layers, 2, blocks, block_size,
  kv_heads, head_dim]``;
- :mod:`.lease`: reservations held under a lease, and what has arrived for each;
- :mod:`.transport`: the sender / receiver interface and the registry of backends
  (``grpc``, ``nixl``), imported lazily by name;
- :mod:`.faults`: the failure-injection knob the transports honour.
"""
