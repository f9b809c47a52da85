"""Prints passed / failed / skipped (and never reached) from the runner's result files."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(paths: list[str]) -> int:
    """``summary.py RESULTS.jsonl...``: one block per file, then the totals; exit 1 if any
    test failed or was not reached."""
    totals = {"passed": 0, "failed": 0, "skipped": 0, "not reached": 0}
    for path in paths:
        collected: list[str] = []
        outcome: dict[str, tuple[str, str]] = {}
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            if row["outcome"] == "collected":
                collected.append(row["test"])
            elif outcome.get(row["test"], ("",))[0] != "failed":  # first failure wins
                outcome[row["test"]] = (row["outcome"], row.get("reason") or "")
        counts = {k: 0 for k in totals}
        lines = []
        for test in collected:
            kind, reason = outcome.get(test, ("not reached", "the file's timeout ended it first"))
            counts[kind] += 1
            if kind != "passed":
                first = " ".join(reason.split())[:400]
                lines.append(f"  {kind.upper():11} {test}: {first}")
        name = Path(path).name.removesuffix(".jsonl")
        print(
            f"{name}: {len(collected)} tests, " + ", ".join(f"{v} {k}" for k, v in counts.items())
        )
        if lines:
            print("\n".join(lines))
        for k, v in counts.items():
            totals[k] += v
    n = sum(totals.values())
    print(f"TOTAL {n}: " + ", ".join(f"{v} {k}" for k, v in totals.items()))
    return 1 if totals["failed"] or totals["not reached"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
