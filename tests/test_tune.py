"""`python -m rayhybrid.tune` end to end on CPU: real searches with the real trainer on pp2 (a
small and a large budget, a fixed global batch) and a layout search on 4 ranks; their outputs,
and that the answer is the largest micro-batch that fits (one more runs out of memory in a real
run) and trains as printed."""

from __future__ import annotations

import csv
import json
import shlex

import pytest
from test_cli import assert_one_line_error, run_cli

pytestmark = pytest.mark.slow  # Ray or several processes; see the quick tier in README.md

BUDGET_MB = 6  # the tiny model on pp2: about 2 MB fixed and 0.6-1.1 MB per sample
COLUMNS = {"micro_batch_size", "num_microbatches", "activation_checkpointing", "peak_mb", "oom", "tokens_per_s"}


def tune(out, *args, env_extra=None):
    """`python -m rayhybrid.tune *args` into `out/run`: it succeeds; (process, run directory,
    tune_results.csv rows, tune_summary.json)."""
    proc = run_cli(
        [*args, f"hydra.run.dir={out}/run"], cwd=out, timeout=600, module="rayhybrid.tune", env_extra=env_extra
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = out / "run"
    with open(run / "tune_results.csv") as f:
        rows = list(csv.DictReader(f))
    return proc, run, rows, json.loads((run / "tune_summary.json").read_text())


# torch's C++ log lines at INFO: every worker writes some to its stderr (c10d's "[I... socket.cpp:...]"),
# as a GPU node's workers write their warnings ("[W... socket.cpp:207] The hostname of the client socket ...").
CPP_LOG = {"TORCH_CPP_LOG_LEVEL": "INFO"}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune")
    return tune(out, "+topology=pp2", f"tune.memory_budget_mb={BUDGET_MB}", env_extra=CPP_LOG)[:3]


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


def test_the_terminal_has_a_line_per_trial_and_the_table_and_ray_tunes_text_is_in_tune_log(tuned):
    """The terminal is rayhybrid's lines: one per trial, the result table, the command; Ray
    Tune's banners and tables and the workers' C++ log lines are in `<run dir>/tune.log`, with
    rayhybrid's lines."""
    proc, run, rows = tuned
    terminal = proc.stdout + proc.stderr
    trial_lines = [line for line in terminal.splitlines() if line.startswith("trial ") and "): micro-batch" in line]
    assert [line.split(" ")[1] for line in trial_lines] == [str(i) for i in range(1, len(rows) + 1)], terminal
    assert "trial     purpose" in proc.stdout and "train with:" in proc.stdout  # the table, the command
    ray_text = ("Configuration for experiment", "View detailed results", "tensorboard", "Trial status", "socket.cpp")
    assert [text for text in ray_text + ("╭", "pid=", "c10d") if text in terminal] == [], terminal
    logged = (run / "tune.log").read_text()
    assert "[stdout][INFO] │ Configuration for experiment" in logged and "View detailed results" in logged
    assert "(TrainWorker pid=" in logged and "socket.cpp" in logged  # the workers' C++ lines
    assert all(line in logged for line in trial_lines)


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


def assert_one_more_does_not_fit(m: int, budget_mb: float, tmp_path) -> None:
    """A real pp2 training run at micro-batch `m` (2 micro-batches, as the memory search runs)
    runs out of `budget_mb`."""
    proc = run_cli(
        [
            "+topology=pp2",
            f"train.micro_batch_size={m}",
            f"train.global_batch_size={2 * m}",
            "train.steps=2",
            "metrics.memory=true",
            f"tune.memory_budget_mb={budget_mb}",
            "fault.max_restarts=0",
            "checkpoint.every=0",
            f"hydra.run.dir={tmp_path}/over",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 1 and "OutOfMemoryError" in proc.stderr, proc.stderr[-2000:]


def test_one_more_sample_does_not_fit(tuned, tmp_path):
    """The search's largest micro-batch (no checkpointing) is the true maximum: one more sample
    runs out of the budget in a real training run."""
    _, run, _ = tuned
    largest = json.loads((run / "tune_summary.json").read_text())["largest_micro_batch"]["false"]
    assert_one_more_does_not_fit(largest + 1, BUDGET_MB, tmp_path)


def test_a_large_budget_takes_at_most_four_memory_trials(tmp_path):
    """The crawl this replaced: at 400 MB the search went up one size per trial after its
    prediction (25 trials in all). At a budget ten times the small one's (a micro-batch near 50)
    it takes at most 4 memory trials (3 with the planner's probes) and ends on the true maximum:
    one more sample runs out of memory in a real run."""
    budget = 60
    *_, summary = tune(
        tmp_path, "+topology=pp2", f"tune.memory_budget_mb={budget}", "tune.activation_checkpointing=[false]"
    )
    largest = summary["largest_micro_batch"]["false"]
    assert summary["memory_trials"]["false"] <= 4 and largest >= 40, summary
    assert summary["planner_error"]["max"] < 0.01  # the planner placed the probes: it knows this model
    assert_one_more_does_not_fit(largest + 1, budget, tmp_path)


def test_a_fixed_global_batch(tmp_path):
    """tune.global_batch_size=32 on pp2: every trial trains 32 samples per step in micro-batches
    that divide it, the fastest that fits wins, and best.yaml keeps 32."""
    budget, g = 8, 32  # micro-batch 8 of 32 (4 micro-batches) needs about 11 MB, 4 about 7.2
    _, run, rows, summary = tune(
        tmp_path, "+topology=pp2", f"tune.memory_budget_mb={budget}", f"tune.global_batch_size={g}"
    )
    for r in rows:
        m, n = int(r["micro_batch_size"]), int(r["num_microbatches"])
        assert int(r["global_batch_size"]) == m * n == g and n >= 2  # 1F1B: at least pp micro-batches
    assert summary["global_batch_size"] == g and summary["largest_micro_batch"] == {"false": 4, "true": 8}
    assert all(n <= 4 for n in summary["memory_trials"].values())
    fitting = [r for r in rows if r["fits"] == "1"]
    fastest = max(fitting, key=lambda r: float(r["tokens_per_cpu_s"]))
    best = (run / "best.yaml").read_text()
    assert f"train.global_batch_size: {g}" in best
    assert f"train.micro_batch_size: {fastest['micro_batch_size']}" in best
    assert (
        f"train.activation_checkpointing: {'true' if fastest['activation_checkpointing'] == '1' else 'false'}" in best
    )


def test_layout_search_on_four_ranks(tmp_path):
    """tune.search=layout tune.devices=4 from dp2 x tp2: the planner rules out the points over
    the budget (no trial spent on them, none runs out of memory), the trials (at most
    tune.max_trials) show planned beside measured memory, the baseline (dp2 x tp2 as given)
    runs first, then one point of each of two other layouts (1 x 4 x 1 and 2 x 2 x 1 move the
    fewest bytes), and the winner is the fastest that fitted, with a command to train it."""
    budget, trials = 6.5, 5
    proc, run, rows, summary = tune(
        tmp_path,
        "+topology=dp2_tp2",
        "tune.search=layout",
        "tune.devices=4",
        f"tune.memory_budget_mb={budget}",
        f"tune.max_trials={trials}",
        "tune.steps=2",
    )
    assert 3 <= len(rows) <= trials and summary["trials"] == len(rows)
    assert rows[0]["purpose"] == "baseline" and (rows[0]["dp"], rows[0]["pp"], rows[0]["tp"]) == ("2", "1", "2")
    assert len({(r["dp"], r["pp"], r["tp"]) for r in rows}) >= 3  # several layouts were timed
    assert summary["pruned_by_planned_memory"] > 0 and summary["points"] > len(rows)
    for r in rows:
        assert int(r["dp"]) * int(r["pp"]) * int(r["tp"]) == 4 and int(r["global_batch_size"]) == 16
        assert r["fits"] == "1" and r["oom"] == "0", r  # the planner kept what cannot fit out
        assert float(r["planned_mb"]) <= budget * 0.99
        assert abs(float(r["planned_mb"]) / float(r["peak_mb"]) - 1) < 0.1, r
    assert "planned" in proc.stdout and "tokens/CPU-s" in proc.stdout
    fastest = max(rows, key=lambda r: float(r["tokens_per_cpu_s"]))
    best = summary["best"]
    assert best["tokens_per_cpu_s"] == float(fastest["tokens_per_cpu_s"])
    assert f"topology.dp={fastest['dp']}" in best["command"] and f"topology.tp={fastest['tp']}" in best["command"]
    assert summary["baseline"]["speedup"] >= 1.0
    for name in ("memory.png", "throughput.png"):
        assert (run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
        (["tune.search=grid"], ["tune.search", "layout"]),
        (["+topology=dp2", "tune.global_batch_size=15", "tune.memory_budget_mb=6"], ["tune.global_batch_size", "dp=2"]),
        (["tune.max_trials=0"], ["tune.max_trials"]),
        (["tune.steps=1"], ["tune.steps", "at least 2"]),
        (["tune.activation_checkpointing=[]"], ["tune.activation_checkpointing"]),
        (["+topology=pp2", "tune.num_microbatches=1", "tune.memory_budget_mb=6"], ["1f1b"]),
        (["+topology=dp2"], ["tune.memory_budget_mb", "required on CPU"]),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, args, words):
    proc = run_cli([*args, f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, timeout=120, module="rayhybrid.tune")
    assert_one_line_error(proc, *words)


def test_a_trial_is_limited_by_the_reserved_peaks_where_the_allocator_reports_them():
    from rayhybrid.tune.trials import limiting_peaks, out_of_memory

    cpu = [{"peak_mb": {"rank0/stage0/backward": 10.0}}, {"peak_mb": {"rank0/stage0/backward": 12.0}}]
    assert limiting_peaks(cpu) == {"rank0/stage0/backward": 12.0}
    cuda = [{"peak_mb": {"rank0/stage0/backward": 10.0}, "reserved_mb": {"rank0/stage0/backward": 14.0}}]
    assert limiting_peaks(cuda) == {"rank0/stage0/backward": 14.0}
    assert out_of_memory("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 16.00 GiB")
    assert out_of_memory("RuntimeError: CUDA out of memory.") and not out_of_memory("RuntimeError: NCCL timeout")
