"""The examples run as shipped (with fewer steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # Ray or several processes; see the quick tier in README.md

REPO = Path(__file__).resolve().parents[1]


def test_train_on_text_example(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "train_on_text.py"),
            "--steps",
            "6",
            "--topology",
            "pp2_tp2",
            "--run-dir",
            str(run_dir),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["data"]["name"] == "text"
    assert summary["topology"]["pp"] == 2 and summary["topology"]["tp"] == 2
    assert summary["final_loss"] < summary["initial_loss"]
    assert "completed: loss" in proc.stdout


def test_elastic_cluster_launcher_config_matches_its_command():
    import shlex

    import yaml

    from rayhybrid.config.compose import compose, to_config
    from rayhybrid.config.validate import usable_dps
    from rayhybrid.preflight import check

    path = REPO / "examples" / "elastic_cluster.yaml"
    text = path.read_text()
    config = yaml.safe_load(text)
    worker = config["available_node_types"]["gpu_worker"]
    assert config["provider"]["type"] == "aws" and config["head_node_type"] == "head"
    assert worker["min_workers"] < worker["max_workers"] == config["max_workers"]
    # The job command in the header composes and validates, and its dp range fits the workers.
    (command,) = [line for line in text.splitlines() if "python -m rayhybrid" in line]
    args = shlex.split(command.strip('# "'))[3:]
    cfg = to_config(compose(args))
    check(cfg)
    assert cfg.elastic.enabled and cfg.elastic.max_dp == worker["max_workers"]
    assert usable_dps(cfg) == [1, 2, 4]
    assert cfg.topology.pp * cfg.topology.tp == 8  # one replica per 8-GPU node
