"""The worker engine: paged KV cache, continuous batching, chunked and layer-wise prefill.

Its modules, from the bottom up: errors, config, sampling and stopping, the attention
backends (the room :mod:`.attention`), the block pool and prefix cache, the KV pool, the
model runner (with its linear kernels and prompt scoring), decode steps from static
buffers and CUDA graphs (:mod:`.decode_graphs`), sequences, the scheduler, the request
table (:mod:`.requests`, with :mod:`.reservations` and :mod:`.request_checks`),
layer-wise prefill (:mod:`.layerwise`) and remote KV admission (:mod:`.remote_kv`), which
both take the request table, the scheduler and the model runner they work on, then
:class:`~.engine.Engine` (the synchronous step) and :class:`~.async_engine.AsyncEngine`
(its asyncio front, on one engine thread). :mod:`.forward_stack` builds one rank's pool,
attention and runner, for the engine and for :mod:`.follower`, the loop of a
tensor-parallel rank other than 0. Import names from the module that defines
them; nothing is re-exported here.

A request's sampling parameters are the contract's
:class:`splitserve.sampling.SamplingParams`, and cached blocks are named by the
contract's :mod:`splitserve.prefix_hash`.

May import: torch, the contract package :mod:`splitserve`, and of the worker only
:mod:`splitserve_worker.metrics`, :mod:`splitserve_worker.models` and
:mod:`splitserve_worker.parallel`; never the router,
the servers, the client or the KV transports. ``prefix_cache`` and ``block_pool`` are
pure Python, importable without torch.
"""
