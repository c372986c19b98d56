"""What the stack tests share: prompts, transformers' reference tokens, the worker
processes (prefill, decode, both) and a router in this process over them.

A test module imports the fixtures it uses (``tokenizer_fixture`` and so on); each then
runs once per module, under its plain name (``tokenizer``)."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from splitserve.roles import Role
from splitserve_worker.commands.up import WorkerProcs
from splitserve_worker.router.config import RouterConfig
from splitserve_worker.router.discovery import StaticDiscovery, WorkerEndpoint
from splitserve_worker.router.local import RouterThread
from splitserve_worker.router.service import RouterService

PROMPTS = [[5, 17, 99, 3, 42], list(range(10, 50)), [(i * 7919) % 250 for i in range(100)]]
MAX_TOKENS = 12
ALWAYS_REMOTE = "always"  # disaggregate every request these stacks can


@pytest.fixture(scope="module", name="tokenizer")
def tokenizer_fixture(tiny_model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def generate_reference(model_path: Path, **kw: Any) -> list[list[int]]:
    """transformers' own greedy generate of every prompt, EOS ignored."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model.generation_config.eos_token_id = None
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
            **kw,
        )
        out.append(gen[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module", name="reference")
def reference_fixture(tiny_model_path: Path) -> list[list[int]]:
    return generate_reference(tiny_model_path)


@pytest.fixture(scope="module", name="workers")
def workers_fixture(tiny_model_path: Path) -> Iterator[tuple[str, list[WorkerEndpoint]]]:
    token = secrets.token_hex(8)
    roles = [Role.PREFILL, Role.DECODE, Role.BOTH]
    with WorkerProcs(str(tiny_model_path), roles, token, threads=1, echo=False) as procs:
        yield token, procs.start(timeout_s=300)


def complete(base: str, prompt: list[int], stream: bool, **extra: Any) -> list[int]:
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
        **extra,
    }
    if not stream:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
        return list(choice["token_ids"])
    ids: list[int] = []
    finish = None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        chunk = json.loads(ln[6:])
        assert "error" not in chunk, chunk
        ids += chunk["choices"][0].get("token_ids", [])
        finish = chunk["choices"][0]["finish_reason"] or finish
    assert finish == "length"
    return ids


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from ``/proc``)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def router(token: str, tokenizer: Any, eps: list[WorkerEndpoint], **cfg: Any) -> RouterThread:
    config = RouterConfig(model_name="tiny", worker_token=token, **cfg)
    return RouterThread(RouterService(config, tokenizer, StaticDiscovery(eps)))


def decisions(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics").text
    found = re.findall(r'splitserve_disaggregation_decisions_total\{decision="(\w+)"\} (\S+)', text)
    return {k: float(v) for k, v in found}
