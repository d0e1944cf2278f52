"""The model registry and spec: model.name picks a built-in model, nothing outside
rayhybrid/models names one, checkpoints record the model and refuse another."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from rayhybrid.driver.compatibility import check_fits
from rayhybrid.errors import ConfigError
from rayhybrid.models.registry import BUILTIN, get_spec
from rayhybrid.models.spec import ModelSpec
from rayhybrid.preflight import load_config
from rayhybrid.storage.checkpoints import Checkpoint

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
        check_fits(_ckpt({**recorded, "options": {**recorded["options"], "n_kv_heads": 4}}), cfg)
    assert err.value.setting == "checkpoint.dir" and "model.options.n_kv_heads=4 there, 2 here" in str(err.value)
    # An option left at its default and one spelt out agree.
    check_fits(_ckpt({**recorded, "options": {**recorded["options"], "tie_embeddings": False}}), cfg)
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
    """`model.options.rope_scaling={...}` on a preset without scaling works like
    `model.options.rope_scaling.factor=...` on one with it."""
    scaling = "model.options.rope_scaling={factor:8.0,original_max_position_embeddings:16}"
    cfg = load_config(["model=llama3_debug", scaling])
    assert cfg.model.options["rope_scaling"] == {"factor": 8.0, "original_max_position_embeddings": 16}
    cfg = load_config(["model=llama3.1_8b", "model.options.rope_scaling.factor=4.0"])
    scaled = cfg.model.options["rope_scaling"]
    assert scaled["factor"] == 4.0 and scaled["low_freq_factor"] == 1.0
    assert load_config(["model=llama3_debug", "model.options={n_kv_heads:1}"]).model.options["n_kv_heads"] == 1


# A family's own settings (rayhybrid/models/settings.py) ----------------------------------------

OLD_LLAMA_FIELDS = ("n_kv_heads", "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings")


def _old_record(cfg) -> dict:
    """meta.json's "model" as rayhybrid wrote it before families owned their settings: Llama's
    settings at the top level (every model carried them, at their defaults for gpt)."""
    from rayhybrid.models.registry import settings_of

    own = settings_of(cfg.model)
    flat = {"n_kv_heads": 0, "rope_theta": 10000.0, "rope_scaling": {}, "norm_eps": 1e-5, "tie_embeddings": False}
    if hasattr(own, "rope_theta"):
        flat = {name: getattr(own, name) for name in OLD_LLAMA_FIELDS}
    return {**dataclasses.asdict(cfg.model), **flat, "options": {}}


def test_the_shared_model_config_holds_no_family_setting():
    """ModelConfig keeps what every family has; Llama's settings are LlamaSettings' fields."""
    from rayhybrid.config.schema import ModelConfig
    from rayhybrid.models.llama3.settings import LlamaSettings

    shared = {f.name for f in dataclasses.fields(ModelConfig)}
    assert shared.isdisjoint(OLD_LLAMA_FIELDS)
    assert {f.name for f in dataclasses.fields(LlamaSettings)} == set(OLD_LLAMA_FIELDS)
    assert get_spec(load_config(["model=llama3_debug"]).model).settings is LlamaSettings


def test_settings_come_from_model_options_with_types_and_defaults():
    from rayhybrid.models.llama3.settings import LlamaSettings
    from rayhybrid.models.registry import settings_of

    cfg = load_config(["model=llama3_debug", "model.options.rope_theta=1000", "model.options.tie_embeddings=true"])
    own = settings_of(cfg.model)
    assert own == LlamaSettings(n_kv_heads=2, rope_theta=1000.0, norm_eps=1e-5, tie_embeddings=True)
    assert isinstance(own.rope_theta, float)  # an int given for a float setting, as a schema field would make it
    with pytest.raises(ConfigError) as err:
        load_config(["model=llama3_debug", "model.options.rope_theta=fast"])
    assert err.value.setting == "model.options.rope_theta" and "float" in err.value.message
    with pytest.raises(ConfigError) as err:
        load_config(["model=llama3_debug", "model.options.rope_thta=1.0"])
    assert err.value.setting == "model.options.rope_thta" and "rope_theta" in err.value.message


@pytest.mark.parametrize(
    "override", ["model.rope_theta=500000", "model.n_kv_heads=2", "++model.rope_scaling.factor=8", "model.width=3"]
)
def test_a_family_setting_at_the_top_level_names_its_new_spelling(override):
    name = override.lstrip("+").split("=")[0].split(".")[1]
    with pytest.raises(ConfigError) as err:
        load_config(["model=llama3_debug", override])
    assert err.value.setting == f"model.{name}" and f"model.options.{name}" in err.value.message
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("preset", ["llama3_debug", "llama3.2_1b", "gpt_tiny"])
def test_checkpoints_recorded_before_families_owned_their_settings_still_resume_and_export(preset):
    """An older meta.json kept Llama's settings at the top level: it resumes a run of the same
    model, refuses another, and gives export the settings it was trained with."""
    from rayhybrid.models.registry import model_from_record, settings_of

    cfg = load_config([f"model={preset}"])
    old = _old_record(cfg)
    check_fits(_ckpt(old), cfg)
    model = model_from_record(old)
    assert settings_of(model) == settings_of(cfg.model)
    if cfg.model.name == "llama3":
        with pytest.raises(ConfigError, match="model.options.rope_theta=1.0 there"):
            check_fits(_ckpt({**old, "rope_theta": 1.0}), cfg)
