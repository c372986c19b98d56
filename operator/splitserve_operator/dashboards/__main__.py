"""Write or check the chart's dashboards (run from the repository root, or give ``--out``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from splitserve_operator.dashboards.export import build_all, dump

DEFAULT_OUT = Path("charts") / "splitserve" / "dashboards"
"""The chart's dashboards folder, relative to the repository root (run it from there)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the JSON files")
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if a file differs from the builder's",
    )
    args = parser.parse_args(argv)
    stale = []
    for name, model in build_all().items():
        path = args.out / name
        text = dump(model)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print(
            "stale dashboards (run python -m splitserve_operator.dashboards):", *stale, sep="\n  "
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
