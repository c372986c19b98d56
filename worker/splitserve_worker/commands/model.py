"""``splitserve model``: convert the built-in model once, or check a checkpoint folder."""

from __future__ import annotations

import argparse

from splitserve_worker.models import BUILTIN_MODEL, ModelError, resolve_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "name", nargs="?", default=BUILTIN_MODEL, help="built-in name or checkpoint folder"
    )


def run(args: argparse.Namespace) -> int:
    try:
        path = resolve_model(args.name)
    except ModelError as e:
        print(f"error: {e}")
        return 1
    print(path)
    return 0
