"""Trace replay: the public Mooncake and Azure LLM inference formats.

Mooncake (``*.jsonl``): one JSON object per line, ``timestamp`` in
milliseconds, ``input_length``, ``output_length``, and ``hash_ids``: one id
per 512-token block of the prompt, equal ids meaning equal prefixes (block
``i``'s id identifies the whole prefix up to and including block ``i``).

Azure LLM inference (``*.csv``): header ``TIMESTAMP,ContextTokens,GeneratedTokens``,
timestamps like ``2023-11-16 18:15:46.6805900`` (or plain seconds).
"""

from __future__ import annotations

import csv
import json
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

from splitserve_operator.sim.workload import Workload, WorkloadError

MOONCAKE_BLOCK_TOKENS = 512


def load_trace(path: str | Path) -> Workload:
    """Load by extension: ``.jsonl`` is Mooncake, ``.csv`` is Azure."""
    p = Path(path)
    if p.suffix == ".jsonl":
        return load_mooncake(p)
    if p.suffix == ".csv":
        return load_azure(p)
    raise WorkloadError(f"{p}: trace format unknown; use a Mooncake .jsonl or an Azure .csv")


def load_mooncake(path: str | Path) -> Workload:
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                rows.append(
                    (
                        float(d["timestamp"]) / 1000.0,
                        max(1, int(d["input_length"])),
                        max(1, int(d["output_length"])),
                        tuple(int(h) for h in d.get("hash_ids", ())),
                    )
                )
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise WorkloadError(f"{path}:{lineno}: not a Mooncake record ({e})") from None
    rows.sort(key=lambda r: r[0])
    return _table(rows, Path(path).name, with_hashes=True)


def _parse_time(text: str) -> float:
    s = text.strip()
    try:
        return float(s)
    except ValueError:
        pass
    base, _, frac = s.partition(".")
    try:
        t = datetime.strptime(base, "%Y-%m-%d %H:%M:%S")
    except ValueError:
        raise WorkloadError(
            f"timestamp {text!r} is neither seconds nor 'YYYY-MM-DD HH:MM:SS.f'"
        ) from None
    return t.timestamp() + (float("0." + frac) if frac else 0.0)


def load_azure(path: str | Path) -> Workload:
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        fields = {k.strip(): k for k in (reader.fieldnames or [])}
        need = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
        if not all(k in fields for k in need):
            raise WorkloadError(f"{path}: an Azure trace needs the columns {', '.join(need)}")
        for row in reader:
            rows.append(
                (
                    _parse_time(row[fields["TIMESTAMP"]]),
                    max(1, int(row[fields["ContextTokens"]])),
                    max(1, int(row[fields["GeneratedTokens"]])),
                    (),
                )
            )
    rows.sort(key=lambda r: r[0])
    return _table(rows, Path(path).name, with_hashes=False)


def _table(
    rows: list[tuple[float, int, int, tuple[int, ...]]], name: str, with_hashes: bool
) -> Workload:
    if not rows:
        raise WorkloadError(f"{name}: the trace is empty")
    t0 = rows[0][0]
    return Workload(
        np.array([r[0] - t0 for r in rows]),
        np.array([r[1] for r in rows], dtype=np.int64),
        np.array([r[2] for r in rows], dtype=np.int64),
        [r[3] for r in rows] if with_hashes else None,
        name,
        MOONCAKE_BLOCK_TOKENS,
    )


def save_mooncake(w: Workload, path: str | Path) -> None:
    with open(path, "w") as f:
        for i in range(len(w)):
            rec = {
                "timestamp": round(float(w.arrival[i]) * 1000),
                "input_length": int(w.prompt[i]),
                "output_length": int(w.output[i]),
                "hash_ids": list(w.hash_ids[i]) if w.hash_ids is not None else [],
            }
            f.write(json.dumps(rec) + "\n")


def save_azure(w: Workload, path: str | Path, start: datetime | None = None) -> None:
    t0 = start or datetime(2023, 11, 16, 18, 0, 0)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for i in range(len(w)):
            t = t0 + timedelta(seconds=float(w.arrival[i]))
            stamp = t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond:06d}0"
            out.writerow([stamp, int(w.prompt[i]), int(w.output[i])])
