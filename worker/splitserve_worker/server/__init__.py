"""The worker's gRPC server (contract ``splitserve.v1``) and the async client for it."""
