"""splitserve workers: engine, KV transport, router and the local stack."""

__version__ = "0.1.0"
