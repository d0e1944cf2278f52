"""train.float8 (rayhybrid/parallel/float8.py): the blocks' linears in float8 with torchao's recipe.

This machine has no float8 GPU, so the runs use `train.float8=emulate` (torchao's emulation: the
same float8 casts and scales, the matmuls in float32 from the float8 values) and hold its losses
to bfloat16's over 50 steps, on one rank and composed with tp2 (torchao's float8 TP styles),
FSDP2 and activation checkpointing. The refusals are one line each.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from rayhybrid.config.schema import Config, DataConfig, ModelConfig, TopologyConfig, TrainConfig
from rayhybrid.config.validate import check
from rayhybrid.errors import ConfigError
from rayhybrid.models.llama3.parallelize import tp_plan
from rayhybrid.models.registry import get_spec
from rayhybrid.parallel.float8 import PIP, check_float8, convert_blocks, is_float8
from rayhybrid.preflight import load_config
from tests.distributed import run_configs, train_many

STEPS = 50
LOSS_RTOL = 5e-3
"""Per-step loss of a float8 (emulated) run vs the same run in bfloat16, relative, over 50
steps of the tiny GPT (loss 5.55 -> 3.26). float8 e4m3 keeps 3 mantissa bits (bfloat16: 7), so
every cast of an input, weight or gradient rounds by up to 2^-4 of its value; the rounding
averages out over each dot product, and the runs drift apart slowly. Measured (torch 2.13 CPU,
torchao 0.18): one rank 1.08e-3, tp2 1.22e-3, dp2 FSDP2 1.06e-3 (float32 vs bfloat16 itself:
1.4e-4). 5e-3 leaves room for other CPUs' kernels and is about a third of the loss's average
fall per step here (0.047). The runs must also differ: float8 was on."""

BASE = Config(
    model=ModelConfig(n_layers=2),
    data=DataConfig(seq_len=32),
    train=TrainConfig(steps=STEPS, global_batch_size=8, micro_batch_size=2, warmup_steps=5, dtype="bfloat16"),
    seed=0,
)


def run(float8: str, ac: bool = False, **topology) -> Config:
    train = dataclasses.replace(BASE.train, float8=float8, activation_checkpointing=ac)
    return dataclasses.replace(BASE, topology=TopologyConfig(**topology), train=train)


def assert_close_to_bf16(runs: list[dict], reference: list[dict]) -> None:
    losses = [m["loss"] for m in runs]
    ref = [m["loss"] for m in reference]
    assert len(losses) == STEPS and ref[-1] < ref[0] - 2  # the reference learned
    worst = max(abs(a - b) / b for a, b in zip(losses, ref, strict=True))
    assert 0 < worst <= LOSS_RTOL, f"largest relative difference from bfloat16: {worst:.2e}"


def test_float8_settings_are_checked():
    with pytest.raises(ConfigError, match=r"train\.float8: unknown value 'maybe'"):
        check(load_config(["train.float8=maybe"]))
    with pytest.raises(ConfigError, match=r"train\.float8: .*set train\.dtype=bfloat16"):
        check(load_config(["train.float8=true"]))
    cfg = load_config(["train.float8=true", "train.dtype=bfloat16"])  # `true` arrives as a bool
    check(cfg)
    assert str(cfg.train.float8).lower() == "true"
    check(load_config(["train.float8=emulate", "train.dtype=bfloat16"]))


@pytest.mark.parametrize("model, tp, left", [("gpt_tiny", 1, set()), ("llama3_debug", 2, {"w1", "w2", "w3"})])
def test_the_blocks_linears_are_converted_and_the_output_head_is_not(model, tp, left):
    """Every linear of the blocks whose sizes split over tp into multiples of 16 (Llama's
    feed-forward, 176 wide, is 88 per rank at tp2: left in bfloat16); never the output head.
    The parameters keep their names and values (checkpoints do not change)."""
    cfg = load_config([f"model={model}", "train.float8=emulate", "train.dtype=bfloat16"])
    spec = get_spec(cfg.model)
    stage = spec.build_stage(cfg.model, seq_len=32, layer_ids=range(cfg.model.n_layers), first=True, last=True)
    stage.init_weights(0)
    before = {name: p.detach().clone() for name, p in stage.named_parameters()}
    convert_blocks(stage, cfg.train.float8, tp=tp)
    linears = {name: m for name, m in stage.named_modules() if isinstance(m, nn.Linear)}
    float8 = {name for name, m in linears.items() if is_float8(m)}
    assert float8 == {n for n in linears if n.startswith("layers.") and n.rsplit(".", 1)[1] not in left}
    assert "output" in linears and "output" not in float8
    after = dict(stage.named_parameters())
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], value) for name, value in before.items())


def test_the_tp_plans_take_torchaos_float8_styles_for_float8_layers_only():
    """Llama at tp2: attention's linears are float8 (torchao's styles, q/k/v's input cast once),
    the feed-forward's are not (88 per rank): torch's own styles."""
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    cfg = load_config(["model=llama3_debug", "train.float8=emulate", "train.dtype=bfloat16"])
    stage = get_spec(cfg.model).build_stage(cfg.model, seq_len=32, layer_ids=range(1), first=True, last=True)
    convert_blocks(stage, cfg.train.float8, tp=2)
    plan = tp_plan(stage, loss_parallel=False)
    p = "layers.0."
    assert type(plan[p + "attention"]) is PrepareFloat8ModuleInput
    assert type(plan[p + "attention.wq"]) is Float8ColwiseParallel
    assert type(plan[p + "attention.wo"]) is Float8RowwiseParallel
    assert type(plan[p + "feed_forward"]) is PrepareModuleInput
    assert type(plan[p + "feed_forward.w1"]) is ColwiseParallel
    assert type(plan[p + "feed_forward.w2"]) is RowwiseParallel
    assert type(plan["output"]) is ColwiseParallel


def test_false_converts_nothing():
    cfg = load_config([])
    stage = get_spec(cfg.model).build_stage(cfg.model, seq_len=32, layer_ids=range(2), first=True, last=True)
    convert_blocks(stage, False, tp=1)  # the command line's `false` arrives as a bool
    assert not any(is_float8(m) for m in stage.modules())


def test_without_torchao_one_line_names_the_setting_and_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # find_spec: not installed
    with pytest.raises(ConfigError) as err:
        check_float8("emulate", torch.device("cpu"))
    message = str(err.value)
    assert message.startswith("train.float8: ") and "\n" not in message
    assert PIP in message and "pip install 'rayhybrid[float8]'" in message


def test_a_device_without_float8_is_refused_and_emulate_is_not():
    with pytest.raises(ConfigError) as err:
        check_float8(True, torch.device("cpu"))
    message = str(err.value)
    assert message.startswith("train.float8: device cpu has no float8 matmuls") and "\n" not in message
    assert "train.float8=emulate" in message and "train.float8=false" in message
    check_float8("emulate", torch.device("cpu"))
    check_float8("false", torch.device("cpu"))


def env_with_this_checkout() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH", "")])))
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.mark.slow
def test_torchao_import_warnings_stay_off_the_terminal():
    """torchao's import logs warnings (its CUDA kernels on a CPU torch, torch's pytree Enum
    deprecation): they go to rayhybrid's log at debug, and nothing reaches stderr."""
    code = (
        "import torch; from rayhybrid.parallel.float8 import check_float8; "
        "check_float8('emulate', torch.device('cpu')); import torchao; print('imported')"
    )
    env = env_with_this_checkout()
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "imported"
    assert proc.stderr == ""


@pytest.mark.slow
def test_float8_on_a_cpu_run_exits_2_with_one_line(tmp_path):
    """The refusal comes from the rank that knows its device (a CPU here), crosses Ray as a
    ConfigError and ends the run with exit code 2 and one line; torchao's import warnings on
    the rank stay off the terminal."""
    args = ["train.float8=true", "train.dtype=bfloat16", "train.steps=1", f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.run(
        [sys.executable, "-m", "rayhybrid", *args],
        cwd=tmp_path,
        env=env_with_this_checkout(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "train.float8: device cpu has no float8 matmuls" in lines[0] and "train.float8=emulate" in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr and "torchao" not in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def world1_runs() -> dict[str, list[dict]]:
    (ranks,) = run_configs(train_many, {"bf16": run("false"), "float8": run("emulate")}, STEPS)
    return ranks


@pytest.mark.slow
def test_float8_losses_stay_close_to_bfloat16_over_50_steps(world1_runs):
    assert_close_to_bf16(world1_runs["float8"], world1_runs["bf16"])


@pytest.mark.slow
def test_float8_composes_with_tp2_fsdp2_and_activation_checkpointing(world1_runs):
    """tp2 (torchao's float8 column- and row-wise styles, q/k/v's input cast once), and dp2
    sharded by FSDP2 (the float32 weights all-gathered, then cast to float8) with activation
    checkpointing: each within the tolerance of the one-rank bfloat16 run, on every rank."""
    cfgs = {"tp2": run("emulate", tp=2), "dp2_shard_ac": run("emulate", ac=True, dp=2, dp_shard=True)}
    ranks = run_configs(train_many, cfgs, STEPS)
    for label in cfgs:
        for rank in ranks:
            assert_close_to_bf16(rank[label], world1_runs["bf16"])


def test_true_pads_the_inner_dimension_and_emulate_keeps_the_numerics_unpadded():
    """On a GPU the weight gradient's float8 matmul runs over the tokens (micro-batch x
    seq_len), which it needs in multiples of 16: `true` pads, so data.seq_len=1000 trains;
    `emulate` has no such matmul and is left as torchao makes it."""
    cfg = load_config(["model=gpt_tiny", "train.dtype=bfloat16"])
    for mode, padded in (("true", True), ("emulate", False)):
        stage = get_spec(cfg.model).build_stage(cfg.model, seq_len=32, layer_ids=range(1), first=True, last=True)
        convert_blocks(stage, mode, tp=1)
        configs = [m.config for m in stage.modules() if is_float8(m)]
        assert configs and all(c.pad_inner_dim is padded and c.emulate is (mode == "emulate") for c in configs)
