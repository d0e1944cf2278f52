"""The CPU memory accounting (`metrics.memory`, rayhybrid/trainer/memory_meter.py) against analytic
values on the tiny model, the per-stage and per-phase peaks of a pipeline, and the budget that
plays a device's capacity."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distributed import forward_memory, heal_memory, replace_topology, run_configs, train_many

from rayhybrid.models.gpt.model import num_params
from rayhybrid.plan.estimate import block_bytes, head_bytes, saved_bytes_per_sample  # the hand counts
from rayhybrid.preflight import load_config

FLOAT = 4  # bytes of a float32


def _cfg(*overrides: str):
    return load_config(["metrics.memory=true", *overrides])


def test_parameters_gradients_optimizer_state_and_activations_match_the_analytic_count():
    cfgs = {mb: _cfg(f"train.global_batch_size={mb}", f"train.micro_batch_size={mb}") for mb in (1, 2, 3)}
    plain = load_config(["train.global_batch_size=2", "train.micro_batch_size=2"])
    results = run_configs(forward_memory, cfgs)[0]
    (losses_untracked,) = [[m["loss"] for m in steps] for steps in run_configs(train_many, {"x": plain}, 2)[0].values()]

    cfg = cfgs[1]
    params = num_params(cfg.model, cfg.data.seq_len)
    n_tensors = 4 + cfg.model.n_layers * 10 + 1  # embeddings 2, per block 10, final norm 2, output 1
    per_sample = saved_bytes_per_sample(cfg)
    for mb, r in results.items():
        cats = r["categories"]
        assert cats["Parameter"] == FLOAT * params
        assert cats["Gradient"] == FLOAT * params  # last step's, until the next zero_grad
        # AdamW: exp_avg and exp_avg_sq per parameter, plus one float32 step count per tensor.
        assert cats["Optstate"] == 2 * FLOAT * params + FLOAT * n_tensors
        # Saved activations: the hand count per sample, plus about 1 KiB that does not grow with
        # the batch (the position ids, the loss, the loss's total weight, index copies).
        fixed = cats["Activation"] - mb * per_sample
        assert 0 <= fixed < 1100, (mb, cats["Activation"], per_sample)
        assert r["live_after"] - r["live_before"] <= cats["Activation"]  # the forward made them
    assert results[3]["categories"]["Activation"] - results[2]["categories"]["Activation"] == per_sample
    # Counting does not change the arithmetic.
    assert results[2]["losses"] == losses_untracked


def test_pipeline_peaks_per_stage_and_phase_and_micro_batches_in_flight():
    """pp2, 4 micro-batches: GPipe keeps all four micro-batches' activations at its forward peak,
    1F1B at most pp - stage of them (2 on stage 0, 1 on stage 1)."""
    base = _cfg("+topology=pp2", "train.global_batch_size=4", "train.micro_batch_size=1")
    cfgs = {}
    for schedule in ("gpipe", "1f1b"):
        for mb in (1, 2):
            cfg = replace_topology(base, schedule=schedule)
            cfgs[(schedule, mb)] = dataclasses.replace(
                cfg, train=dataclasses.replace(cfg.train, micro_batch_size=mb, global_batch_size=4 * mb)
            )
    ranks = run_configs(train_many, cfgs, 2)
    layers = base.model.n_layers // 2
    # What one micro-batch sample holds from its forward to its backward on each stage: its
    # blocks' saved activations, and on stage 0 the output the stage keeps for its backward, on
    # stage 1 the head's.
    held = {
        0: layers * block_bytes(base) + FLOAT * base.data.seq_len * base.model.d_model,
        1: layers * block_bytes(base) + head_bytes(base),
    }
    for rank, stage in ((0, 0), (1, 1)):
        runs = ranks[rank]
        keys = {f"stage{stage}/{phase}" for phase in ("forward", "backward", "optimizer")}
        for steps in runs.values():
            assert set(steps[-1]["peak_mb"]) == keys
        peak = {k: steps[-1]["peak_mb"][f"stage{stage}/forward"] * 2**20 for k, steps in runs.items()}
        slope = {s: peak[(s, 2)] - peak[(s, 1)] for s in ("gpipe", "1f1b")}
        # Per sample of micro-batch, GPipe holds 4 micro-batches at its forward peak, 1F1B
        # 2 - stage of them: the difference is what the others hold, by the hand count (within
        # 6%: transient buffers differ a little between the schedules).
        expected = (4 - (2 - stage)) * held[stage]
        assert abs(slope["gpipe"] - slope["1f1b"] - expected) < 0.06 * expected, (stage, slope, expected)
        # The optimizer step holds no activations. What grows with the micro-batch there is what
        # the schedule keeps from step to step: a receive buffer per micro-batch (activations
        # on stage 1, gradients on stage 0; s x d each) and, on the last stage, every
        # micro-batch's output (the logits, s x V), which torch's schedules keep to merge.
        m = base.model
        kept = 4 * FLOAT * base.data.seq_len * (m.d_model + (m.vocab_size if stage == 1 else 0))
        for s in ("gpipe", "1f1b"):
            small, large = (runs[(s, mb)][-1]["peak_mb"][f"stage{stage}/optimizer"] * 2**20 for mb in (1, 2))
            assert abs(large - small - kept) <= 16, (s, stage, small, large)  # to a scalar or two


def test_a_budget_plays_the_device_capacity(tmp_path):
    """Over `tune.memory_budget_mb` the operator that crosses it raises torch's out-of-memory
    error, as a GPU would."""
    cfg = _cfg("train.global_batch_size=2", "train.micro_batch_size=2", "tune.memory_budget_mb=3")
    with pytest.raises(Exception) as info:
        run_configs(train_many, {"over": cfg}, 1)
    assert "OutOfMemoryError" in str(info.value) and "tune.memory_budget_mb=3" in str(info.value)


def test_out_of_memory_is_found_behind_a_pipeline_wrapper():
    from rayhybrid.cluster.guard import out_of_memory

    oom = torch.OutOfMemoryError("4.2 MB of tensors would exceed tune.memory_budget_mb=4")
    try:
        try:
            raise oom
        except torch.OutOfMemoryError as err:
            raise RuntimeError("Failed to run stage backward:\nStage output: ...") from err
    except RuntimeError as wrapped:
        assert out_of_memory(wrapped) is oom
    assert out_of_memory(RuntimeError("Connection closed by peer")) is None


def test_receiving_a_peer_heal_holds_no_second_copy_of_the_state():
    """A replacement rank receives its model and optimizer shards from a data-parallel peer
    straight into its own tensors (rayhybrid/trainer/heal.py): the receive's peak, measured by
    the memory meter, is at most 10% over a steady training step's, and the state arrives."""
    cfg = _cfg("+topology=dp2", "train.global_batch_size=2", "train.micro_batch_size=1")
    sender, receiver = run_configs(heal_memory, {"dp2": cfg}, 3)
    steady, healed = receiver["steady_mb"], receiver["heal_mb"]
    assert healed <= 1.10 * steady, f"receiving a heal peaked at {healed:.2f} MB against {steady:.2f} MB a step"
    assert receiver["step"] == 3
    assert all(torch.equal(receiver["state"][k], v) for k, v in sender["state"].items())


def test_on_cuda_the_meter_reports_the_allocators_reserved_peaks_beside_the_allocated(monkeypatch):
    """The CUDA path of MemoryMeter, with torch.cuda's statistics played by a fake allocator
    (no GPU here): each phase's allocated and reserved peaks, reset when a phase starts."""
    from rayhybrid.trainer.memory_meter import MB, MemoryMeter

    stats = {"allocated": 0, "reserved": 0}
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda device=None: stats.update(allocated=0, reserved=0)
    )
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: stats["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: stats["reserved"])
    meter = MemoryMeter(torch.device("cuda", 0), [], [])
    with meter.step():
        meter.phase(0, "forward")
        stats.update(allocated=10 * MB, reserved=12 * MB)
        meter.phase(0, "backward")
        stats.update(allocated=30 * MB, reserved=50 * MB)
    assert meter.peaks_mb() == {"stage0/backward": 30.0, "stage0/forward": 10.0}
    assert meter.reserved_mb() == {"stage0/backward": 50.0, "stage0/forward": 12.0}
    assert meter.step_metrics()["reserved_mb"] == meter.reserved_mb()  # the step record's figures
    cpu = MemoryMeter(torch.device("cpu"), [], [])
    assert cpu.reserved_mb() == {} and "reserved_mb" not in cpu.step_metrics()
