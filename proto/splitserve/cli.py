"""The ``splitserve`` command: a thin dispatcher over the subcommands the installed
packages declare.

Each subcommand is an entry point of the group ``splitserve.commands`` (see
``pyproject.toml``) naming a module with ``add_arguments(parser)`` and
``run(args) -> int``. Only the module of the subcommand being run is imported, so
``splitserve advise`` never loads torch and ``splitserve worker`` never loads kopf;
``splitserve --help`` imports each one to list it. A subcommand whose dependencies are
not installed ends in one line naming the extra to install: the extra is named after
the package the subcommand lives in (``splitserve_operator`` -> ``operator``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

DISTRIBUTION = "splitserve"
GROUP = "splitserve.commands"
"""The entry-point group a package declares its ``splitserve`` subcommands in."""
PACKAGE_PREFIX = "splitserve_"


class MissingExtra(Exception):
    """A subcommand's dependencies are not installed; the message says what to install."""


@dataclass(frozen=True)
class Command:
    """One subcommand: its name and the module that implements it."""

    name: str
    module: str

    @property
    def extra(self) -> str:
        """The extra that installs this subcommand's dependencies."""
        return self.module.split(".")[0].removeprefix(PACKAGE_PREFIX)

    def load(self) -> ModuleType:
        try:
            return importlib.import_module(self.module)
        except ModuleNotFoundError as exc:
            raise self.missing(exc) from exc

    def missing(self, exc: ModuleNotFoundError) -> MissingExtra:
        """The one-line answer to a module that is not installed; ``exc`` itself again
        when the module is a missing part of an installed splitserve package (a bug,
        not an extra to install)."""
        name = exc.name or ""
        top = name.split(".")[0]
        ours = top == DISTRIBUTION or top.startswith(PACKAGE_PREFIX)
        if not name or (ours and importlib.util.find_spec(top) is not None):
            raise exc
        return MissingExtra(
            f"error: splitserve {self.name} needs {name}, which is not installed: "
            f"pip install '{DISTRIBUTION}[{self.extra}]'"
        )


def commands() -> dict[str, Command]:
    """The installed subcommands by name, sorted."""
    found = {
        ep.name: Command(ep.name, ep.value) for ep in importlib.metadata.entry_points(group=GROUP)
    }
    return dict(sorted(found.items()))


def summary(module: ModuleType) -> str:
    """A module's one-line help: its docstring's first line without the
    ````splitserve NAME``:`` prefix."""
    first = (module.__doc__ or "").strip().split("\n")[0]
    return first.split(":", 1)[1].strip() if first.startswith("``") else first


def version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_parser(
    available: Mapping[str, Command] | None = None, load: Sequence[str] | None = None
) -> argparse.ArgumentParser:
    """The parser with every subcommand in ``load`` (default: all) imported and fully
    built; the others are listed by name only. Raises :class:`MissingExtra` when a
    subcommand in ``load`` cannot be imported."""
    available = commands() if available is None else available
    wanted = set(available) if load is None else set(load)
    parser = argparse.ArgumentParser(
        prog="splitserve", description="Disaggregated prefill/decode LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"splitserve {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in available.items():
        if name not in wanted:
            sub.add_parser(name)
            continue
        module = command.load()
        help_ = summary(module)
        p = sub.add_parser(name, help=help_, description=help_)
        module.add_arguments(p)
        p.set_defaults(splitserve_command=command)
    return parser


def listing(available: Mapping[str, Command]) -> argparse.ArgumentParser:
    """The parser for ``splitserve --help``: every subcommand with its summary, or the
    extra to install for one whose dependencies are missing."""
    parser = argparse.ArgumentParser(
        prog="splitserve", description="Disaggregated prefill/decode LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"splitserve {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in available.items():
        try:
            help_ = summary(command.load())
        except MissingExtra:
            help_ = f"(not installed: pip install '{DISTRIBUTION}[{command.extra}]')"
        sub.add_parser(name, help=help_)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    available = commands()
    chosen = next((a for a in args_in if not a.startswith("-")), None)
    if chosen not in available:
        # --help, --version, no command or an unknown one: argparse answers.
        listed = chosen is None and "--version" not in args_in
        parser = listing(available) if listed else build_parser(available, load=())
        parser.parse_args(args_in)
        parser.print_help()
        return 2
    command = available[chosen]
    try:
        args = build_parser(available, load=[chosen]).parse_args(args_in)
        try:
            return int(args.splitserve_command.load().run(args) or 0)
        except ModuleNotFoundError as exc:  # a dependency imported only when it runs
            raise command.missing(exc) from exc
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
