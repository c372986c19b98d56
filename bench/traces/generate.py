"""Writes the small sample traces in this folder (made here; nothing downloaded).

    .venv/bin/python bench/traces/generate.py

- ``mooncake_sample.jsonl``: 1,000 requests over 20 minutes in the Mooncake
  format (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` of
  512-token blocks), with shared system prompts and multi-turn prefix reuse;
- ``azure_conv_sample.csv`` and ``azure_code_sample.csv``: 1,000 requests each
  over an hour in the Azure LLM inference format
  (``TIMESTAMP,ContextTokens,GeneratedTokens``).

Deterministic (fixed seeds): running it again rewrites the same files.
"""

from __future__ import annotations

from pathlib import Path

from splitserve_operator.sim.synth import azure_like, mooncake_like
from splitserve_operator.sim.traces import save_azure, save_mooncake

HERE = Path(__file__).resolve().parent


def main() -> None:
    save_mooncake(mooncake_like(1000, 1200.0, seed=7), HERE / "mooncake_sample.jsonl")
    save_azure(azure_like(1000, 3600.0, seed=8, kind="conv"), HERE / "azure_conv_sample.csv")
    save_azure(azure_like(1000, 3600.0, seed=9, kind="code"), HERE / "azure_code_sample.csv")
    for p in sorted(HERE.glob("*_sample.*")):
        print(f"{p.name}: {p.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
