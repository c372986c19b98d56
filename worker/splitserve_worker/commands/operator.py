"""``splitserve operator``: run the Kubernetes operator (the same as
``python -m splitserve_operator``; needs the ``operator`` extra)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    try:
        from splitserve_operator.cli import add_arguments as add
    except ImportError:  # the operator extra is not installed: say so when run
        return
    add(p)


def run(args: argparse.Namespace) -> int:
    try:
        from splitserve_operator.cli import run as run_operator
    except ImportError as exc:
        print(f"error: the operator is not installed ({exc}); pip install 'splitserve[operator]'")
        return 1
    return run_operator(args)
