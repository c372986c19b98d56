"""AsyncEngine: streams, early exit frees blocks, remote-KV calls on the engine thread."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from splitserve.sampling import SamplingParams
from splitserve_worker.engine.async_engine import AsyncEngine
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.engine import Engine
from splitserve_worker.engine.errors import RequestError
from splitserve_worker.models import LoadedModel, load_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def tiny(tiny_model_path: Path) -> LoadedModel:
    torch.set_num_threads(1)
    return load_model(str(tiny_model_path))


async def _collect(agen) -> list[int]:  # type: ignore[no-untyped-def]
    toks: list[int] = []
    async for o in agen:
        assert o.error is None
        toks += o.new_token_ids
    return toks


async def test_concurrent_streams_match_the_sync_engine(tiny: LoadedModel) -> None:
    prompts = [list(range(3, 3 + n)) for n in (4, 20, 37, 9)]
    sync = Engine(tiny, EngineConfig(num_blocks=64))
    want: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        sync.add_request(str(i), p, SamplingParams(max_tokens=8, ignore_eos=True))
    while sync.has_work():
        for o in sync.step():
            want.setdefault(o.request_id, []).extend(o.new_token_ids)
    async with AsyncEngine(Engine(tiny, EngineConfig(num_blocks=64))) as ae:
        got = await asyncio.gather(
            *[
                _collect(ae.generate(str(i), p, SamplingParams(max_tokens=8, ignore_eos=True)))
                for i, p in enumerate(prompts)
            ]
        )
        assert {str(i): g for i, g in enumerate(got)} == want
        assert ae.stats()["free_blocks"] == ae.stats()["total_blocks"]


async def test_leaving_a_stream_early_aborts_and_frees(tiny: LoadedModel) -> None:
    async with AsyncEngine(Engine(tiny, EngineConfig(num_blocks=64))) as ae:
        agen = ae.generate("a", list(range(3, 40)), SamplingParams(max_tokens=200, ignore_eos=True))
        async for o in agen:
            assert not o.finished
            break
        await agen.aclose()
        stats = await ae.call(ae.engine.stats)
        assert stats["free_blocks"] == stats["total_blocks"] and stats["running"] == 0


async def test_bad_request_raises_and_others_go_on(tiny: LoadedModel) -> None:
    async with AsyncEngine(Engine(tiny, EngineConfig(num_blocks=64))) as ae:
        with pytest.raises(RequestError, match="empty"):
            await _collect(ae.generate("bad", [], None))
        with pytest.raises(RequestError, match="temperature"):
            await _collect(ae.generate("bad2", [5], SamplingParams(temperature=-2)))
        toks = await _collect(
            ae.generate("ok", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        )
        assert len(toks) == 3


async def test_remote_kv_calls_through_the_async_wrapper(tiny: LoadedModel) -> None:
    prompt = list(range(3, 50))
    sp = SamplingParams(max_tokens=6)
    async with (
        AsyncEngine(Engine(tiny, EngineConfig(num_blocks=32))) as both,
        AsyncEngine(Engine(tiny, EngineConfig(num_blocks=32, role="prefill"))) as pre,
        AsyncEngine(Engine(tiny, EngineConfig(num_blocks=32, role="decode"))) as dec,
    ):
        want = await _collect(both.generate("r", prompt, sp))
        await dec.reserve("r", len(prompt))
        loop = asyncio.get_running_loop()
        writes = []

        def on_layer(layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
            # runs on the prefill engine's thread: hand the copy to the decode engine's
            writes.append(
                asyncio.run_coroutine_threadsafe(dec.write_layer("r", layer, start, k, v), loop)
            )

        res = await pre.prefill_export("r", prompt, sp, on_layer)
        for w in writes:
            await asyncio.wrap_future(w)
        stream = await dec.admit_prefilled("r", prompt, res.first_token, res.first_logprob, sp)
        got = [res.first_token, *await _collect(stream)]
        assert got == want
        assert await dec.release("r") == 0
        assert dec.stats()["reserved"] == 0


async def test_close_ends_open_streams(tiny: LoadedModel) -> None:
    ae = AsyncEngine(Engine(tiny, EngineConfig(num_blocks=64))).start()
    agen = ae.generate("a", [5, 6], SamplingParams(max_tokens=1000, ignore_eos=True))
    first = await agen.__anext__()
    assert not first.finished
    await ae.close()
    rest = [o async for o in agen]
    assert rest and rest[-1].finished


@pytest.mark.parametrize("step", ["reserve", "generate"])
async def test_a_caller_cancelled_mid_call_leaves_no_blocks_held(
    tiny: LoadedModel, step: str
) -> None:
    """The engine thread finishes a reservation (or admission) whose caller was cancelled
    meanwhile, as a gRPC handler is when its deadline passes; the request is then aborted
    there instead of holding its blocks with no one to free them."""
    import threading

    async with AsyncEngine(Engine(tiny, EngineConfig(num_blocks=64))) as ae:
        gate = threading.Event()
        busy = asyncio.ensure_future(ae.call(gate.wait, 10.0))  # the engine thread is busy
        await asyncio.sleep(0.05)
        if step == "reserve":
            caller = asyncio.ensure_future(ae.reserve("r", 40))
        else:
            sp = SamplingParams(max_tokens=900, ignore_eos=True)
            caller = asyncio.ensure_future(ae.generate("r", list(range(3, 43)), sp).__anext__())
        await asyncio.sleep(0.05)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        gate.set()
        assert await busy
        for _ in range(5):  # round trips through the engine thread: the abort comes first
            await ae.call(lambda: None)
        s = await ae.call(ae.engine.stats)
        assert (s["free_blocks"], s["reserved"], s["running"]) == (s["total_blocks"], 0, 0), s


async def test_a_step_that_fails_again_while_draining_fails_its_streams_and_serves_on(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that fails again while the failed requests are drained (a lost rank, a dead
    device: every forward fails) still ends each stream with an error, and the engine
    thread lives on to answer the next call."""
    engine = Engine(tiny, EngineConfig(num_blocks=64))
    errors: list[BaseException] = []
    step = engine.step
    failing = [True, True]  # the step, then the drain after it

    def broken() -> list[object]:
        if failing:
            failing.pop()
            raise RuntimeError("every forward fails")
        return step()

    async with AsyncEngine(engine, on_error=errors.append) as ae:
        monkeypatch.setattr(engine, "step", broken)
        outs = [o async for o in ae.generate("x", [3, 4, 5], SamplingParams(max_tokens=4))]
        assert outs[-1].finished and outs[-1].error and "every forward fails" in outs[-1].error
        assert not failing and errors and ae.running
        assert await _collect(ae.generate("y", [3, 4, 5], SamplingParams(max_tokens=2))) != []
        assert ae.stats()["free_blocks"] == ae.stats()["total_blocks"]
