"""The examples run as shipped (with fewer steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_train_on_text_example(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_on_text.py"), "--steps", "6", "--topology", "pp2_tp2",
         "--run-dir", str(run_dir)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["data"]["name"] == "text"
    assert summary["topology"]["pp"] == 2 and summary["topology"]["tp"] == 2
    assert summary["final_loss"] < summary["initial_loss"]
    assert "completed: loss" in proc.stdout
