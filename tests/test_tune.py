"""`python -m rayhybrid.tune` end to end on CPU: a real search with the real trainer on pp2, its
outputs, and that its answer is the largest micro-batch that fits and trains as printed."""

from __future__ import annotations

import csv
import json
import shlex

import pytest
from test_cli import assert_one_line_error, run_cli

pytestmark = pytest.mark.slow  # Ray or several processes; see the quick tier in README.md

BUDGET_MB = 6  # the tiny model on pp2: about 2 MB fixed and 0.6-1.1 MB per sample
COLUMNS = {"micro_batch_size", "num_microbatches", "activation_checkpointing", "peak_mb", "oom", "tokens_per_s"}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune")
    proc = run_cli(
        ["+topology=pp2", f"tune.memory_budget_mb={BUDGET_MB}", f"hydra.run.dir={out}/run"],
        cwd=out,
        timeout=600,
        module="rayhybrid.tune",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = out / "run"
    with open(run / "tune_results.csv") as f:
        rows = list(csv.DictReader(f))
    return proc, run, rows


def test_results_table_and_files(tuned):
    proc, run, rows = tuned
    assert COLUMNS <= set(rows[0])
    assert {r["purpose"] for r in rows} == {"memory", "throughput"}
    assert {r["activation_checkpointing"] for r in rows} == {"0", "1"}
    for r in rows:
        assert int(r["global_batch_size"]) == int(r["micro_batch_size"]) * int(r["num_microbatches"])
        if r["fits"] == "1":
            assert float(r["peak_mb"]) <= BUDGET_MB and float(r["tokens_per_s"]) > 0
    # The printed table has a line per trial, and the command comes last.
    assert "tokens/s" in proc.stdout and "train with:" in proc.stdout
    for name in ("memory.png", "throughput.png"):
        assert (run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run / "tune_summary.json").read_text())
    assert summary["trials"] == len(rows)


def test_memory_search_targets(tuned):
    _, run, rows = tuned
    summary = json.loads((run / "tune_summary.json").read_text())
    for ac in ("0", "1"):
        memory = [r for r in rows if r["purpose"] == "memory" and r["activation_checkpointing"] == ac]
        assert len(memory) <= 4  # two probes, the prediction, at most one more
        largest = max(int(r["micro_batch_size"]) for r in memory if r["fits"] == "1")
        assert summary["largest_micro_batch"]["true" if ac == "1" else "false"] == largest
        # Every prediction is within 5% of what the trial then measured.
        for r in memory:
            if r["predicted_peak_mb"] and r["peak_mb"]:
                assert abs(float(r["predicted_peak_mb"]) - float(r["peak_mb"])) <= 0.05 * float(r["peak_mb"])
    # Checkpointing keeps fewer activations, so a larger micro-batch fits.
    assert summary["largest_micro_batch"]["true"] > summary["largest_micro_batch"]["false"]


def test_one_more_sample_does_not_fit(tuned, tmp_path):
    """The search's largest micro-batch (no checkpointing) is the true maximum: one more sample
    runs out of the budget in a real training run."""
    _, run, _ = tuned
    largest = json.loads((run / "tune_summary.json").read_text())["largest_micro_batch"]["false"]
    m = largest + 1
    proc = run_cli(
        [
            "+topology=pp2",
            f"train.micro_batch_size={m}",
            f"train.global_batch_size={2 * m}",
            "train.steps=2",
            "metrics.memory=true",
            f"tune.memory_budget_mb={BUDGET_MB}",
            "fault.max_restarts=0",
            "checkpoint.every=0",
            f"hydra.run.dir={tmp_path}/over",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 1 and "OutOfMemoryError" in proc.stderr, proc.stderr[-2000:]


def test_best_yaml_and_the_printed_command_train(tuned, tmp_path):
    proc, run, _ = tuned
    best = (run / "best.yaml").read_text()
    command = proc.stdout.split("train with:")[1].strip().splitlines()[0]
    assert command in best
    args = shlex.split(command)
    assert args[:3] == ["python", "-m", "rayhybrid"] and "+topology=pp2" in args
    for line in best.splitlines():
        if not line.startswith("#"):
            key, value = line.split(": ")
            assert f"{key}={value}" in args
    # Train with it (a few steps, counting memory against the same budget): it fits.
    ran = run_cli(
        [
            *args[3:],
            "train.steps=2",
            "metrics.memory=true",
            f"tune.memory_budget_mb={BUDGET_MB}",
            "checkpoint.every=0",
            f"hydra.run.dir={tmp_path}/best",
        ],
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]


@pytest.mark.parametrize(
    "args, words",
    [
        (["tune.probes=[2,1]"], ["tune.probes", "increasing"]),
        (["tune.steps=1"], ["tune.steps", "at least 2"]),
        (["tune.activation_checkpointing=[]"], ["tune.activation_checkpointing"]),
        (["+topology=pp2", "tune.num_microbatches=1", "tune.memory_budget_mb=6"], ["1f1b"]),
        (["+topology=dp2"], ["tune.memory_budget_mb", "required on CPU"]),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, args, words):
    proc = run_cli([*args, f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, timeout=120, module="rayhybrid.tune")
    assert_one_line_error(proc, *words)
