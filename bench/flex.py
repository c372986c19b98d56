"""Switchable workers against a static split, on this machine and in the simulator.

    .venv/bin/python bench/flex.py [--phase-s 20] [--rounds 2] [--overload 1.2]

Local (a small Llama made for the run, ``MODEL_SHAPE``; real worker processes, the
router in this process): a trace whose mix takes turns between long prompts (short
answers) and long answers (short prompts) runs against (a) a static 1 prefill + 1 decode
split and (b) two switchable workers (starting 1 + 1) under the rebalancer of
``splitserve up --flex``, with the same objectives. On a host shared with other work an
idle calibration says little about a loaded run, so everything is measured in this run,
on the static stack, right before the trace: the objectives are three times its TTFT for
one long prompt and its TPOT for one long answer; the load is set from its capacity,
measured closed loop (long prompts completed per second by its one prefill worker; long
answers per second by its one decode worker at the concurrency that completes the most
while its TPOT stays inside the objective): each phase offers ``--overload`` (1.2) times
what the static split serves. Both stacks stay up and the rounds alternate between them
(static, flex, static, flex), so a change in the host's other load falls on both alike.
Printed: the calibration, SLO attainment and goodput of each (and of each phase, with
why requests missed), and the time from each phase change to a split whose workers all
serve the phase's heavy role (0 when the split already did).

Simulated (:mod:`flex_sim`): the same kind of trace on Llama 3.1 70B on H100s where a
new pod takes five minutes: the planner scaling with new pods against the same GPUs as
switchable workers.

Ends with ``RESULT flex_vs_static_attainment=<ratio> rebalance_seconds=<s>
sim_switch_vs_scale_attainment=<ratio>`` (targets: >= 1.2, <= 10 s, >= 1.2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import secrets
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flex_trace import LONG_PROMPT, Outcome, calibrate, drive
from support_path import use_test_support

MODEL_SHAPE: dict[str, Any] = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8)
"""Large enough that the workers' forwards, not the router's and the client's work per
request, take the host's cores (the test model computes a long prompt in a few ms, and
then a second worker of a role adds nothing on two cores)."""


@dataclass
class Local:
    outcomes: list[Outcome] = field(default_factory=list)
    switches: list[tuple[float, str, str]] = field(default_factory=list)
    """(the monotonic clock when the switch was over, worker, new role)."""
    decisions: list[tuple[float, str]] = field(default_factory=list)
    """(the monotonic clock, the reason) of each tick of the rebalancer."""
    roles: dict[str, str] = field(default_factory=dict)
    """Each worker's role at the start."""

    def attainment(self, ttft: float, tpot: float, phase: str | None = None) -> float:
        sent = [o for o in self.outcomes if phase is None or o.phase == phase]
        good = [o for o in sent if o.ok and o.ttft <= ttft and o.tpot <= tpot]
        return len(good) / max(1, len(sent))

    def misses(self, ttft: float, tpot: float, phase: str) -> str:
        """Why the phase's requests missed: failed, TTFT over, TPOT over (a request can
        miss both)."""
        sent = [o for o in self.outcomes if o.phase == phase]
        failed = sum(not o.ok for o in sent)
        late = sum(o.ok and o.ttft > ttft for o in sent)
        slow = sum(o.ok and o.tpot > tpot for o in sent)
        return f"{failed} failed, {late} over TTFT, {slow} over TPOT"

    def errors(self) -> str:
        seen = Counter(o.error for o in self.outcomes if not o.ok)
        return "; ".join(f"{n} x {why}" for why, n in seen.most_common())


@contextlib.asynccontextmanager
async def stack(model: Path, flex: bool, slo: tuple[float, float]) -> Any:
    from splitserve.role_balance import BalanceConfig
    from splitserve.roles import Role
    from splitserve.v1 import worker_pb2 as pb
    from splitserve_worker.client import WorkerClients
    from splitserve_worker.commands.router import load_tokenizer
    from splitserve_worker.commands.up import WorkerProcs, serve_router
    from splitserve_worker.router.app import create_app
    from splitserve_worker.router.config import RouterConfig
    from splitserve_worker.router.discovery import StaticDiscovery
    from splitserve_worker.router.rebalancer import FlexSettings, Rebalancer
    from splitserve_worker.router.service import RouterService

    token = secrets.token_hex(8)
    extra = ["--num-blocks", "2000", *(["--switchable"] if flex else [])]
    with WorkerProcs(str(model), [Role.PREFILL, Role.DECODE], token, threads=1,
                     extra_args=extra, echo=False) as procs:  # fmt: skip
        eps = await asyncio.to_thread(procs.start, 300.0)
        cfg = RouterConfig(model_name="tiny", worker_token=token, max_model_len=2048)
        service = RouterService(cfg, load_tokenizer(str(model)), StaticDiscovery(eps))
        server, task, port = await serve_router(create_app(service), "127.0.0.1", 0)
        local = Local(roles={ep.name: ep.role.value for ep in eps})
        r = None
        clients = WorkerClients(token)
        halt = asyncio.Event()
        loop_task = None
        try:
            if not await service.wait_ready(60):
                raise RuntimeError("the stack did not come up")
            if flex:
                address = {ep.name: ep.address for ep in eps}
                to_proto = {Role.PREFILL: pb.ROLE_PREFILL, Role.DECODE: pb.ROLE_DECODE,
                            Role.BOTH: pb.ROLE_BOTH}  # fmt: skip

                async def switch(name: str, role: Role) -> None:
                    await clients.get(address[name]).switch_role(to_proto[role], 1.0, timeout=120)
                    local.switches.append((time.monotonic(), name, role.value))

                balance = BalanceConfig(min_dwell_s=5.0, sustain_s=1.0)
                settings = FlexSettings(ttft_slo_s=slo[0], tpot_slo_s=slo[1], drain_s=1.0,
                                        tick_s=0.5, balance=balance)  # fmt: skip
                pool = service.pool
                r = Rebalancer(service.metrics.registry, pool.snapshot, pool.mark_switching,
                               switch, set(address), settings)  # fmt: skip
                loop_task = asyncio.create_task(watch(r, halt, settings.tick_s, local))
            yield f"http://127.0.0.1:{port}", local
        finally:
            halt.set()
            if loop_task is not None:
                await loop_task
            if r is not None:
                await r.close()
            await clients.close()
            server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 10)
            await service.stop()


async def watch(r: Any, halt: asyncio.Event, tick_s: float, local: Local) -> None:
    """The rebalancer's own loop, keeping each tick's reason."""
    while not halt.is_set():
        local.decisions.append((time.monotonic(), r.tick().reason.value))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(halt.wait(), tick_s)


def rebalance_waits(flex: Local, starts: list[float], phase_s: float) -> list[float]:
    """Seconds from each phase change to a split where every switchable worker serves
    the phase's heavy role (prefill for prompts, decode for answers; ``both`` serves
    each): 0 when the split already did, inf when it did not within the phase."""

    def rebalanced(at: float, heavy: str) -> bool:
        roles = dict(flex.roles)
        for t, worker, role in flex.switches:
            if t <= at:
                roles[worker] = role
        return all(r in (heavy, "both") for r in roles.values())

    waits = []
    for i, at in enumerate(starts):
        heavy = "prefill" if i % 2 == 0 else "decode"
        if rebalanced(at, heavy):
            waits.append(0.0)
            continue
        done = [t for t, _, _ in flex.switches if at < t < at + phase_s and rebalanced(t, heavy)]
        waits.append(done[0] - at if done else math.inf)
    return waits


def reasons(decisions: list[tuple[float, str]], starts: list[float], phase_s: float) -> str:
    """How often each reason decided, phase by phase."""
    out = []
    for i, at in enumerate(starts):
        seen = Counter(why for t, why in decisions if at <= t < at + phase_s)
        kind = "prompts" if i % 2 == 0 else "answers"
        out.append(f"{kind}: " + ", ".join(f"{why} {n}" for why, n in seen.most_common()))
    return "; ".join(out)


OVERLOAD = 1.2
"""Each phase offers this many times what the static split serves of it: one worker
of the role is short, two keep up. Two switchable workers never both serve one role
(the last worker of a role serves both), and on two cores they share the host with the
router and the client: at 1.5 neither stack came near its objectives (attainment 0.014
static, 0.009 flex), a ratio of two failures."""


async def local_bench(phase_s: float, rounds: int, overload: float) -> dict[str, float]:
    use_test_support()
    from tiny_models import save_tiny_llama

    with tempfile.TemporaryDirectory() as d:
        model = save_tiny_llama(Path(d), **MODEL_SHAPE)
        async with stack(model, False, (1.0, 1.0)) as (static_base, static):
            cal = await calibrate(static_base)
            slo = cal.slo
            p_rate, g_rate = overload * cal.prompts_per_s, overload * cal.answers_per_s
            print(f"static split now: TTFT {cal.ttft:.3f} s (a {LONG_PROMPT}-token prompt), "
                  f"TPOT {cal.tpot * 1000:.1f} ms (one stream); serves "
                  f"{cal.prompts_per_s:.2f} long prompts/s and {cal.answers_per_s:.2f} long "
                  f"answers/s ({cal.streams} streams in the objective); objectives TTFT "
                  f"{slo[0]:.3f} s, TPOT {slo[1] * 1000:.1f} ms; offered {p_rate:.2f} and "
                  f"{g_rate:.2f} req/s", flush=True)  # fmt: skip
            one_round = [("prompts", phase_s, p_rate), ("answers", phase_s, g_rate)]
            async with stack(model, True, slo) as (flex_base, flex):
                starts: list[float] = []
                seconds = {"static": 0.0, "flex": 0.0}
                for r in range(rounds):
                    for name, base, local in (("static", static_base, static),
                                              ("flex", flex_base, flex)):  # fmt: skip
                        t0 = time.monotonic()
                        if name == "flex":
                            starts += [t0, t0 + phase_s]
                        local.outcomes += await drive(base, one_round, seed=1 + r)
                        seconds[name] += time.monotonic() - t0
        out = {"static": static, "flex": flex}
        for name, local in out.items():
            att = local.attainment(*slo)
            moves = [(round(t - starts[0], 1), w.split("@")[0], r) for t, w, r in local.switches]
            phases = "; ".join(
                f"{kind} {local.attainment(*slo, kind):.3f} ({local.misses(*slo, kind)})"
                for kind in ("prompts", "answers")
            )
            print(f"{name:6s}: {len(local.outcomes)} requests, SLO attainment {att:.3f} "
                  f"({phases}), goodput {att * len(local.outcomes) / seconds[name]:.2f} "
                  f"req/s, switches {moves}", flush=True)  # fmt: skip
            if local.errors():
                print(f"{name:6s}: failed: {local.errors()}", flush=True)
    static_att, flex_att = static.attainment(*slo), flex.attainment(*slo)
    waits = rebalance_waits(flex, starts, phase_s)
    print(f"phase change to rebalanced split (s): {[round(w, 1) for w in waits]}", flush=True)
    print(
        f"the rebalancer's ticks by reason: {reasons(flex.decisions, starts, phase_s)}", flush=True
    )
    return {"ratio": flex_att / static_att if static_att else math.inf,
            "rebalance_s": statistics.median(waits)}  # fmt: skip


def sim_bench() -> float:
    from flex_sim import Phase, finish, scaling, switching

    phases = [Phase(600, 4.0, 8192, 64), Phase(600, 10.0, 256, 1024)] * 2
    scale, switch = scaling(phases, (2, 2), most=4), switching(phases, (2, 2))
    (a_scale, g_scale, gpu_scale), (a_switch, g_switch, gpu_switch) = finish(scale), finish(switch)
    print(f"sim 70B/H100 TP4, cold start 300 s: scaling with new pods: attainment "
          f"{a_scale:.3f}, goodput {g_scale:.2f} req/s, {gpu_scale / 3600:.1f} GPU-h; "
          f"switching (same 4 workers): attainment {a_switch:.3f}, goodput {g_switch:.2f} "
          f"req/s, {gpu_switch / 3600:.1f} GPU-h; switches at "
          f"{[(t, r.value) for t, r in switch.switches]}", flush=True)  # fmt: skip
    return a_switch / a_scale if a_scale else math.inf


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase-s", type=float, default=20.0, help="seconds of each local phase")
    p.add_argument("--rounds", type=int, default=2, help="prompt/answer phase pairs")
    p.add_argument("--overload", type=float, default=OVERLOAD,
                   help="each phase's offered load over what the static split serves")  # fmt: skip
    args = p.parse_args()
    sim = sim_bench()
    local = asyncio.run(local_bench(args.phase_s, args.rounds, args.overload))
    print(f"RESULT flex_vs_static_attainment={local['ratio']:.3f} "
          f"rebalance_seconds={local['rebalance_s']:.1f} "
          f"sim_switch_vs_scale_attainment={sim:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
