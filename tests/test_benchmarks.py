"""benchmarks/ (not run here: they take minutes): the Lightning-style baseline search, the
report's sections from a results file, and run.py's argument errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import report
import run as bench_run


@pytest.mark.parametrize("largest", [1, 2, 3, 9, 16, 17, 100])
def test_lightning_binsearch_doubles_then_bisects(largest):
    tried = []

    def fits(m: int) -> bool:
        tried.append(m)
        return m <= largest

    assert bench_run._lightning_binsearch(fits, init=2) == largest
    doubling = [2 * 2**i for i in range(len(tried)) if 2 * 2**i <= max(tried)]
    assert tried[: len(doubling)] == doubling  # 2, 4, 8, ... until the first failure
    if largest == 9:
        assert tried == [2, 4, 8, 16, 12, 10, 9]


def _results() -> dict:
    meta = {"seconds": 1.0, "command": "python benchmarks/run.py --quick", "date": "2026-11-23 07:00", "machine": "x"}
    return {
        "scaling": {
            **meta,
            "rows": [
                {"case": "1 rank", "step_s": 0.5, "speedup": 1.0},
                {"case": "dp2", "step_s": 0.25, "speedup": 2.0},
            ],
            "ceiling": 1.9,
            "alone_step_s": 0.5,
            "pair_step_s": 0.526,
            "backend": "gloo",
            "allreduce": [
                {"bytes": 4096, "ms": 0.5, "mb_per_s": 8.0},
                {"bytes": 4 << 20, "ms": 4.0, "mb_per_s": 1000.0},
            ],
        },
        "overhead": {
            **meta,
            "runs_each": 2,
            "rows": [
                {
                    "case": "dp2",
                    "same_losses": True,
                    "rayhybrid_step_s": 0.42,
                    "torchrun_step_s": 0.40,
                    "step_ratio": 1.05,
                    "rayhybrid_wall_s": 0.43,
                    "torchrun_wall_s": 0.40,
                    "wall_ratio": 1.075,
                    "rayhybrid_runs_s": [0.41, 0.43],
                    "torchrun_runs_s": [0.39, 0.41],
                }
            ],
        },
        "startup": {"error": "RuntimeError: boom", **meta},
        "recovery": {
            **meta,
            "rayhybrid": {"total_s": 5.0, "detect_s": 0.1},
            "raytrain": {"kill_to_first_step_s": 30.0, "breakdown": {"detect_s": 2.0}, "steps_redone": 1},
        },
    }


def test_report_writes_each_section_with_its_command():
    results = _results()
    md = report.markdown(results)
    assert md.count("Command: `python benchmarks/run.py --quick`") == 4
    assert "| dp2 | 0.250 | 2.00x |" in md
    assert "at most **1.90x**" in md
    assert "| dp2 | 0.400 | 0.420 | 1.050 | 0.400 | 0.430 | 1.075 | yes |" in md
    assert "**Failed**: `RuntimeError: boom`" in md  # a failed benchmark is said, not dropped
    assert "Ray Train takes 6.0x as long" in md
    lines = report.table(results).splitlines()
    assert [line.split()[0] for line in lines] == ["scaling", "overhead", "startup", "recovery"]
    assert "FAILED" in lines[2] and "5.0s" in lines[3]
    json.dumps(results)  # what run.py stores is JSON


def test_unknown_benchmark_is_a_usage_error():
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--only", "speed"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2
    assert "unknown benchmark(s) ['speed']; choose from scaling, overhead" in proc.stderr
