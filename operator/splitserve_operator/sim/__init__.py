"""A discrete-event simulator of splitserve's router and pools, with a roofline cost model.

Pure Python plus numpy: no kopf, kubernetes, grpc or torch. Used by
``splitserve advise`` (should this model and workload disaggregate, with what
prefill:decode ratio and what tensor parallelism per pool?), by the planner's
closed-loop bench, and by tests.

May import: the standard library, numpy and the contract package ``splitserve``;
no other room of the operator, no worker module, nor kopf, kubernetes, grpc or
torch. Nothing is re-exported here: import each name from the module that defines it.

Modules
-------
From the bottom up (each imports only modules above it in this list):

``hardware``     GPU kinds (``h100``, ``h200``, ``a100``, ``l40s``) and KV links
                 (``pcie4``, ``pcie5``, ``roce400``, ``nvlink``).
``model_spec``   :class:`ModelSpec` from a Hugging Face ``config.json``: FLOPs per
                 token, weight bytes, KV bytes per token; shipped configs by name.
``workload``     :class:`Workload`, :class:`Request`, Poisson synthetic workloads.
``traces``       Mooncake JSONL and Azure CSV replay (and writers).
``synth``        day-long Mooncake-like and Azure-like traces drawn here.
``prefix``       the LRU prefix cache of 512-token blocks (``hash_ids``).
``cost``         :class:`CostModel` (Protocol), :class:`RooflineCost`,
                 :class:`MeasuredCost`, KV transfer timing (layer-wise or not), and
                 the fan-out of a handoff between tensor-parallel layouts.
``config``       :class:`SimConfig` (pools, replicas, link, chunk size, ...),
                 :func:`roofline_config`.
``metrics``      :class:`Window` observations, :class:`SimResult`.
``decode_batch`` closed-form bookkeeping of a decode batch.
``events``       the clock: :class:`Clock` (Protocol), the event loop.
``instance_base`` :class:`Host` (Protocol: all an instance sees of the simulation),
                 the abstract instance, its lifecycle states, decode spans.
``colocated``    the colocated engine instance.
``instances``    prefill and decode engine instances.
``pools``        :class:`Pools`: adding, resizing, draining and retiring instances.
``windows``      :class:`Recorder`: per-window observations and the result.
``routing``      :class:`Router`: where requests and landed KV go.
``simulator``    :class:`Simulator`: the event loop over pools, router and
                 recorder, and the instances' :class:`Host`.
``goodput``      goodput search and the best prefill:decode split.
``sizing``       the fewest GPUs (split, tensor parallelism per pool, chunk size)
                 that serve a rate within the SLO, and the pure colocate-or-split
                 decision.
``advise``       the logic behind ``splitserve advise``.

Model of the system
-------------------
- Costs: :class:`RooflineCost` sums a roofline per kernel group of a step
  (matmuls: compute at a size-dependent efficiency or streaming the weights;
  prefill attention: compute; decode attention: reading the KV), plus a fixed
  step overhead and tensor-parallel all-reduces. Efficiencies are documented
  assumptions (0.6 of peak FLOP/s, 0.8 of HBM bandwidth, half efficiency at
  128-token matmuls), not GPU measurements. :class:`MeasuredCost` replaces it
  with linear fits of timings taken on a real engine.
- Memory: a request reserves KV for its prompt and output when admitted and
  frees it when done (no preemption); it waits while that does not fit.
- Colocated: ``both`` instances run vLLM-style chunked prefill: each step
  carries every running decode plus prompt chunks up to ``chunk_size`` tokens.
- Disaggregated: prefill instances batch queued prompts (up to
  ``max_prefill_tokens``) and push the KV over the link (FIFO per instance, a link
  per rank unless ``link_per_rank`` is off, layer-wise overlap optional); the
  first token reaches the client when the KV has landed
  (``first_token_after_transfer``); decode instances run continuous batching.
- Tensor parallelism per pool: an instance of ``tp`` GPUs splits the matmuls, the
  attention heads and the KV (replicated where ``tp`` exceeds the KV heads) and pays
  two all-reduces per layer per step; prefill and decode may differ. A handoff from
  ``p`` prefill ranks to ``d`` decode ranks sends each decode rank the heads it owns
  from a prefill rank holding them (:func:`~.cost.kv_fanout`): with a link per rank the
  busiest rank of either side sets the time, so P(tp2) to D(tp1) takes as long as one
  rank's link moving all the KV.
- The router sends a new request to the active instance with the fewest
  pending prompt tokens minus its prefix-cache hit (Mooncake ``hash_ids``), and
  a landed KV to the decode instance with the least KV reserved. With
  ``SimConfig.local_prefill`` (:class:`LocalPrefill`) it also copies our
  router's per-request choice to prefill short or cheap prompts on the decode
  worker itself (``splitserve_worker.router.decision``).
- TTFT = first token - arrival; TPOT = (last token - first token) / (output - 1);
  a request attains the SLO when both are within target.

Closed loop (the planner's API)
-------------------------------
::

    from splitserve_operator.sim.config import Mode, Slo, roofline_config
    from splitserve_operator.sim.hardware import get_gpu, get_link
    from splitserve_operator.sim.model_spec import load_model_spec
    from splitserve_operator.sim.simulator import Simulator
    from splitserve_operator.sim.workload import poisson

    cfg = roofline_config(load_model_spec("llama-3.1-8b"), Mode.DISAGGREGATED,
                          get_gpu("h100"), link=get_link("roce400"),
                          prefill=2, decode=2, startup_s=30.0)
    sim = Simulator(cfg, workload, slo=Slo(ttft_s=1.0, tpot_s=0.05))
    t = 0.0
    while not sim.done:
        t += 30.0
        w = sim.run_until(t)          # -> Window for (t - 30, t]
        # w.ttft.p90, w.tpot.p90, w.request_rate, w.input_token_rate,
        # w.output_token_rate, w.slo_attainment, w.gpus, w.gpu_seconds,
        # w.pools["prefill"].queue / .queue_tokens / .busy_fraction,
        # w.pools["decode"].kv_utilization / .queue / .running, ...
        sim.set_replicas(prefill=..., decode=...)   # or both=... when colocated
    result = sim.result()             # whole-run percentiles, GPU-seconds

- ``Simulator.run_until(t)`` processes every event up to ``t`` and returns the
  :class:`Window` since the previous call (``observe()`` does the same without
  advancing). Percentiles are ``None`` in a window with no samples.
- ``Simulator.set_replicas(prefill=, decode=, both=)`` takes effect at the
  current time: new instances take work after ``SimConfig.startup_s``; removed
  ones are starting ones first (gone at once), then the least loaded active
  ones, which drain (no new work, finish what they hold) before their GPUs are
  released. GPU-seconds count every instance from its adding to its going.
- ``Simulator.switch(from_role, to_role, switch_s)``: a switchable worker changes role:
  the least loaded active instance of ``from_role`` drains, and its GPU serves
  ``to_role`` after ``switch_s`` (no cold start: the weights stay loaded).
- ``Simulator.replicas(role)``, ``.gpus()``, ``.gpu_seconds()``, ``.done``,
  ``.now``.
- A workload can be any iterable of :class:`Request` in arrival order, so a
  planner bench can generate traffic lazily (e.g. a diurnal rate).
"""
