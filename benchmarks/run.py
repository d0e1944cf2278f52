"""rayhybrid's benchmarks against the alternatives; writes BENCHMARKS.md and prints one table.

    python benchmarks/run.py --quick          # 13 minutes on a 2-core CPU machine (6 of them checkpoints)
    python benchmarks/run.py                  # more steps and more cases
    python benchmarks/run.py --only scaling,schedules
    python benchmarks/run.py --only gpu       # about 8 minutes on one H100 or H200 (benchmarks/gpu.py)

Each benchmark runs its cases one after another in fresh processes and reports ratios measured
in this one invocation (absolute times on a shared or small machine say little). Results go
to benchmarks/results.json and BENCHMARKS.md (each section with the command that produced it;
the hand-written "Figures from development runs" section is kept as it is). The gpu benchmark
runs only where CUDA is: elsewhere it says so in one line and BENCHMARKS.md keeps its GPU
section as it was. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import report
from suite import BENCHMARKS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and cases (13 minutes on 2 cores)")
    parser.add_argument("--only", default="", help="comma-separated benchmark names: " + ", ".join(BENCHMARKS))
    parser.add_argument("--out", default=str(common.ROOT / "BENCHMARKS.md"))
    parser.add_argument("--results", default=str(common.ROOT / "benchmarks" / "results.json"))
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    results_path = Path(args.results)
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    command = (
        "python benchmarks/run.py" + (" --quick" if args.quick else "") + (f" --only {args.only}" if args.only else "")
    )
    with tempfile.TemporaryDirectory(prefix="rayhybrid-bench-") as tmp:
        for name in names:
            start = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                result = BENCHMARKS[name].run(Path(tmp), args.quick)
            except Exception as err:  # noqa: BLE001 - one broken benchmark must not lose the others
                result = {"error": f"{type(err).__name__}: {err}"[:2000]}
            if "skipped" in result:  # nothing measured: results.json keeps what it had
                print(f"{name}: skipped, {result['skipped']}; BENCHMARKS.md keeps its section as it was", flush=True)
                continue
            result.update(
                seconds=round(time.perf_counter() - start, 1),
                command=command,
                date=time.strftime("%Y-%m-%d %H:%M"),
                machine=_machine(),
            )
            results[name] = result
            results_path.write_text(json.dumps(results, indent=1) + "\n")
            print(json.dumps(result, indent=None)[:1500], flush=True)
    report.write(Path(args.out), results)  # keeps BENCHMARKS.md's "Figures from development runs"
    print(report.table(results))


def _machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


if __name__ == "__main__":
    main()
