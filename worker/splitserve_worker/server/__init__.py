"""The worker's gRPC server (contract ``splitserve.v1``) and the async client for it,
and the decode side's tcp KV port wired to the handoff (:mod:`.tcp_sink`)."""
