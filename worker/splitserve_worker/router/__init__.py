"""The router: the OpenAI-compatible API in front of the workers.

``app`` holds the routes only; ``jobs`` turns a request into jobs (``tokenizer_pool``
tokenizes off the event loop, within bounds), ``streaming`` runs their choices and
assembles the SSE stream or the whole answer (``responses`` builds the bodies,
``request_metrics`` records them); ``queues``, ``planner``, ``decision`` and ``scoring``
decide where a request runs, ``dispatch`` runs it (the KV handoff, retries, migration;
``failures`` says whose fault a failure is), ``pool`` and ``discovery`` follow the
workers. ``errors`` and ``catch_all`` answer in the OpenAI shape whatever happens;
``http_server`` runs it all under uvicorn with bounds on slow and greedy connections.

It reaches a worker only through its port, ``worker_conn.WorkerConn``, which the worker
client (:mod:`splitserve_worker.client`) implements. May import: the contract
(``splitserve``), the worker client and ``metrics``; never the worker's server, the
engine or the KV transports (import-linter holds both).
"""
