"""The router: the OpenAI-compatible API in front of the workers.

``app`` holds the routes only; ``jobs`` turns a request into jobs, ``streaming`` runs
their choices and assembles the SSE stream or the whole answer (``responses`` builds the
bodies, ``request_metrics`` records them); ``queues``, ``planner``, ``decision`` and
``scoring`` decide where a request runs, ``dispatch`` runs it (the KV handoff, retries,
migration), ``pool`` and ``discovery`` follow the workers.

It reaches a worker only through its port, ``worker_conn.WorkerConn``, which the worker
client (:mod:`splitserve_worker.client`) implements. May import: the contract
(``splitserve``), the worker client and ``metrics``; never the worker's server, the
engine or the KV transports (import-linter holds both).
"""
