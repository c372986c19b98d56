"""The worker's gRPC server (contract ``splitserve.v1``): the servicer (``service``),
the decode side of the KV handoff (``handoff``, and ``tcp_sink``, the tcp KV port wired
to it), the prefill side (``prefill``, which calls the decode worker's Commit and
Release through the worker client), prefix-cache events, the token check (``auth``,
before a call's message is read), the gRPC port every server binds (``grpc_listen``:
rank 0's, and each other decode rank's own), each RPC's request size (``message_limits``), the
device's health (``device_health``: CUDA there when asked for, sticky device errors, a
lost tensor-parallel rank), a tensor-parallel engine and its rank processes (``ranks``),
a decode worker's other ranks each receiving their own KV heads (``rank_kv``) and a
prefill worker's each pushing theirs (``rank_push``), the
role a switchable pod's labels give it at start (``pod_labels``), and
``app.start_worker``, which assembles a worker and closes whatever it started when a
step fails.

May import: the contract, the worker client (:mod:`splitserve_worker.client`), the
engine, the KV transports, ``parallel`` and ``metrics``; never the router or the commands.
"""
