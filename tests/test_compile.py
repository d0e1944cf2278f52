"""`train.compile`: each block compiled on its own by inductor (rayhybrid/parallel/compile.py)
trains to the eager losses, within 1e-5, with tensor parallelism, FSDP2 and activation
checkpointing (dp2_pp2_tp2, GPT), with Llama under tensor parallelism (tp2), and with the
zero-bubble V schedule, whose split backward keeps the compiled blocks' graphs (pp2 ZB-V); and
its artifacts land in the run's compile cache.

Compiling on two CPU cores is slow: tiny Llama (4 layers, d_model 64), 3 steps, each world's
eager and compiled runs in one set of rank processes, the cache in a fresh folder so every run
of the test compiles from nothing, as CI does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rayhybrid.config.schema import Config, DataConfig, ModelConfig, TopologyConfig, TrainConfig
from rayhybrid.preflight import load_config
from tests.distributed import offload_steps, run_configs, train_many

pytestmark = pytest.mark.slow  # several processes, inductor

STEPS = 3
LOSS_RTOL = 1e-5
LLAMA = load_config(["model=llama3_debug"]).model


def pair(model=LLAMA, ac: bool = False, **topology) -> dict[str, Config]:
    """The same run eager and compiled."""
    base = Config(
        model=model,
        data=DataConfig(seq_len=32),
        train=TrainConfig(
            steps=STEPS, global_batch_size=8, micro_batch_size=1, warmup_steps=2, activation_checkpointing=ac
        ),
        topology=TopologyConfig(**topology),
        seed=0,
    )
    return {"eager": base, "compiled": dataclasses.replace(base, train=dataclasses.replace(base.train, compile=True))}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh compile cache for the test's rank processes (they inherit the variable): what
    lands in it shows that the test's runs compiled."""
    root = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root))
    return root


TORCH = tuple(int(x) for x in torch.__version__.split(".")[:2])
CACHES = ("aotautograd", "fxgraph") if TORCH >= (2, 12) else ("fxgraph",)
"""The caches a compiled run fills: torch 2.11's AOTAutograd cache passes these graphs by."""


def assert_compiled(cache: Path, kinds=CACHES) -> None:
    """The AOTAutograd and FX graph caches, in rayhybrid's folder of the node's inductor cache:
    the compiled runs did compile (a block left eager would train to the same losses)."""
    for kind in kinds:
        folder = cache / "rayhybrid" / kind
        assert folder.is_dir() and any(folder.iterdir()), f"nothing compiled into {folder}"


def assert_same_losses(ranks: list[dict]) -> None:
    for rank, runs in enumerate(ranks):
        eager = [m["loss"] for m in runs["eager"]]
        compiled = [m["loss"] for m in runs["compiled"]]
        assert eager[-1] < eager[0], eager  # it trains
        assert compiled == pytest.approx(eager, rel=LOSS_RTOL), f"rank {rank}: {compiled} != {eager}"


def test_compiled_blocks_train_as_eager_under_dp2_pp2_tp2_fsdp2_ac(cache):
    cfgs = pair(ModelConfig(), dp=2, pp=2, tp=2, dp_shard=True, ac=True)  # GPT tiny
    assert_same_losses(run_configs(train_many, cfgs, STEPS, timeout=600))
    assert_compiled(cache)


def test_llama_compiled_blocks_train_as_eager_under_tp2(cache):
    # Its first block reads the token embedding's all-reduce, still lazily waited for (an
    # AsyncCollectiveTensor), which the compiled block must not take as it is (compile.Waited).
    cfgs = pair(tp=2)
    assert_same_losses(run_configs(train_many, cfgs, STEPS, timeout=600))
    assert_compiled(cache)


@pytest.mark.skipif(
    TORCH < (2, 13),
    reason="torch < 2.13 refuses compiled zero-bubble schedules (test_zero_bubble_schedules_compiled_need_torch_2_13)",
)
def test_compiled_blocks_train_as_eager_under_pp2_zbv(cache):
    cfgs = pair(pp=2, schedule="zbv", stages_per_rank=2)
    assert_same_losses(run_configs(train_many, cfgs, STEPS, timeout=600))
    assert_compiled(cache)


def test_compiled_blocks_offload_what_they_save_under_tp2(cache):
    """train.offload_activations composes with train.compile: the hooks wrap the compiled
    block, so what its graph saves (DTensor locals under tp2) goes to the host and comes back,
    and the losses are bit for bit the compiled ones without offload."""
    compiled = pair(tp=2)["compiled"]
    cfgs = {
        "compiled": compiled,
        "offload": dataclasses.replace(compiled, train=dataclasses.replace(compiled.train, offload_activations=True)),
    }
    for rank, runs in enumerate(run_configs(offload_steps, cfgs, STEPS, timeout=600)):
        assert runs["offload"]["losses"] == runs["compiled"]["losses"], rank
        ((moved,),) = [runs["offload"]["moved"]]
        assert len(moved) == LLAMA.n_layers and all(moved), moved
        assert runs["offload"]["returned"] == runs["offload"]["moved"]
    assert_compiled(cache)


FLOAT8_RTOL = 2e-3
"""Compiled float8 (emulated) against eager float8: not bit for bit, as compiled bfloat16 is
not, and float8's casts round each difference up to 2^-4 of a value; measured on torch 2.13 CPU
over 10 steps: 6.1e-4 (tp2), 3.3e-4 (dp2 FSDP2 with activation checkpointing)."""


def test_float8_blocks_compile_and_train_as_eager_float8_under_tp2(cache):
    """train.float8 composes with train.compile: the converted linears (torchao's float8 TP
    styles under tp2) are traced inside each compiled block."""
    cfgs = {
        name: dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, float8="emulate", dtype="bfloat16"))
        for name, cfg in pair(tp=2).items()
    }
    for rank, runs in enumerate(run_configs(train_many, cfgs, STEPS, timeout=600)):
        eager = [m["loss"] for m in runs["eager"]]
        compiled = [m["loss"] for m in runs["compiled"]]
        assert eager[-1] < eager[0], eager
        assert compiled == pytest.approx(eager, rel=FLOAT8_RTOL), f"rank {rank}: {compiled} != {eager}"
    # torch 2.13's AOTAutograd cache passes graphs with tensor subclasses (torchao's float8
    # tensors) by: only inductor's FX graph cache keeps their kernels.
    assert_compiled(cache, kinds=("fxgraph",))


def test_zero_bubble_schedules_compiled_need_torch_2_13(monkeypatch):
    """torch 2.11 and 2.12 cannot split a compiled block's backward (scripts/check_torch.sh found
    "_input_metadata is invalid" there): one line before anything is built, naming the fix."""
    from rayhybrid.errors import ConfigError
    from rayhybrid.parallel.compile import check_compile

    monkeypatch.setattr(torch, "__version__", "2.12.1+cu130")
    with pytest.raises(ConfigError, match=r"train\.compile: topology\.schedule=zbv .* torch 2\.12\.1"):
        check_compile(True, "zbv", 2)
    check_compile(True, "1f1b", 2)  # not split: runs
    check_compile(False, "zbv", 2)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    check_compile(True, "interleaved_zb", 2)


def test_a_cpu_without_the_compiler_inductor_would_use_is_refused_in_one_line(monkeypatch):
    """Inductor builds C++ with $CXX when it is set, else g++/clang++: a missing one is said at
    build time, naming the setting, not deep in the first step."""
    from rayhybrid.errors import ConfigError
    from rayhybrid.parallel.compile import check_compiler

    cpu = torch.device("cpu")
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(ConfigError, match=r"train\.compile: \$CXX=no-such-compiler-here is not found"):
        check_compiler(cpu)
    monkeypatch.delenv("CXX")
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ConfigError, match=r"train\.compile: inductor's CPU backend needs a C\+\+ compiler"):
        check_compiler(cpu)
    check_compiler(torch.device("meta"))  # not a CPU: nothing to build here
