"""Llama 3 specifics: a tied output (`model.options.tie_embeddings=true`) trains with the same losses
under tensor parallelism and FSDP as on one rank, and stays one tensor through a checkpoint
and a resume under another topology; and the config errors a Llama shape can cause.

The Llama debug preset also runs in the shared parity, checkpoint, recovery and elastic tests
(labels and ids `llama3`)."""

from __future__ import annotations

import pytest

from rayhybrid.config.schema import Config, DataConfig, TrainConfig
from rayhybrid.errors import ConfigError
from rayhybrid.models.registry import settings_of
from rayhybrid.preflight import load_config
from tests.distributed import replace_topology, run_ranks, train_save_resume
from tests.test_cli import assert_one_line_error, run_cli

BEFORE, AFTER = 3, 3
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4
TIED_PAIR = [("output.weight", "tok_embeddings.weight")]


def tied_config() -> Config:
    model = load_config(["model=llama3_debug", "model.options.tie_embeddings=true"]).model
    return Config(
        model=model,
        data=DataConfig(seq_len=32),
        train=TrainConfig(steps=10, global_batch_size=8, micro_batch_size=1, warmup_steps=2, dtype="float32"),
        seed=0,
    )


# -- a tied output under tp2 and FSDP, through a checkpoint --------------------------------------


@pytest.fixture(scope="module")
def tied_one_rank(tmp_path_factory) -> dict:
    """dp1: 6 steps (a checkpoint after 3), then a resume from it: the reference."""
    root = tmp_path_factory.mktemp("tied_dp1")
    cfg = tied_config()
    (out,) = run_ranks(train_save_resume, 1, {"dp1": cfg}, "dp1", str(root), BEFORE, AFTER, {"dp1": cfg})
    return out


@pytest.fixture(scope="module")
def tied_two_ranks(tmp_path_factory) -> dict:
    """tp2 and dp2 with FSDP from scratch (tp2 saves after 3 steps); then tp2's checkpoint
    resumed under FSDP and under tp2."""
    root = tmp_path_factory.mktemp("tied_tp2")
    cfg = tied_config()
    runs = {"tp2": replace_topology(cfg, tp=2), "dp2_shard": replace_topology(cfg, dp=2, dp_shard=True)}
    ranks = run_ranks(train_save_resume, 2, runs, "tp2", str(root), BEFORE, AFTER, runs, timeout=600)
    return {"ranks": ranks, "cfgs": runs}


@pytest.mark.slow
def test_tied_output_trains_the_same_under_tp2_and_fsdp(tied_one_rank, tied_two_ranks):
    reference = tied_one_rank["fresh"]["dp1"]
    ref_loss = [m["loss"] for m in reference]
    assert ref_loss[-1] < ref_loss[0] - 0.1, ref_loss  # it learns
    for rank, out in enumerate(tied_two_ranks["ranks"]):
        for label, cfg in tied_two_ranks["cfgs"].items():
            metrics = out["fresh"][label]
            assert [(m["dp"], m["tp"]) for m in metrics] == [(cfg.topology.dp, cfg.topology.tp)] * (BEFORE + AFTER)
            assert [m["loss"] for m in metrics] == pytest.approx(ref_loss, rel=LOSS_RTOL), (rank, label)
            norms, ref_norms = [m["grad_norm"] for m in metrics], [m["grad_norm"] for m in reference]
            assert norms == pytest.approx(ref_norms, rel=GRAD_NORM_RTOL), (rank, label)


@pytest.mark.slow
def test_tied_output_stays_one_tensor_through_a_resume(tied_one_rank, tied_two_ranks):
    """Resumed under dp1, FSDP (from tp2's checkpoint) and tp2: the output is the embedding's
    own parameter again, and the losses go on as if uninterrupted."""
    ref_after = [m["loss"] for m in tied_one_rank["fresh"]["dp1"]][BEFORE:]
    resumed = {"dp1": [tied_one_rank["resumed"]["dp1"]]}
    for out in tied_two_ranks["ranks"]:
        for label, run in out["resumed"].items():
            resumed.setdefault(label, []).append(run)
    assert sorted(resumed) == ["dp1", "dp2_shard", "tp2"]
    for label, runs in resumed.items():
        for rank, run in enumerate(runs):
            assert run["shared"] == TIED_PAIR, (label, rank, run["shared"])
            assert run["start"] == BEFORE and run["consumed"] == [(BEFORE + i + 1) * 8 for i in range(AFTER)]
            assert run["losses"] == pytest.approx(ref_after, rel=LOSS_RTOL), (label, rank)


# -- config errors ---------------------------------------------------------------------------


def config_error(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(list(overrides))
    assert "\n" not in str(info.value)
    return info.value


@pytest.mark.slow
def test_tp_that_does_not_divide_the_kv_heads_exits_2(tmp_path):
    proc = run_cli(["model=llama3_debug", "topology.tp=4", f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, timeout=60)
    line = assert_one_line_error(proc, "topology.tp", "n_kv_heads=2")
    assert "tp=4" in line
    assert not (tmp_path / "run").exists(), "validation must fail before a run directory is made"


def test_kv_heads_must_divide_the_heads():
    err = config_error("model=llama3_debug", "model.options.n_kv_heads=3")
    assert err.setting == "model.options.n_kv_heads" and "model.n_heads=4" in err.message


def test_gpt_refuses_kv_heads():
    err = config_error("model.name=gpt", "model.options.n_kv_heads=2")
    assert err.setting == "model.options.n_kv_heads" and "gpt" in err.message


def test_tied_output_is_accepted_with_pipelines():
    """Once refused; the last stage now holds a copy (tests/test_tied_pipeline.py)."""
    for overrides in (["+topology=dp2_pp2_tp2"], ["topology.pp=4"], ["+topology=dp2_tp2", "topology.dp_shard=true"]):
        model = load_config(["model=llama3_debug", "model.options.tie_embeddings=true", *overrides]).model
        assert settings_of(model).tie_embeddings


def test_unknown_model_name_lists_the_builtins():
    err = config_error("model.name=foo")
    assert err.setting == "model.name" and "'foo'" in err.message
    assert "gpt" in err.message and "llama3" in err.message


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=llama3_debug", "+model.options.rope_scaling.bad=1.0"],  # no factor either
        ["model=llama3_debug", "+model.options.rope_scaling={factor:8.0,bad:1.0}"],
        ["model=llama3.1_8b", "model.options.rope_scaling.low_freq=1.0"],  # a misspelt key next to good ones
    ],
)
def test_rope_scaling_with_an_unknown_key(overrides):
    err = config_error(*overrides)
    assert err.setting == "model.options.rope_scaling" and "low_freq_factor" in err.message
    good = (
        "+model.options.rope_scaling="
        "{factor:8.0,low_freq_factor:1.0,high_freq_factor:4.0,original_max_position_embeddings:8192}"
    )
    assert settings_of(load_config(["model=llama3_debug", good]).model).rope_scaling["factor"] == 8.0
