"""Write or check the chart's dashboards and alert rules (run from the repository root,
or give ``--out`` and ``--alerts-out``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from splitserve_operator.dashboards import alerts
from splitserve_operator.dashboards.export import build_all, dump

DEFAULT_OUT = Path("charts") / "splitserve" / "dashboards"
"""The chart's dashboards folder, relative to the repository root (run it from there)."""
ALERTS_OUT = Path("charts") / "splitserve" / "alerts"
"""The chart's alert rules folder, which ``templates/prometheusrule.yaml`` reads."""
RULES_FILE = "splitserve.rules.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the JSON files")
    parser.add_argument(
        "--alerts-out", type=Path, default=ALERTS_OUT, help="folder for the alert rules"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if a file differs from the builder's",
    )
    args = parser.parse_args(argv)
    stale = []
    files = {args.out / name: dump(model) for name, model in build_all().items()}
    files[args.alerts_out / RULES_FILE] = alerts.dump(alerts.rules())
    for path, text in files.items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print(
            "stale dashboards or alert rules (run python -m splitserve_operator.dashboards):",
            *stale,
            sep="\n  ",
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
