"""In bfloat16 the engine's greedy tokens are transformers' own choices, position by
position (teacher-forced; see ``bf16_agreement``), on the CPU: the same thresholds the
CUDA test in ``tests/gpu`` holds, checked here on every run. A wrong cache, position or
mask fails them; a bfloat16 rounding tie does not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bf16_agreement import MAX_TIE_GAP, MIN_AGREEMENT, teacher_forced_agreement
from splitserve.sampling import SamplingParams
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.engine import Engine
from splitserve_worker.models import load_model
from worker_kit import prompt_of

pytestmark = pytest.mark.integration

LENGTHS = (3, 40, 300, 700)
MAX_NEW = 16


def test_bf16_greedy_tokens_agree_with_transformers_teacher_forced(
    tiny_model_path_bf16: Path,
) -> None:
    torch.set_num_threads(1)
    lm = load_model(str(tiny_model_path_bf16))
    assert lm.dtype == torch.bfloat16
    engine = Engine(lm, EngineConfig(num_blocks=256, prefill_chunk_tokens=128))
    prompts = [prompt_of(n) for n in LENGTHS]
    for i, p in enumerate(prompts):  # batched decode, chunked prefill
        engine.add_request(str(i), p, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            assert o.error is None, o.error
            got[o.request_id] += o.new_token_ids
    outputs = [got[str(i)] for i in range(len(prompts))]
    agreement = teacher_forced_agreement(lm.model, prompts, outputs)
    print(f"bf16 (CPU): {agreement.matched}/{agreement.total} tokens are transformers' "
          f"choice; worst gap {agreement.worst_gap:.3f}")  # fmt: skip
    agreement.check()
    # and the judge can tell: each answer judged against another prompt fails it
    swapped = teacher_forced_agreement(lm.model, prompts[1:] + prompts[:1], outputs)
    with pytest.raises(AssertionError):
        swapped.check()


def test_the_check_fails_tokens_that_are_not_the_models() -> None:
    """The judge itself: outputs shifted by one position are not a rounding tie."""
    from bf16_agreement import Agreement

    bad = Agreement(matched=10, total=64, worst_gap=3.0, first_diverged=(0,))
    with pytest.raises(AssertionError, match="reference's choice"):
        bad.check()
    tie = Agreement(matched=62, total=64, worst_gap=MAX_TIE_GAP * 2, first_diverged=(5,))
    with pytest.raises(AssertionError, match="not a rounding tie"):
        tie.check()
    Agreement(matched=int(64 * MIN_AGREEMENT) + 1, total=64, worst_gap=0.1,
              first_diverged=(None,)).check()  # fmt: skip
