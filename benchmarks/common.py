"""Running things to measure: rayhybrid's command line, the baselines, and what they leave.

Every measurement runs in a fresh process (as a user would start it), one at a time; ratios are
taken between runs of one `run.py` invocation, never against figures from another day.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def env() -> dict:
    e = dict(os.environ)
    e.pop("RAY_ADDRESS", None)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH", "")]))
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def steps_of(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in (json.loads(line) for line in path.read_text().splitlines() if line) if "event" not in r]


class Run:
    """`python -m rayhybrid <overrides>` in the background, watched from here: the wall time from
    launch to the first step's record, and what it leaves in its run directory."""

    def __init__(self, overrides: list[str], run_dir: Path, module: str = "rayhybrid") -> None:
        self.run_dir = run_dir
        self.launched = time.perf_counter()
        self.first_step_s: float | None = None
        self.proc = subprocess.Popen(
            [PY, "-m", module, *overrides, f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env(),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.output: list[str] = []
        self._reader = threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def wait_for_step(self, step: int, timeout: float = 600) -> None:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            n = len(steps_of(self.run_dir))
            if n >= 1 and self.first_step_s is None:
                self.first_step_s = time.perf_counter() - self.launched
            if n >= step:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"run ended before step {step}:\n{''.join(self.output[-30:])}")
            time.sleep(0.02)
        raise TimeoutError(f"step {step} not reached in {timeout}s")

    def finish(self, timeout: float = 900) -> dict:
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        if self.proc.returncode != 0:
            raise RuntimeError(f"run failed ({self.proc.returncode}):\n{''.join(self.output[-40:])}")
        return json.loads((self.run_dir / "summary.json").read_text())

    def kill_rank(self, rank: int) -> float:
        pid = json.loads((self.run_dir / "workers.json").read_text())[rank]["pid"]
        os.kill(pid, signal.SIGKILL)
        return time.perf_counter()


def train(overrides: list[str], run_dir: Path) -> tuple[dict, list[dict], float]:
    """A whole run; (summary, step records, seconds from launch to the first step's record)."""
    run = Run(overrides, run_dir)
    run.wait_for_step(1)
    summary = run.finish()
    return summary, steps_of(run_dir), run.first_step_s


def steady_step_s(steps: list[dict], skip: int = 1) -> float:
    """Median step time after the first `skip` steps (warm-up)."""
    times = sorted(s["step_time_s"] for s in steps[skip:]) or [s["step_time_s"] for s in steps]
    return times[len(times) // 2]


def baseline(script: str, args: list[str], launcher: list[str] | None = None, timeout: float = 900) -> dict:
    """Run a script of benchmarks/baselines/; its last stdout line is a JSON object."""
    cmd = [*(launcher or [PY]), str(ROOT / "benchmarks" / "baselines" / script), *args]
    launched = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.strip().startswith("{")]
    result = json.loads(lines[-1])
    result["launched_wall"] = launched
    return result
