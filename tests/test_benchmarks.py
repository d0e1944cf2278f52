"""benchmarks/ (not run here: they take minutes): the Lightning-style baseline search, the
checkpoint statistics, the report's sections from a results file, and run.py's argument errors;
the GPU benchmark's pieces on CPU (its loop, its sweep, its section from a tiny real run, and
its skip where there is no CUDA)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import batch_search
import checkpoints
import gpu
import report
from baselines import hf_loop


@pytest.mark.parametrize("largest", [1, 2, 3, 9, 16, 17, 100])
def test_lightning_binsearch_doubles_then_bisects(largest):
    tried = []

    def fits(m: int) -> bool:
        tried.append(m)
        return m <= largest

    assert batch_search.lightning_binsearch(fits, init=2) == largest
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
            "cases": {
                "peer heal": {"kill_to_next_step_s": 5.0, "healed": "peer", "steps_redone": 0, "bytes_sent": 7e5}
                | {"detect_s": 0.1},
                "checkpoint restore": {"kill_to_next_step_s": 6.0, "healed": "checkpoint", "steps_redone": 2},
            },
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
    assert "Ray Train takes 6.0x as long as a peer heal" in md
    assert "| rayhybrid, peer heal | 5.0 | peer, 0, 0.70 MB sent | detect 0.10 |" in md
    assert "| rayhybrid, checkpoint restore | 6.0 | checkpoint, 2 |  |" in md
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


def _step(k: int, t: float, time: float) -> dict:
    return {"step": k, "step_time_s": t, "time": time}


def test_checkpoint_stats_split_steps_by_upload_in_flight():
    # Async, a save every 4 of 12 steps: step 4's upload is committed after step 6 (steps 5, 6
    # ran alongside it); step 8's outlasts its interval and is reported after step 12's record.
    # The driver's clock: each record a step's time after the last, and 0.5 s, then 0.7 s more
    # after a save (the save call).
    records = [_step(k, 1.0, float(k)) for k in range(1, 5)]
    records += [_step(5, 3.0, 7.5), _step(6, 2.0, 9.5)]
    records += [{"event": "checkpoint", "step": 4, "blocked_s": 0.1, "upload_s": 2.5, "async": True}]
    records += [_step(7, 1.0, 10.5), _step(8, 1.0, 11.5)]
    records += [_step(9, 4.0, 16.2), _step(10, 2.0, 18.2), _step(11, 2.0, 20.2), _step(12, 2.0, 22.2)]
    records += [{"event": "checkpoint", "step": 8, "blocked_s": 0.3, "upload_s": 9.0, "async": True}]
    records += [{"event": "checkpoint_failed", "step": 12, "path": "s3://b/x", "error": "boom"}]
    stats = checkpoints.checkpoint_stats(records)
    assert stats["saves"] == 2 and stats["failed"] == ["step 12: boom"]
    assert stats["blocked_s"] == pytest.approx(0.2) and stats["upload_s"] == pytest.approx(5.75)
    assert stats["uploading_steps"] == 6  # 5, 6 and 9-12; steps 1, 2 are warm-up
    assert stats["uploading_s"] == 2.0 and stats["quiet_steps"] == 4 and stats["quiet_s"] == 1.0
    assert stats["slowdown"] == 2.0
    assert stats["after_save_s"] == 3.5  # steps 5 and 9
    assert stats["outlasted"] == 1
    assert stats["driver_pause_s"] == pytest.approx(0.6)

    # Sync: the event comes before the next step, so nothing ever runs alongside an upload.
    sync = [_step(k, 1.0, float(k)) for k in range(1, 5)]
    sync += [{"event": "checkpoint", "step": 4, "blocked_s": 2.0, "upload_s": 1.9, "async": False}]
    sync += [_step(5, 1.5, 7.5), _step(6, 1.0, 8.5)]
    stats = checkpoints.checkpoint_stats(sync)
    assert stats["uploading_steps"] == 0 and stats["uploading_s"] is None and stats["slowdown"] is None
    assert stats["quiet_steps"] == 4 and stats["after_save_s"] == 1.5 and stats["outlasted"] == 0
    assert stats["driver_pause_s"] == pytest.approx(2.0)  # 7.5 - 4 - 1.5, less a usual gap of 0


def _checkpoint_row(store: str, asynchronous: bool, **values) -> dict:
    row = {
        "model": "tiny",
        "params": 234624,
        "store": store,
        "async": asynchronous,
        "saves": 4,
        "failed": [],
        "blocked_s": 0.02 if asynchronous else 0.4,
        "upload_s": 0.6 if asynchronous else 0.4,
        "driver_pause_s": 0.03 if asynchronous else 0.41,
        "outlasted": 0,
        "after_save_s": 0.2 if asynchronous else 0.1,
        "uploading_steps": 6 if asynchronous else 0,
        "uploading_s": 0.25 if asynchronous else None,
        "quiet_steps": 12 if asynchronous else 18,
        "quiet_s": 0.1,
        "quiet_quartiles_s": [0.09, 0.1, 0.12],
        "slowdown": 2.5 if asynchronous else None,
        "train_s": 3.0 if asynchronous else 4.0,
        "load": [2.0, 3.5],
        "server_cpu_s": 1.5,
    }
    if asynchronous:
        row["blocked_vs_sync"] = 0.05
    return row | values


def test_report_checkpoints_section():
    meta = {"seconds": 300.0, "command": "python benchmarks/run.py --only checkpoints", "date": "d", "machine": "x"}
    rows = [
        _checkpoint_row("s3", True, failed=["step 8: boom"], outlasted=1),
        _checkpoint_row("s3", False),
    ]
    results = {
        "checkpoints": {
            **meta,
            "rows": rows,
            "models": {"tiny": {"overrides": [], "steps": 20, "every": 4}},
        }
    }
    md = report.markdown(results)
    assert "## 7. Checkpoints" in md
    assert "Command: `python benchmarks/run.py --only checkpoints` (d, x, 300.0 s)" in md
    assert "tiny: the defaults, 20 steps, a save every 4" in md
    assert (
        "| tiny (0.23M) | s3 | async | 4, 1 failed | 0.020 | 0.600 | 0.050 | 0.030 | 0.200 | 6: 0.250 | 12: 0.100 | 2.50x | 3.0 |"
        in md
    )
    assert "| tiny (0.23M) | s3 | sync | 4 | 0.400 | 0.400 |  | 0.410 | 0.100 | - | 18: 0.100 | - | 4.0 |" in md
    assert "Failed saves: tiny s3 async: step 8: boom." in md
    assert (
        "Uploads still running at the next save (which waited for them, inside its time blocked): tiny s3: 1 of 4" in md
    )
    assert "tiny s3 async 0.090/0.100/0.120, load 2.0 -> 3.5" in md
    assert "blocked training for 0.05 of the time a sync save did" in md
    assert "the step right after a sync save took 1.00x" in md
    assert "took 2.50x as long as steps without" in md and "took 1.50x as long as the same write" in md
    assert "tiny s3 0.75." in md and "tiny async 1.5 s" in md
    (line,) = report.table(results).splitlines()
    assert line.startswith("checkpoints") and "tiny s3 0.050" in line and "tiny s3 2.50x" in line
    json.dumps(results)

    failed = report.markdown({"checkpoints": {**meta, "error": "RuntimeError: no moto"}})
    assert "**Failed**: `RuntimeError: no moto`" in failed and "| model |" not in failed


def test_report_data_section():
    meta = {"seconds": 200.0, "command": "python benchmarks/run.py --only data", "date": "d", "machine": "x"}
    results = {
        "data": {
            **meta,
            "megabytes": 12,
            "steps": 12,
            "loop": {"documents": 100, "tokens": 3_000_000, "seconds": 2.0, "tokens_per_s": 1_500_000.0},
            "prepare": {"tokens": 3_000_000, "documents": 100, "shards": 6, "wall_s": 9.5, "tokens_per_s": 1_250_000.0},
            "prepare_vs_loop": 0.8333,
            "rows": [
                {"case": "read-ahead 2", "share": 0.004, "median_wait_ms": 0.4, "median_step_s": 0.35, "runs": 2},
                {"case": "read-ahead 0", "share": 0.05, "median_wait_ms": 17.0, "median_step_s": 0.37, "runs": 2},
            ],
        }
    }
    md = report.markdown(results)
    assert "## 8. Data" in md and "Command: `python benchmarks/run.py --only data` (d, x, 200.0 s)" in md
    assert "| plain loop | 3,000,000 | 2.0 | 1,500,000 | 1.00x |" in md
    assert "| prepare | 3,000,000 | 2.4 (wall 9.5) | 1,250,000 | 0.83x |" in md
    assert "| read-ahead 2 | 0.4% | 0.4 | 0.350 | 2 |" in md and "| read-ahead 0 | 5.0% |" in md
    (line,) = report.table(results).splitlines()
    assert line.startswith("data") and "0.83x" in line and "read-ahead 2 0.4%" in line
    failed = report.markdown({"data": {**meta, "error": "RuntimeError: no moto"}})
    assert "**Failed**: `RuntimeError: no moto`" in failed and "| plain loop |" not in failed


def test_a_rerun_keeps_the_figures_from_development_runs(tmp_path):
    """BENCHMARKS.md's hand-written section survives a rerun verbatim; the generated sections are
    rewritten from the results, as before."""
    kept = (
        "## Figures from development runs\n\n"
        "Measured by hand; not in results.json.\n\n"
        "**Quick start.** about 2-3 minutes on a 2-core machine.\n\n"
        "- a list item\n"
        "### a subsection of its own\n\n"
        "The end.\n"
    )
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(report.INTRO + "\n## 1. Scaling on this machine\n\nstale figures\n\n" + kept)
    results = _results()
    report.write(path, results)
    text = path.read_text()
    assert text == report.markdown(results) + kept
    assert text.count("## Figures from development runs") == 1 and "stale figures" not in text
    # A second rerun changes nothing; a file without the section gets none; a section followed
    # by another heading keeps only its own text.
    report.write(path, results)
    assert path.read_text() == text
    (tmp_path / "new.md").write_text(report.INTRO)
    report.write(tmp_path / "new.md", results)
    assert (tmp_path / "new.md").read_text() == report.markdown(results)
    assert report.kept_section("# B\n\n" + kept + "## 9. Later\n\nx\n") == kept


def test_losses_compares_per_step_losses_bit_for_bit(tmp_path, capsys):
    """benchmarks/losses.py (the before/after check of a refactoring): equal runs pass; one
    step's loss a single ulp apart fails, and so does a run only one side has."""
    import math

    from benchmarks import losses

    def write(root, loss):
        run = root / "outputs" / "2026-01-01" / "10-00-00"
        run.mkdir(parents=True)
        records = [{"kind": "step", "step": 1, "loss": 5.5}, {"kind": "step", "step": 2, "loss": loss}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    write(tmp_path / "a", 1.25)
    write(tmp_path / "b", 1.25)
    write(tmp_path / "c", math.nextafter(1.25, 2.0))
    assert losses.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert losses.main([str(tmp_path / "a"), str(tmp_path / "c")]) == 1
    assert "DIFFERENT" in capsys.readouterr().out
    (tmp_path / "b" / "extra").mkdir()
    (tmp_path / "b" / "extra" / "metrics.jsonl").write_text("")
    assert losses.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1


def _fake_points(fits_up_to: int, peak=lambda mb: 1000.0 + 100.0 * mb, error_at: int = 0):
    """A `measure` for hf_loop.sweep: sizes above `fits_up_to` run out of memory; each point
    takes 10 s of a fake clock."""
    tried, now = [], [0.0]

    def measure(mb):
        tried.append(mb)
        now[0] += 10.0
        if mb == error_at:
            return {"error": "RuntimeError: boom", "wall_s": 10.0}
        return {"oom": mb > fits_up_to, "wall_s": 10.0, "peak_mb": None if mb > fits_up_to else peak(mb)}

    return tried, measure, lambda: now[0]


def test_the_gpu_sweep_climbs_to_out_of_memory_halves_below_and_keeps_to_its_budget():
    tried, measure, clock = _fake_points(12)
    done = hf_loop.sweep([8, 12, 16], measure, clock=clock)
    assert tried == [8, 12, 16] and [d.get("oom") for d in done] == [False, False, True]
    tried, measure, clock = _fake_points(3)  # 8 does not fit: halves until one does, then stops
    hf_loop.sweep([8, 12, 16], measure, clock=clock)
    assert tried == [8, 4, 2]
    tried, measure, clock = _fake_points(0)
    assert [d["micro_batch"] for d in hf_loop.sweep([4, 8], measure, clock=clock)] == [4, 2, 1]
    tried, measure, clock = _fake_points(64)  # 8 fits, 12 would end past the budget
    done = hf_loop.sweep([8, 12, 16], measure, budget_s=15.0, clock=clock)
    assert tried == [8] and done[-1]["micro_batch"] == 12 and done[-1]["skipped"].startswith("time budget (15 s")
    tried, measure, clock = _fake_points(64)  # peaks 1800, 2200 MB at 8, 12: 16 would need 2600
    done = hf_loop.sweep([8, 12, 16], measure, capacity_mb=2500.0, clock=clock)
    assert tried == [8, 12] and done[-1] == {
        "micro_batch": 16,
        "skipped": "predicted out of memory (2,600 MB of 2,500)",
    }
    tried, measure, clock = _fake_points(64, error_at=12)  # a failure is not out of memory: no more sizes
    done = hf_loop.sweep([8, 12, 16], measure, clock=clock)
    assert tried == [8, 12] and done[-1]["error"] == "RuntimeError: boom"


def test_the_hf_loop_tells_out_of_memory_from_other_errors():
    import torch

    assert hf_loop.out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    try:  # torch.compile's errors wrap the one that ran out
        try:
            raise torch.OutOfMemoryError("Tried to allocate")
        except torch.OutOfMemoryError as err:
            raise RuntimeError("backend compiler failed") from err
    except RuntimeError as err:
        assert hf_loop.out_of_memory(err)
    assert not hf_loop.out_of_memory(RuntimeError("shape mismatch"))


def _hf_loop(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / "baselines" / "hf_loop.py"), *args],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(BENCH.parent), "OMP_NUM_THREADS": "1"},
        timeout=600,
    )


def test_the_hf_loop_trains_a_tiny_llama_on_cpu_and_prints_its_json():
    """benchmarks/baselines/hf_loop.py on CPU: LlamaForCausalLM of rayhybrid's llama3_debug shape,
    two micro-batch sizes, its JSON on the last line; a model it cannot build is refused in one line."""
    proc = _hf_loop(
        "model=llama3_debug", "data.seq_len=32", "train.dtype=bfloat16", "--micro-batches", "2,4", "--device", "cpu"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    from rayhybrid.models.registry import get_spec
    from rayhybrid.preflight import load_config

    cfg = load_config(["model=llama3_debug", "data.seq_len=32"])
    spec = get_spec(cfg.model)
    assert r["device"] == "cpu" and r["compile"] is False and r["dtype"] == "bfloat16" and r["seq_len"] == 32
    assert r["flops_per_token"] == spec.flops_per_token(cfg.model, 32)
    assert r["params"] == spec.num_params(cfg.model, 32)  # the same shape as rayhybrid's model
    assert [p["micro_batch"] for p in r["points"]] == [2, 4]
    for p in r["points"]:
        assert not p["oom"] and len(p["step_times_s"]) == r["warmup"] + 5 and p["peak_mb"] is None
        measured = p["step_times_s"][r["warmup"] :]
        assert p["tokens_per_s"] == pytest.approx(p["micro_batch"] * 32 * 5 / sum(measured), rel=1e-3)
    assert r["start_wall"] < r["imports_done_wall"] < r["built_wall"] < r["points"][0]["first_step_wall"]

    bad = _hf_loop("model=gpt_tiny", "--micro-batches", "2")
    assert bad.returncode == 2 and "pass a llama3 model" in bad.stderr and "Traceback" not in bad.stderr


def test_the_gpu_section_renders_from_a_real_tiny_cpu_run(tmp_path):
    """gpu.measure on CPU with a tiny Llama: the loop eager and compiled (torch.compile's eager
    backend, which compiles nothing: quick on CPU) and one rayhybrid run; the section shows their
    figures as measured, their ratio and MFU by the peak that metrics.peak_tflops gives. Then a
    rayhybrid sweep that runs out of memory."""
    card = {"name": "cpu (test)", "capability": [0, 0], "memory_mb": 1024.0, "torch": "cpu", "cuda": None}
    shape = ["model=llama3_debug", "data.seq_len=32", "train.dtype=bfloat16", "metrics.peak_tflops=0.001"]
    shape += ["cluster.use_gpu=false"]  # CPU also where there is a GPU
    runs = [
        ("loop, eager", ["--device", "cpu"]),
        ("loop, compiled", ["--device", "cpu", "--compile", "--compile-backend", "eager"]),
        ("rayhybrid", []),
    ]
    r = gpu.measure(tmp_path, card, shape, (2,), runs, budget_s=300, warmup=1, steps=2)
    r |= {"seconds": 30.0, "command": "pytest", "date": "d", "machine": "x"}
    assert [p["micro_batch"] for p in r["runs"]["rayhybrid"]["points"]] == [2], r["runs"]["rayhybrid"]
    ours, loop = gpu.best(r["runs"]["rayhybrid"]), gpu.best(r["runs"]["loop, compiled"])
    assert r["peak_tflops"] == 0.001  # rayhybrid's own rule: metrics.peak_tflops over its table
    md = gpu.section(r)
    assert md.startswith(gpu.HEADING) and "Card: **cpu (test)**" in md and "Command: `pytest` (d, x, 30.0 s)" in md
    ratio = ours["tokens_per_s"] / loop["tokens_per_s"]
    mfu = r["flops_per_token"] * ours["tokens_per_s"] / 1e9
    startup = ours["startup_s"] or ours["first_step_watched_s"]
    assert gpu.mfu(r, ours) == pytest.approx(mfu)
    row = f"| rayhybrid | 2 | {ours['tokens_per_s']:,.0f} | {ratio:.2f}x | {mfu:.1%} | {ours['peak_mb']:.1f} MB | {startup:.1f} |"
    assert row in md
    assert f"| loop, compiled (backend eager) | 2 | {loop['tokens_per_s']:,.0f} | 1.00x |" in md
    verdict = "met" if ratio >= 1.15 else "not met"
    assert f"tokens/s at least 1.15x the compiled loop's: **{ratio:.2f}x (rayhybrid)**, {verdict}" in md
    assert f"start-up at most 12 s: **{startup:.1f} s (`rayhybrid`)**" in md
    assert "- loop, eager (micro-batch 2): " in md and "process and imports" in md
    (line,) = report.table({"gpu": r}).splitlines()
    assert line.startswith("gpu") and f"rayhybrid / compiled loop {ratio:.2f}x" in line
    json.dumps(r)

    # Out of memory ends a rayhybrid run the sweep then halves: on CPU, tune.memory_budget_mb
    # plays a device just over what micro-batch 2 needed.
    budget = [f"tune.memory_budget_mb={ours['peak_mb'] * 1.05:.3f}"]
    swept = gpu.rayhybrid_sweep(tmp_path, "rayhybrid", shape + budget, (4,), 1, 2, 300.0, card)["points"]
    assert [(p["micro_batch"], p["oom"]) for p in swept] == [(4, True), (2, False)], swept
    assert swept[1]["peak_mb"] == ours["peak_mb"]
    r["runs"]["rayhybrid"]["points"] = swept
    assert "| rayhybrid | 4 |  |  |  | out of memory |" in gpu.section(r)


def test_without_cuda_run_py_skips_the_gpu_benchmark_and_keeps_its_section(tmp_path):
    """No CUDA (hidden here, as on this CPU machine): one line says so, results.json gains
    nothing and BENCHMARKS.md's GPU section stays as it was; a file without one says it is not
    yet measured, and recorded results write it."""
    measured = f"{gpu.HEADING}\n\nFigures of an earlier GPU run.\n\n"
    out, results = tmp_path / "BENCHMARKS.md", tmp_path / "results.json"
    out.write_text(report.INTRO + "\n" + measured + report.KEPT_HEADING + "\n\nby hand\n")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--only", "gpu", "--out", str(out), "--results", str(results)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    skipped = [line for line in proc.stdout.splitlines() if "skipped" in line]
    said = "gpu: skipped, no CUDA device here (torch.cuda.is_available() is false); BENCHMARKS.md keeps its section"
    assert skipped == [said + " as it was"]
    assert not results.exists()
    text = out.read_text()
    assert measured in text and text.count(gpu.HEADING) == 1 and text.endswith("by hand\n")
    assert "Not yet measured on a GPU" in report.markdown({})
    assert "Not yet measured" not in report.markdown({}, text)


def test_the_gpu_sections_largest_micro_batch_per_memory_setting_from_a_tiny_cpu_tune(tmp_path):
    """gpu.memory_sweep on CPU: one `python -m rayhybrid.tune` per memory setting (the chunked
    loss, whole logits, offload; a tiny Llama, tune.memory_budget_mb playing the card), the largest micro-batch it found, its
    memory trials, tokens/s there and the plan against the measured peak; the section renders them."""
    card = {"name": "cpu (test)", "capability": [0, 0], "memory_mb": 1024.0, "torch": "cpu", "cuda": None}
    shape = ["model=llama3_debug", "data.seq_len=32", "train.dtype=bfloat16", "cluster.use_gpu=false"]
    settings = gpu.MEMORY_SETTINGS
    assert [o for _, o in settings] == [[], ["train.loss_chunk=0"], ["train.offload_activations=true"]]
    m = gpu.memory_sweep(tmp_path, card, shape, settings, budget_s=600, extra=["tune.memory_budget_mb=40"])
    for label, _ in settings:
        s = m["settings"][label]
        assert s.get("largest"), s
        assert 1 <= s["memory_trials"] <= 4 and s["tokens_per_s"] > 0
        assert s["peak_mb"] <= 40 and s["allocated_mb"] == s["peak_mb"]  # CPU: no allocator
        assert abs(s["planned_mb"] / s["peak_mb"] - 1) < 0.03 and s["planned_reserved_mb"] is None
    r = {"seconds": 1.0, "command": "pytest", "date": "d", "machine": "x", "card": card, "runs": {}}
    r |= {"flops_per_token": 1.0, "peak_tflops": None, "warmup": 1, "steps": 2, "memory": m}
    md = gpu.section(r)
    s = m["settings"][settings[0][0]]
    assert f"| {settings[0][0]} | {s['largest']} | {s['memory_trials']} (" in md
    assert f"{s['planned_mb']:,.0f} / {s['peak_mb']:,.0f} (" in md
    assert "without activation checkpointing with the chunked loss: **" in md
    skipped = gpu.memory_sweep(tmp_path, card, shape, [("late", [])], budget_s=0)["settings"]["late"]
    assert skipped["error"].startswith("not run")
