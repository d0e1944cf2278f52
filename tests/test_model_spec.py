"""The model registry and spec: model.name picks a built-in model, nothing outside
rayhybrid/models names one, checkpoints record the model and refuse another."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from rayhybrid.errors import ConfigError
from rayhybrid.models.registry import BUILTIN, get_spec
from rayhybrid.models.spec import ModelSpec
from rayhybrid.preflight import load_config
from rayhybrid.storage.checkpoints import Checkpoint, check_fits

ROOT = Path(__file__).resolve().parents[1] / "rayhybrid"


@pytest.mark.parametrize(("preset", "name"), [("gpt_tiny", "gpt"), ("gpt3_xl", "gpt"), ("llama3_debug", "llama3")])
def test_model_name_picks_the_builtin_spec(preset, name):
    cfg = load_config([f"model={preset}"])
    spec = get_spec(cfg.model)
    assert isinstance(spec, ModelSpec) and spec.name == name and cfg.model.flavor == preset


def test_unknown_model_name_is_one_line_listing_the_builtins():
    with pytest.raises(ConfigError) as err:
        load_config(["model.name=mamba"])
    assert err.value.setting == "model.name" and "\n" not in str(err.value)
    assert all(name in str(err.value) for name in BUILTIN)


def test_nothing_outside_the_models_names_a_model():
    """The trainer, driver, planner and tuner reach a model only through its spec."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("models/"):
            continue
        text = path.read_text()
        if re.search(r"rayhybrid\.models\.(gpt|llama3)\b|\b(GPT|Llama)\(", text):
            offenders.append(rel)
    assert offenders == []


def _ckpt(model: dict) -> Checkpoint:
    return Checkpoint("/ckpt/step_00000010", {"step": 10, "model": model})


def test_resuming_another_model_is_a_config_error():
    cfg = load_config(["model=llama3_debug"])
    recorded = dataclasses.asdict(cfg.model)
    check_fits(_ckpt(recorded), cfg)  # the same model: fine
    check_fits(_ckpt({**recorded, "flavor": "x", "init_from": "/hf"}), cfg)  # names only: fine
    check_fits(None, cfg)
    check_fits(Checkpoint("/old/step_1", {"step": 1}), cfg)  # written before models were recorded
    with pytest.raises(ConfigError) as err:
        check_fits(_ckpt({**recorded, "n_kv_heads": 4}), cfg)
    assert err.value.setting == "checkpoint.dir" and "model.n_kv_heads=4 there, 2 here" in str(err.value)
    gpt = dataclasses.asdict(load_config([]).model)
    with pytest.raises(ConfigError, match="model.name='gpt' there, 'llama3' here"):
        check_fits(_ckpt(gpt), cfg)


def test_hf_config_keys_left_out_mean_transformers_defaults():
    """A config.json without rms_norm_eps / rope_theta / num_key_value_heads / tie_word_embeddings
    means LlamaConfig's defaults, not the preset's (llama3_debug has eps 1e-5, theta 5e5, 2 KV heads)."""
    from rayhybrid.models.llama3.hf import HF

    shape = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96}
    fields = HF.config_from_hf({**shape, "vocab_size": 256})
    assert (fields["norm_eps"], fields["rope_theta"], fields["n_kv_heads"], fields["tie_embeddings"]) == (
        1e-6,
        10000.0,
        4,
        False,
    )
    given = HF.config_from_hf({**shape, "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 5e5}})
    assert (given["norm_eps"], given["rope_theta"], given["vocab_size"]) == (1e-5, 5e5, 32000)


def test_dict_settings_take_a_whole_dict_without_a_plus():
    """`model.rope_scaling={...}` on a preset without scaling (an empty dict Hydra holds in
    struct mode) works like `model.rope_scaling.factor=...` on one with it."""
    cfg = load_config(["model=llama3_debug", "model.rope_scaling={factor:8.0,original_max_position_embeddings:16}"])
    assert cfg.model.rope_scaling == {"factor": 8.0, "original_max_position_embeddings": 16}
    cfg = load_config(["model=llama3.1_8b", "model.rope_scaling.factor=4.0"])
    assert cfg.model.rope_scaling["factor"] == 4.0 and cfg.model.rope_scaling["low_freq_factor"] == 1.0
    assert load_config(["model.options={width:3}"]).model.options == {"width": 3}
