"""Mutation testing of the modules whose mistakes cost most (not part of CI).

Each target below is mutated one change at a time by Cosmic Ray's operators (a
comparison flipped, ``+`` for ``-``, a constant changed, a condition negated, ``and``
for ``or``, a loop that never runs, ...), and the target's fast tests run against each
mutant. A mutant the tests pass is a *survivor*: a mistake of that shape would land.
The script prints every survivor (file:line, operator, the line before and after) and
ends with ``RESULT mutation_score=<killed>/<total> survivors=<n>``.

It works on a copy of the repository in a temporary folder (put first on
``PYTHONPATH``), never on the work tree. Cosmic Ray (``pip install cosmic-ray``) does
the mutating and the test runs; this script picks the targets, the operators and a
seeded sample, runs a baseline, and reports.

    nice -n 10 .venv/bin/python bench/mutation.py                  # every target
    nice -n 10 .venv/bin/python bench/mutation.py --only planner/ --max-per-file 30
    .venv/bin/python bench/mutation.py --list                      # mutant counts only

On two cores, run one target at a time and merge the outcomes into one report:

    nice -n 10 .venv/bin/python bench/mutation.py --only kv/lease --save out/lease.jsonl
    ...
    .venv/bin/python bench/mutation.py --merge out/lease.jsonl --merge out/planner.jsonl

Module paths move as the code does: the table below is the one place to update.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PLANNER_TESTS = (
    "tests/unit/test_planner_core.py",
    "tests/unit/test_planner_edges.py",
    "tests/unit/test_planner_flex.py",
    "tests/unit/test_planner_learning.py",
    "tests/unit/test_planner_stability.py",
    "tests/unit/test_planner_config.py",
    "tests/unit/test_planner_autoscale.py",
    "tests/unit/test_planner_prometheus.py",
)
RENDER_TESTS = (
    "tests/unit/test_operator_render.py",
    "tests/unit/test_operator_render_edges.py",
    "tests/unit/test_operator_render_flex.py",
    "tests/unit/test_operator_render_objects.py",
    "tests/unit/test_operator_images.py",
)


@dataclass(frozen=True)
class Target:
    files: str
    """A glob from the repository root."""
    tests: tuple[str, ...]
    """The fast tests (``-m 'not slow'``) that must catch a mistake in those files."""
    only_in: tuple[str, ...] = ()
    """Mutate only inside these functions (by name); empty: the whole file."""


KV_CORE_TESTS = ("tests/unit/test_kv_core.py",)
KV_COMPAT_TESTS = ("tests/unit/test_kv_core.py", "tests/unit/test_kv_tcp_wire.py")
PREFIX_HASH_TESTS = ("tests/unit/test_engine_block_pool.py", "tests/unit/test_router_scoring.py",
                     "tests/unit/test_router_decision.py")  # fmt: skip
ROUTER_KEY_TESTS = ("tests/unit/test_router_api_key_scheme.py", "tests/unit/test_router_api.py")

TARGETS = (
    # KV leases: the table every receiver keeps, and the receivers' renewals
    Target("worker/splitserve_worker/kv/lease.py", KV_CORE_TESTS),
    # KV compatibility: the contract's hash and check, and the engine's identity
    Target("proto/splitserve/kv_compat.py", KV_COMPAT_TESTS),
    Target(
        "worker/splitserve_worker/engine/identity.py",
        (
            "tests/unit/test_engine_identity.py",
            "tests/integration/test_kv_handoff.py::test_workers_that_differ_are_refused_from_their_own_hashes",
        ),
        only_in=("compat_info",),
    ),
    # the prefix-hash chain the router and the engine compute alike
    Target("proto/splitserve/prefix_hash.py", PREFIX_HASH_TESTS),
    Target("worker/splitserve_worker/router/dispatch.py", ("tests/unit/test_router_dispatch.py",)),
    # the worker's token check, and the router's API key
    Target(
        "worker/splitserve_worker/server/auth.py",
        ("tests/unit/test_kv_auth.py", "tests/unit/test_security_secrets.py"),
    ),
    Target("worker/splitserve_worker/router/api_key.py", ROUTER_KEY_TESTS),
    Target("operator/splitserve_operator/planner/*.py", PLANNER_TESTS),
    Target("operator/splitserve_operator/render/*.py", RENDER_TESTS),
)

PACKAGE_FOLDERS = ("operator", "worker", "proto")
"""Put first on ``PYTHONPATH`` in the copy, ahead of the editable install."""

SKIP_OPERATORS = ("Pow", "Mod", "LShift", "RShift", "BitOr", "BitAnd", "BitXor", "FloorDiv")
"""Binary-operator replacements into or out of these are left out: the code under test
barely uses them, and ``a + b`` -> ``a << b`` teaches nothing ``a + b`` -> ``a - b``
does not. Every other Cosmic Ray core operator is used."""


@dataclass(frozen=True)
class Mutant:
    path: str
    """Relative to the repository root."""
    operator: str
    occurrence: int
    line: int
    definition: str | None
    tests: tuple[str, ...]


NOT_MADE = "not-made"
"""A mutation Cosmic Ray failed to apply: left out of the score, listed in the report."""
UNSCORED = ("no-mutation", NOT_MADE)


@dataclass(frozen=True)
class Outcome:
    mutant: Mutant
    killed: bool
    how: str
    """killed, survived, timeout, incompetent (the mutant does not even import), or one
    of :data:`UNSCORED`."""
    diff: str
    """Cosmic Ray's diff of the mutant (of one not made: the last line of its error)."""


def _skipped(operator: str) -> bool:
    name = operator.rsplit("/", 1)[-1]
    return name.startswith("ReplaceBinaryOperator") and any(
        f"_{op}_" in f"{name}_" for op in SKIP_OPERATORS
    )


def target_files(target: Target, root: Path) -> list[str]:
    """The target's files, relative to ``root`` (package ``__init__`` files left out)."""
    return sorted(
        str(p.relative_to(root))
        for p in root.glob(target.files)
        if p.is_file() and p.name != "__init__.py"
    )


def enumerate_mutants(targets: Sequence[Target], root: Path) -> list[Mutant]:
    """Every mutation Cosmic Ray's operators can make in the targets' files."""
    from cosmic_ray.commands import init
    from cosmic_ray.work_db import WorkDB, use_db

    out: list[Mutant] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, target in enumerate(targets):
            files = target_files(target, root)
            if not files:
                raise SystemExit(f"no file matches {target.files!r}: update TARGETS")
            with use_db(str(Path(tmp) / f"mutants{n}.sqlite"), WorkDB.Mode.create) as db:
                init([root / f for f in files], db, {})
                for item in db.work_items:
                    for m in item.mutations:
                        if _skipped(m.operator_name):
                            continue
                        if target.only_in and m.definition_name not in target.only_in:
                            continue
                        rel = str(Path(m.module_path).relative_to(root))
                        out.append(Mutant(rel, m.operator_name, m.occurrence, m.start_pos[0],
                                          m.definition_name, target.tests))  # fmt: skip
    return out


def sample(mutants: list[Mutant], per_file: int | None, seed: int) -> list[Mutant]:
    """At most ``per_file`` mutants of each file, drawn with ``seed``, in line order."""
    by_file: dict[str, list[Mutant]] = {}
    for m in mutants:
        by_file.setdefault(m.path, []).append(m)
    rng = random.Random(seed)
    out: list[Mutant] = []
    for path in sorted(by_file):
        group = by_file[path]
        if per_file is not None and len(group) > per_file:
            group = rng.sample(group, per_file)
        out += sorted(group, key=lambda m: (m.line, m.operator, m.occurrence))
    return out


def copy_repository(dest: Path) -> None:
    """The work tree's tracked and untracked (not ignored) files, into ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def use_copy(copy: Path) -> None:
    """Makes tests started from here import the copy's packages, not the work tree's."""
    paths = [str(copy / f) for f in PACKAGE_FOLDERS]
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])
    os.environ.pop("CI", None)  # the everyday Hypothesis profile, as a developer runs it
    os.chdir(copy)
    probe = subprocess.run(
        [sys.executable, "-c", "import splitserve_operator, splitserve_worker; "
         "print(splitserve_operator.__file__); print(splitserve_worker.__file__)"],
        check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    for where in probe:
        if not Path(where).is_relative_to(copy):
            raise SystemExit(f"the tests would import {where}, not the copy in {copy}")


def test_command(tests: Sequence[str]) -> str:
    return " ".join([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                     "-m", "'not slow'", *tests])  # fmt: skip


def baseline(groups: Sequence[tuple[str, ...]]) -> dict[tuple[str, ...], float]:
    """Seconds each group of tests takes unmutated; every group must pass."""
    took = {}
    for tests in groups:
        t0 = time.monotonic()
        run = subprocess.run(test_command(tests), shell=True, capture_output=True, text=True)
        took[tests] = time.monotonic() - t0
        if run.returncode != 0:
            raise SystemExit(
                f"the unmutated tests fail, fix them first: {' '.join(tests)}\n"
                + run.stdout[-3000:]
            )
    return took


def changed_lines(diff: str) -> tuple[str, str]:
    """The line before and after, from Cosmic Ray's unified diff."""
    lines = diff.splitlines()
    old = [ln[1:].strip() for ln in lines if ln.startswith("-") and not ln.startswith("---")]
    new = [ln[1:].strip() for ln in lines if ln.startswith("+") and not ln.startswith("+++")]
    return " / ".join(old), " / ".join(new)


def run_mutant(m: Mutant, copy: Path, timeout: float) -> Outcome:
    from cosmic_ray.mutating import mutate_and_test
    from cosmic_ray.work_item import MutationSpec, TestOutcome, WorkerOutcome

    spec = MutationSpec(module_path=str(copy / m.path), operator_name=m.operator,
                        occurrence=m.occurrence, start_pos=(m.line, 0),
                        end_pos=(m.line + 1, 0))  # fmt: skip
    result = mutate_and_test([spec], test_command(m.tests), timeout)
    diff = result.diff or ""
    if result.worker_outcome is WorkerOutcome.NO_TEST:
        return Outcome(m, True, "no-mutation", diff)
    if result.worker_outcome is WorkerOutcome.EXCEPTION:
        # Cosmic Ray could not make this one (its ExceptionReplacer fails on some
        # ``except (A, B)`` tuples): nothing was tested; the report names it apart
        lines = (result.output or "").strip().splitlines()
        return Outcome(m, True, NOT_MADE, lines[-1] if lines else "")
    if result.test_outcome is TestOutcome.SURVIVED:
        return Outcome(m, False, "survived", diff)
    if result.test_outcome is TestOutcome.INCOMPETENT:
        return Outcome(m, True, "incompetent", diff)
    timed_out = (result.output or "").strip() == "timeout"  # what Cosmic Ray says then
    return Outcome(m, True, "timeout" if timed_out else "killed", diff)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[],
                    help="keep the targets whose glob contains this (repeatable)")  # fmt: skip
    ap.add_argument("--max-per-file", type=int, default=None,
                    help="a seeded sample of at most this many mutants per file")  # fmt: skip
    ap.add_argument("--seed", type=int, default=27)
    ap.add_argument("--list", action="store_true", help="count the mutants, run nothing")
    ap.add_argument("--save", type=Path, default=None,
                    help="also write each mutant's outcome to this file (JSON lines)")  # fmt: skip
    ap.add_argument("--retest", type=Path, default=None,
                    help="run again only the survivors saved in this file (after new tests); "
                         "its killed mutants are kept as they are")  # fmt: skip
    ap.add_argument("--merge", type=Path, action="append", default=[],
                    help="report over the outcomes saved by earlier runs (repeatable); "
                         "runs nothing")  # fmt: skip
    args = ap.parse_args(argv)
    if args.merge:
        report([o for path in args.merge for o in load(path)])
        return 0

    earlier: list[Outcome] = []
    if args.retest is not None:
        saved = load(args.retest)
        earlier = [o for o in saved if o.killed]
        every = chosen = [o.mutant for o in saved if not o.killed]
    else:
        targets = [t for t in TARGETS if not args.only or any(o in t.files for o in args.only)]
        if not targets:
            known = [t.files for t in TARGETS]
            raise SystemExit(f"no target matches {args.only}; the targets: {known}")
        every = enumerate_mutants(targets, ROOT)
        chosen = sample(every, args.max_per_file, args.seed)
    counts: dict[str, int] = {}
    for m in chosen:
        counts[m.path] = counts.get(m.path, 0) + 1
    for path, n in sorted(counts.items()):
        print(f"{path}: {n} mutants", flush=True)
    print(f"{len(chosen)} of {len(every)} mutants"
          + (f" (at most {args.max_per_file} per file, seed {args.seed})"
             if args.max_per_file else ""), flush=True)  # fmt: skip
    if args.list:
        return 0

    with tempfile.TemporaryDirectory(prefix="splitserve-mutation-") as tmp:
        copy = Path(tmp)
        copy_repository(copy)
        here = Path.cwd()
        use_copy(copy)
        try:
            took = baseline(sorted({m.tests for m in chosen}))
            outcomes = []
            t0 = time.monotonic()
            for i, m in enumerate(chosen, 1):
                timeout = max(30.0, 5 * took[m.tests])
                o = run_mutant(m, copy, timeout)
                outcomes.append(o)
                if not o.killed:
                    before, after = changed_lines(o.diff)
                    print(f"SURVIVED {m.path}:{m.line} {m.operator.rsplit('/', 1)[-1]}: "
                          f"{before!r} -> {after!r}", flush=True)  # fmt: skip
                if i % 25 == 0:
                    print(f"  {i}/{len(chosen)} mutants, {time.monotonic() - t0:.0f} s",
                          flush=True)  # fmt: skip
        finally:
            os.chdir(here)
    outcomes = earlier + outcomes
    if args.save is not None:
        save(outcomes, args.save)
    report(outcomes)
    return 0


def save(outcomes: Sequence[Outcome], path: Path) -> None:
    """One JSON line per outcome (what :func:`load` reads back for a merged report)."""
    with path.open("w") as f:
        for o in outcomes:
            f.write(json.dumps({**asdict(o.mutant), "killed": o.killed, "how": o.how,
                                "diff": o.diff}) + "\n")  # fmt: skip


def load(path: Path) -> list[Outcome]:
    out = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        killed, how, diff = d.pop("killed"), d.pop("how"), d.pop("diff")
        d["tests"] = tuple(d["tests"])
        out.append(Outcome(Mutant(**d), killed, how, diff))
    return out


def report(outcomes: Sequence[Outcome]) -> None:
    real = [o for o in outcomes if o.how not in UNSCORED]
    survivors = [o for o in real if not o.killed]
    for o in outcomes:
        if o.how == NOT_MADE:
            print(f"not made by Cosmic Ray (not scored): {o.mutant.path}:{o.mutant.line} "
                  f"{o.mutant.operator.rsplit('/', 1)[-1]}: {o.diff}")  # fmt: skip
    print("\nsurvivors:")
    for o in survivors:
        before, after = changed_lines(o.diff)
        print(f"  {o.mutant.path}:{o.mutant.line} [{o.mutant.operator.rsplit('/', 1)[-1]}] "
              f"{before}  ->  {after}")  # fmt: skip
    by_file: dict[str, list[Outcome]] = {}
    for o in real:
        by_file.setdefault(o.mutant.path, []).append(o)
    print("\nper file (killed/total):")
    for path, group in sorted(by_file.items()):
        print(f"  {path}: {sum(o.killed for o in group)}/{len(group)}")
    kinds = {k: sum(o.how == k for o in real) for k in ("killed", "timeout", "incompetent")}
    print("how they died: " + ", ".join(f"{k} {v}" for k, v in kinds.items()))
    killed = len(real) - len(survivors)
    score = killed / len(real) if real else 1.0
    print(
        f"RESULT mutation_score={killed}/{len(real)} score={score:.3f} survivors={len(survivors)}"
    )


if __name__ == "__main__":
    sys.exit(main())
