"""What a run shows of itself: FLOP/s and MFU, the measured pipeline bubble, peak memory per
stage, trace.json (a Chrome trace of real spans per rank), TensorBoard event files, loss.png."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import rayhybrid
from rayhybrid.driver.observe import device_peak_tflops
from rayhybrid.models.gpt.model import num_params
from rayhybrid.preflight import load_config

pytestmark = pytest.mark.slow  # Ray or several processes; see the quick tier in README.md

PEAK = 0.001  # TFLOP/s per device, given by hand (a CPU has no entry in the table)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("observe") / "run"
    summary = rayhybrid.train(
        [
            "+topology=pp2",
            "train.steps=4",
            "train.log_every=1",
            "checkpoint.every=0",
            "metrics.memory=true",
            "metrics.trace_steps=[2,3]",
            "metrics.tensorboard=true",
            f"metrics.peak_tflops={PEAK}",
        ],
        run_dir=run_dir,
    )
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, run_dir, [s for s in steps if "event" not in s]


def test_flops_mfu_bubble_and_memory_per_step(run):
    summary, _, steps = run
    cfg = load_config([])
    m, s = cfg.model, cfg.data.seq_len
    per_token = 6 * num_params(m, s) + 12 * m.n_layers * s * m.attn_dim
    assert summary["flops_per_token"] == per_token
    for step in steps:
        assert step["tflops"] == pytest.approx(per_token * step["tokens_per_s"] / 1e12, rel=1e-9)
        assert step["mfu"] == pytest.approx(step["tflops"] / (PEAK * 2), rel=1e-9)
        # Two stages, 4 micro-batches of 4: 1F1B's theory is (pp-1)/(m+pp-1) = 0.2; measured
        # on two busy cores it is noisier, but a rank always waits for its neighbour somewhere.
        assert 0.0 < step["bubble"] < 0.9
        assert set(step["peak_mb"]) == {
            f"rank{r}/stage{r}/{p}" for r in (0, 1) for p in ("forward", "backward", "optimizer")
        }
    assert set(summary["peak_mb_by_stage"]) == {"stage0", "stage1"}
    for stage in ("stage0", "stage1"):  # the bytes kept for backward, within the stage's peak
        assert 0 < summary["activation_mb_by_stage"][stage] < summary["peak_mb_by_stage"][stage]
    assert summary["mfu"] == pytest.approx(sum(x["mfu"] for x in steps[1:]) / 3, rel=1e-4)
    assert 0 < summary["mean_bubble"] < 0.9


def test_trace_has_a_track_per_rank_with_the_pipeline_schedule(run):
    summary, run_dir, _ = run
    trace = json.loads((run_dir / "trace.json").read_text())
    assert summary["trace"] == str(run_dir / "trace.json")
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0 (dp 0, pp 0, tp 0)", 1: "rank 1 (dp 0, pp 1, tp 0)"}
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 for e in spans)
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        # Two traced steps, four micro-batches each: a forward and a backward chunk for each.
        assert sorted(e["name"] for e in mine if e["cat"] == "forward") == sorted([f"F{i}" for i in range(4)] * 2)
        assert sorted(e["name"] for e in mine if e["cat"] == "backward") == sorted([f"B{i}" for i in range(4)] * 2)
        assert sum(e["cat"] == "optimizer" for e in mine) == 2
        assert any(e["cat"] == "comm" and e["tid"] == 1 for e in mine)

    # Real timings show the schedule: stage 1 runs a micro-batch's forward after stage 0 sent it,
    # and stage 0 runs its backward after stage 1 sent the gradient.
    def first(rank, name):
        return min((e for e in spans if e["pid"] == rank and e["name"] == name), key=lambda e: e["ts"])

    assert first(1, "F0")["ts"] >= first(0, "F0")["ts"] + first(0, "F0")["dur"]
    assert first(0, "B0")["ts"] >= first(1, "B0")["ts"] + first(1, "B0")["dur"]


def _scalars(event_dir: Path, tag: str) -> dict[int, float]:
    """A tag's scalars by step, from the TensorBoard event files in `event_dir`."""
    from test_tracking import tensorboard_points

    return dict(tensorboard_points(event_dir).get(tag, []))


def test_tensorboard_and_loss_plot(run):
    summary, run_dir, steps = run
    losses = _scalars(run_dir / "tensorboard", "train/loss")
    assert losses == {s["step"]: pytest.approx(s["loss"], rel=1e-6) for s in steps}
    assert set(_scalars(run_dir / "tensorboard", "train/mfu")) == {1, 2, 3, 4}
    assert summary["tensorboard"] == str(run_dir / "tensorboard")
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["loss_plot"] == str(run_dir / "loss.png")


def test_peak_table():
    cfg = load_config(["train.dtype=bfloat16"])
    assert device_peak_tflops(cfg, "NVIDIA H100 80GB HBM3") == 989.0
    assert device_peak_tflops(cfg, "NVIDIA H100 PCIe") == 756.0
    assert device_peak_tflops(load_config([]), "NVIDIA A100-SXM4-80GB") == 19.5  # float32
    assert device_peak_tflops(cfg, "cpu") is None
    assert device_peak_tflops(load_config(["metrics.peak_tflops=5"]), "cpu") == 5
