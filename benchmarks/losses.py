"""Per-step losses of two sets of runs, compared bit for bit: the check that a refactoring
changed no number (issue 38 ran it on the quick start and the fault soak, before and after).

    # before: a checkout of the old commit; after: this one (PYTHONPATH picks the checkout)
    python -m rayhybrid +topology=dp2_pp2_tp2                      # in before/qs and after/qs
    python -m pytest -q tests/test_soak.py --basetemp=<dir>/soak   # in before/ and after/
    python benchmarks/losses.py before after                       # exit 1 on any difference

Every `metrics.jsonl` under each root is read; runs are matched by their path under the root
(a Hydra date directory and pytest's numbered tmp suffixes aside), and each step record's loss
is compared as the exact float (`float.hex`).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def losses(root: Path) -> dict[str, list[tuple[int, str]]]:
    """Run (its path under `root`, normalised) -> [(step, loss as float.hex)] in record order."""
    out = {}
    for path in sorted(root.rglob("metrics.jsonl")):
        rows = []
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("kind", "step") == "step" and "loss" in record and "step" in record:
                rows.append((record["step"], float(record["loss"]).hex()))
        run = re.sub(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", "DATE", str(path.relative_to(root)))
        out[re.sub(r"\d+/", "/", run)] = rows
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    before, after = (losses(Path(a)) for a in argv)
    if not before or not after:
        print("no metrics.jsonl under one of the roots")
        return 2
    differ = 0
    for run in sorted(before.keys() | after.keys()):
        a, b = before.get(run), after.get(run)
        if a is None or b is None:
            print(f"{run}: only in {'after' if a is None else 'before'}")
            differ += 1
            continue
        same = a == b
        differ += not same
        print(f"{run}: {len(a)} step records, {'bitwise equal' if same else 'DIFFERENT'}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
