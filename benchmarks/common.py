"""Running things to measure: rayhybrid's command line, the baselines, and what they leave.

Every measurement runs in a fresh process (as a user would start it), one at a time; ratios are
taken between runs of one `run.py` invocation, never against figures from another day.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

# Big enough that compute dominates a step on one CPU thread per rank (~0.5 s per micro-batch
# pass), small enough for minutes: 4 layers, d 256, seq 128, vocab 2048.
MODEL = ["model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.vocab_size=2048", "data.seq_len=128"]
QUIET = ["checkpoint.every=0", "train.log_every=100"]


def env(extra: dict | None = None) -> dict:
    e = dict(os.environ) | (extra or {})
    e.pop("RAY_ADDRESS", None)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH", "")]))
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def records_of(run_dir: Path) -> list[dict]:
    """Every record of metrics.jsonl in order: steps and events ({"event": ...})."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def steps_of(run_dir: Path) -> list[dict]:
    return [r for r in records_of(run_dir) if "event" not in r]


class Run:
    """`python -m rayhybrid <overrides>` in the background, watched from here: the wall time from
    launch to the first step's record, and what it leaves in its run directory."""

    def __init__(
        self, overrides: list[str], run_dir: Path, module: str = "rayhybrid", extra_env: dict | None = None
    ) -> None:
        self.run_dir = run_dir
        self.launched = time.perf_counter()
        self.first_step_s: float | None = None
        self.proc = subprocess.Popen(
            [PY, "-m", module, *overrides, f"hydra.run.dir={run_dir}"],
            cwd=ROOT,
            env=env(extra_env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
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

    def signal_rank(self, rank: int, sig: int) -> float:
        """Send `sig` to a rank's process; returns the wall time (time.time(), as the records')."""
        pid = json.loads((self.run_dir / "workers.json").read_text())[rank]["pid"]
        os.kill(pid, sig)
        return time.time()

    def wait_for_line(self, text: str, timeout: float = 600) -> None:
        """Until the run prints a line containing `text`."""
        deadline = time.perf_counter() + timeout
        while not any(text in line for line in list(self.output)):
            if time.perf_counter() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"the run never printed {text!r}:\n{''.join(self.output[-30:])}")
            time.sleep(0.01)


def train(overrides: list[str], run_dir: Path, extra_env: dict | None = None) -> tuple[dict, list[dict], float]:
    """A whole run; (summary, step records, seconds from launch to the first step's record)."""
    run = Run(overrides, run_dir, extra_env=extra_env)
    run.wait_for_step(1)
    summary = run.finish()
    return summary, steps_of(run_dir), run.first_step_s


def steady_step_s(steps: list[dict], skip: int = 1) -> float:
    """Median step time after the first `skip` steps (warm-up)."""
    return statistics.median([s["step_time_s"] for s in steps[skip:]] or [s["step_time_s"] for s in steps])


def baseline(script: str, args: list[str], launcher: list[str] | None = None, timeout: float = 900) -> dict:
    """Run a script of benchmarks/ (or benchmarks/baselines/); its last stdout line is a JSON object."""
    return baselines_at_once([(script, args, launcher)], timeout)[0]


def baselines_at_once(jobs: list[tuple[str, list[str], list[str] | None]], timeout: float = 900) -> list[dict]:
    """Start several such scripts at the same moment and wait for all; their JSON objects."""
    procs = []
    for script, args, launcher in jobs:
        path = ROOT / "benchmarks" / script
        path = path if path.exists() else ROOT / "benchmarks" / "baselines" / script
        cmd = [*(launcher or [PY]), str(path), *args]
        procs.append(
            (
                cmd,
                time.time(),
                subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
            )
        )
    results = []
    for cmd, launched, proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for _, _, p in procs:  # none outlives the benchmark (a GPU's memory, the cores)
                p.kill()
                p.wait()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{out[-2000:]}\n{err[-3000:]}")
        result = json.loads([line for line in out.splitlines() if line.strip().startswith("{")][-1])
        result["launched_wall"] = launched
        results.append(result)
    return results


def torchrun(n: int) -> list[str]:
    """The launcher of a torchrun baseline with `n` processes on this machine."""
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]


def intervals(walls: list[float]) -> list[float]:
    """Seconds between consecutive steps' wall-clock times."""
    return [b - a for a, b in itertools.pairwise(walls)]
