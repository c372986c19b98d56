"""Which NIXL wheel this torch needs: NIXL's loader takes the wheel for
``torch.version.cuda`` and refuses another, so the wheel named (by the Makefile, the
worker image and the error a worker without NIXL gives) follows torch's CUDA; a CPU
torch takes ``nixl-cu12``."""

from __future__ import annotations

import sys

import pytest
import torch
from splitserve_worker.kv import nixl_common

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("cuda", "wheel"), [(None, "nixl-cu12"), ("12.8", "nixl-cu12"),
                                             ("13.0", "nixl-cu13")])  # fmt: skip
def test_the_nixl_wheel_named_follows_torchs_cuda(
    monkeypatch: pytest.MonkeyPatch, cuda: str | None, wheel: str
) -> None:
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert nixl_common.nixl_package() == wheel
    # NIXL's loader refuses a wheel for another CUDA: here, NIXL does not import at all
    monkeypatch.setitem(sys.modules, "nixl", None)
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    reason = nixl_common.unavailable_reason()
    assert reason is not None
    v = nixl_common.NIXL_VERSION
    assert reason.endswith(f"pip install --no-deps {wheel}=={v} nixl=={v}"), reason
    assert ("a CPU build" if cuda is None else f"built for CUDA {cuda}") in reason
