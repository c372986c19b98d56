"""The ``splitserve`` command. Each subcommand lives in its own module under
``splitserve_worker.commands`` (``add_arguments(parser)`` and ``run(args) -> int``)
and is imported only when used, so ``splitserve advise`` never loads torch."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

from splitserve_worker import __version__

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("splitserve_worker.commands.up", "run a local router with prefill/decode workers"),
    "worker": ("splitserve_worker.commands.worker", "run one worker (prefill, decode or both)"),
    "router": ("splitserve_worker.commands.router", "run the OpenAI-compatible router"),
    "advise": ("splitserve_worker.commands.advise", "should this model and workload disaggregate?"),
    "model": ("splitserve_worker.commands.model", "prepare or inspect a model checkpoint"),
    "operator": ("splitserve_worker.commands.operator", "run the Kubernetes operator"),
}


def _available() -> dict[str, tuple[str, str]]:
    found = {}
    for name, (module, help_) in SUBCOMMANDS.items():
        if importlib.util.find_spec(module) is not None:
            found[name] = (module, help_)
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"splitserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in _available().items():
        p = sub.add_parser(name, help=help_, description=help_)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
