"""The command line: `python -m rayhybrid ...` end to end, outputs, and exit code 2 on bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # Ray or several processes; see the quick tier in README.md

REPO = Path(__file__).resolve().parents[1]


def run_cli(
    args: list[str], cwd: Path, timeout: float = 300, module: str = "rayhybrid", env_extra: dict | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(env_extra or {})
    # Works from any directory: the installed package, else this checkout.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "args, words",
    [
        (["topology.tp=3"], ["topology.tp", "n_heads"]),
        (["+topology=pp4", "model.n_layers=2"], ["topology.pp", "n_layers=2"]),
        (
            ["+topology=dp2", "train.global_batch_size=10", "train.micro_batch_size=4"],
            ["train.global_batch_size", "multiple of 8"],
        ),
        (["topology.dp=0"], ["topology.dp", "positive"]),
        (["train.micro_batch_size=-1"], ["train.micro_batch_size", "positive"]),
        (["+topology=pp2", "topology.schedule=zb_magic"], ["topology.schedule", "gpipe"]),
        (["+topology=dp9"], ["topology", "dp2_pp2_tp2", "dp1_pp1_tp1"]),
        (["+topology=dp4", "topology.dp_shard=3"], ["topology.dp_shard", "does not divide topology.dp=4"]),
        (["checkpoint.dir=nope://bucket/x"], ["checkpoint.dir", "unknown storage protocol nope://"]),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, args, words):
    proc = run_cli([*args, f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, timeout=60)
    assert_one_line_error(proc, *words)
    assert not (tmp_path / "run").exists(), "validation must fail before a run directory is made"


def test_an_old_spelling_under_a_hydra_flag_exits_2_with_one_line(tmp_path):
    """`--cfg job` skips the run's checks (it prints the config), not the spelling check of a
    model family's setting: one line naming the new spelling, no traceback."""
    proc = run_cli(["--cfg", "job", "model=llama3_debug", "model.rope_theta=5"], cwd=tmp_path, timeout=60)
    assert_one_line_error(proc, "model.rope_theta", "model.options.rope_theta")


def test_more_ranks_than_cluster_can_place(tmp_path):
    # A local Ray with 4 logical CPUs can never hold 8 ranks of one CPU each.
    proc = run_cli(["+topology=dp2_pp2_tp2", "cluster.num_cpus=4", f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path)
    line = assert_one_line_error(proc, "8 ranks", "8 CPUs", "has 4")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] in line


def test_checkpoint_dir_the_workers_cannot_see(tmp_path):
    """The start-up check, on one machine: `memory://` is a store private to each process, as
    a node's own disk is to that node. The driver writes its marker there; the node hosting
    the rank does not see it, and the run stops before training, in one line."""
    proc = run_cli(["checkpoint.dir=memory://ckpts/run", f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path)
    line = assert_one_line_error(proc, "checkpoint.dir", "memory://ckpts/run", "does not see the marker", "node ")
    assert "every node" in line  # the fix: one store for all
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 0


def test_train_dp2_pp2_tp2_from_another_directory(tmp_path):
    run_dir = tmp_path / "run"
    steps = 12
    proc = run_cli(["+topology=dp2_pp2_tp2", f"train.steps={steps}", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    step_lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(step_lines) == steps

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [r for r in records if "event" not in r]
    assert [r["step"] for r in records if r.get("event") == "checkpoint"] == [steps]  # the final save
    assert (run_dir / "checkpoints" / f"step_{steps:08d}" / "meta.json").is_file()
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "consumed_samples", "dp", "pp", "tp"):
            assert key in m
        assert (m["dp"], m["pp"], m["tp"]) == (2, 2, 2)
        assert m["consumed_samples"] == m["step"] * 16
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.3

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == steps
    assert summary["final_loss"] == metrics[-1]["loss"]
    assert summary["topology"]["dp"] == 2 and summary["topology"]["world_size"] == 8
    assert summary["wall_s"] > 0 and summary["backend"] == "gloo"
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / ".hydra" / "overrides.yaml").is_file()


def test_default_trains_one_rank(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(["train.steps=3", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["topology"]["world_size"] == 1 and summary["steps"] == 3
    # The start-up by phase, in order, from the command's start to the end of the first step.
    from rayhybrid.trainer.startup import PHASES

    phases = summary["startup"]
    assert list(phases) == list(PHASES) and all(s >= 0 for s in phases.values()), phases
    # The phases tile the start-up (each mark ends one): they add up to it but for rounding.
    assert abs(sum(phases.values()) - summary["startup_s"]) <= 0.001 * len(PHASES), phases
    assert phases["ray"] > 0 and phases["imports"] > 0 and phases["launch"] > 0, phases  # measured, not zeros
    assert summary["startup_s"] <= summary["wall_s"]
    line = next(line for line in proc.stderr.splitlines() + proc.stdout.splitlines() if "first step done in" in line)
    assert "launch" in line and "first step" in line and "parameters" in line, line


def test_sigterm_saves_a_checkpoint_and_exits_130_and_the_run_resumes_from_it(tmp_path):
    """`ray job stop`, or a head node reclaimed, sends the driver SIGTERM: it finishes the step in
    progress, saves and commits a checkpoint of it (checkpoint.every is far off), writes the
    summary and exits with 130. A run started from that checkpoint carries on exactly."""
    # A constant learning rate after warmup: the same schedule whatever train.steps is, so the
    # runs of 40, 100000 and stopped + 5 steps train each step alike.
    common = [
        "data.seq_len=32",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "checkpoint.every=1000",
        "train.decay=constant",
    ]
    reference = tmp_path / "ref"
    proc = run_cli([*common, "train.steps=40", f"hydra.run.dir={reference}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])))
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "rayhybrid", *common, "train.steps=100000", f"hydra.run.dir={run_dir}"]
    driver = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while sum('"loss"' in line for line in _lines(run_dir / "metrics.jsonl")) < 5:
            assert driver.poll() is None and time.monotonic() < deadline, "the run did not get to step 5"
            time.sleep(0.05)
        driver.send_signal(signal.SIGTERM)
        _, err = driver.communicate(timeout=120)
    finally:
        driver.kill()
    assert driver.returncode == 130, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = summary["steps"]
    assert summary["status"] == "interrupted" and stopped >= 5 and "SIGTERM" in summary["error"]
    saved = [json.loads(line) for line in _lines(run_dir / "metrics.jsonl") if '"event": "checkpoint"' in line]
    assert [r["step"] for r in saved] == [stopped]  # the one save: the stop's, after the last step
    assert summary["last_checkpoint"] == str(run_dir / "checkpoints" / f"step_{stopped:08d}")

    resumed = tmp_path / "resumed"
    proc = run_cli(
        [
            *common,
            f"train.steps={stopped + 5}",
            f"checkpoint.dir={run_dir / 'checkpoints'}",
            f"hydra.run.dir={resumed}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = json.loads((resumed / "summary.json").read_text())
    assert after["resumed_step"] == stopped
    assert _losses(resumed) == _losses(reference)[stopped : stopped + 5]  # bitwise: one rank, same state


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in _lines(run_dir / "metrics.jsonl") if '"loss"' in line]
