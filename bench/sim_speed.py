"""How fast the simulator replays a day: 100,000 requests, Mooncake-like, one core.

Draws a day-long trace (diurnal rate, long-tailed prompts averaging ~4.5k
tokens, multi-turn prefix reuse through ``hash_ids``), then simulates it for
Llama 3.1 8B on H100s: disaggregated 1P:1D over 400GbE RoCE, and colocated on
two GPUs with 512-token chunks. Prints each run's wall and CPU seconds and its
latency percentiles, and ends with the slower run's wall time:

    RESULT sim_100k_seconds=<x>

Target: under 60 s. Run: ``.venv/bin/python bench/sim_speed.py [--requests N]``.
"""

from __future__ import annotations

import argparse
import time

from splitserve_operator.sim.config import Mode, roofline_config
from splitserve_operator.sim.hardware import get_gpu, get_link
from splitserve_operator.sim.model_spec import load_model_spec
from splitserve_operator.sim.simulator import Simulator
from splitserve_operator.sim.synth import DAY_S, mooncake_like


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    t0 = time.perf_counter()
    w = mooncake_like(args.requests, DAY_S, seed=args.seed)
    print(
        f"trace: {len(w):,} requests over {w.duration / 3600:.1f} h, mean prompt "
        f"{w.mean_prompt:,.0f}, mean output {w.mean_output:,.0f} tokens "
        f"(drawn in {time.perf_counter() - t0:.1f} s)"
    )
    model, h100 = load_model_spec("llama-3.1-8b"), get_gpu("h100")
    configs = [
        roofline_config(
            model, Mode.DISAGGREGATED, h100, link=get_link("roce400"), prefill=1, decode=1
        ),
        roofline_config(model, Mode.COLOCATED, h100, both=2, chunk_size=512),
    ]
    worst = 0.0
    for cfg in configs:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        res = Simulator(cfg, w, keep_requests=True).run()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        worst = max(worst, wall)
        s = res.summary()
        print(
            f"{cfg.label():40s} {wall:6.1f} s wall, {cpu:6.1f} s CPU; {res.n_finished:,} finished; "
            f"TTFT p50/p90 {s['ttft_s']['p50']:.3f}/{s['ttft_s']['p90']:.3f} s, "
            f"TPOT p50/p90 {s['tpot_s']['p50'] * 1000:.1f}/{s['tpot_s']['p90'] * 1000:.1f} ms; "
            f"prefix reuse {1 - res.extra['prefill_tokens'] / w.prompt.sum():.0%} of prompt tokens"
        )
    print(f"RESULT sim_100k_seconds={worst:.1f}")


if __name__ == "__main__":
    main()
