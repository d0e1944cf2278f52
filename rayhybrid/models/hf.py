"""Hugging Face checkpoints in and out, for any model whose spec has an `HFAdapter` (no torch here).

- In: `model.init_from=<dir>` (config.json + safetensors, what `save_pretrained` writes). Its
  config.json sets the model's shape (`resolve_init_from`, at composition); each rank then reads
  only its own shards of the safetensors through DCP's `HuggingFaceStorageReader`
  (rayhybrid/trainer/hf_load.py).
- Out: `python -m rayhybrid.export` (rayhybrid/export/).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from typing import ClassVar

from rayhybrid.errors import ConfigError

CONFIG_JSON = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

_EFFECTIVE = {
    "head_dim": lambda f: f["head_dim"] or f["d_model"] // f["n_heads"],
    "ffn_dim": lambda f: f["ffn_dim"] or f["ffn_mult"] * f["d_model"],
    "n_kv_heads": lambda f: f["n_kv_heads"] or f["n_heads"],  # llama3's LlamaSettings
}
"""Fields whose 0 means a default: two values agree when the width they give agrees."""


class HFAdapter:
    """Names and config fields of one model family, to and from Hugging Face's."""

    architectures: tuple[str, ...] = ()
    model_type: str = ""

    def to_hf(self, name: str) -> str:
        """Hugging Face's name of our parameter `name` (full model name)."""
        raise NotImplementedError

    def from_hf(self, name: str) -> str | None:
        """Our name of Hugging Face's parameter `name`; None: not a parameter of ours (buffers)."""
        raise NotImplementedError

    def config_from_hf(self, hf: dict) -> dict:
        """Settings from config.json, flat: ModelConfig fields and fields of the family's settings
        dataclass (`ModelSpec.settings`, which go to model.options); ValueError for what the
        model cannot represent."""
        raise NotImplementedError

    def config_to_hf(self, model, seq_len: int) -> dict:
        """config.json for `model` (a ModelConfig)."""
        raise NotImplementedError

    tied_fallback: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}
    """Hugging Face name -> the tensor a tied checkpoint, which lacks it, shares it with: an
    untied run (`model.options.tie_embeddings=false` over config.json's true) starts it as a copy."""

    def tied(self, model) -> bool:
        """Whether `model` (a ModelConfig) ties its output to the token embedding (one tensor,
        written once on export)."""
        return False

    def hf_key(self, field: str) -> str:
        """The config.json key that sets `field`, of ModelConfig or the settings (for messages)."""
        return field

    def accepts(self, hf: dict) -> bool:
        """Whether config.json (its `architectures`, else its `model_type`) is this adapter's."""
        architectures = hf.get("architectures") or []
        if architectures:
            return any(a in self.architectures for a in architectures)
        return bool(self.model_type) and hf.get("model_type") == self.model_type


def init_dir(path: str) -> str:
    """`model.init_from` as an absolute local directory holding config.json and safetensors
    weights; raises ConfigError saying what is missing."""
    if "://" in path and not path.startswith("file://"):
        raise ConfigError(
            "model.init_from",
            f"{path} is not a local directory; download the checkpoint first "
            "(e.g. huggingface-cli download <repo> --local-dir <dir>) and give that directory",
        )
    directory = os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
    if not os.path.isdir(directory):
        raise ConfigError("model.init_from", f"{directory} is not a directory (a Hugging Face checkpoint's)")
    if not os.path.isfile(os.path.join(directory, CONFIG_JSON)):
        raise ConfigError(
            "model.init_from", f"{directory} has no {CONFIG_JSON}; give the directory save_pretrained wrote"
        )
    index = os.path.join(directory, WEIGHTS_INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError("model.init_from", f"{index} is not a safetensors index ({type(err).__name__})") from None
        missing = [s for s in shards if not os.path.isfile(os.path.join(directory, s))]
        if missing:
            raise ConfigError(
                "model.init_from",
                f"{directory} lacks {len(missing)} of the {len(shards)} shards {WEIGHTS_INDEX} lists "
                f"(first: {missing[0]}); an incomplete download?",
            )
    elif not os.path.isfile(os.path.join(directory, WEIGHTS)):
        raise ConfigError(
            "model.init_from",
            f"{directory} has no {WEIGHTS} or {WEIGHTS_INDEX}; rayhybrid reads safetensors only "
            "(save_pretrained writes them by default)",
        )
    return directory


def read_hf_config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG_JSON)
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError) as err:
        raise ConfigError("model.init_from", f"cannot read {path} ({type(err).__name__}: {err})") from None
    if not isinstance(hf, dict):
        raise ConfigError("model.init_from", f"{path} is not a JSON object")
    return hf


def _found(hf: dict) -> str:
    architectures = hf.get("architectures") or []
    if architectures:
        return ", ".join(map(str, architectures))
    return f"model_type {hf['model_type']!r}" if hf.get("model_type") else "an unnamed architecture"


def _builtin_for(hf: dict) -> str | None:
    """The built-in model whose adapter reads this config.json, if any."""
    from rayhybrid.models.registry import BUILTIN, builtin_spec

    for name in BUILTIN:
        spec = builtin_spec(name)
        if spec.hf is not None and spec.hf.accepts(hf):
            return name
    return None


def _hint(hf: dict) -> str:
    name = _builtin_for(hf)
    if name is None:
        return ""
    return (
        f"; that is model.name={name}'s: add model.name={name} or model=<a {name} preset> (config.json sets the shape)"
    )


_OVERRIDE = re.compile(r"^[+~]*model\.((?:options\.)?[A-Za-z_]\w*)(?:\.[^=]*)?=")


def overridden_fields(overrides: Sequence[str]) -> set[str]:
    """Model settings the command line sets: ModelConfig fields (`model.n_layers=3` ->
    `n_layers`) and the family's (`++model.options.rope_scaling.factor=8` -> `options.rope_scaling`)."""
    fields = set()
    for item in overrides:
        match = _OVERRIDE.match(str(item))
        if match:
            fields.add(match.group(1))
    return fields


def _flat(model) -> dict:
    """`model`'s shared fields and its family's settings (defaults filled), in one dict."""
    from rayhybrid.models.registry import settings_of

    settings = settings_of(model)
    own = dataclasses.asdict(settings) if settings is not None else {}
    return {f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.name != "options"} | own


def _agree(mine: dict, field: str, value) -> bool:
    if mine[field] == value:
        return True
    effective = _EFFECTIVE.get(field)
    return effective is not None and effective({**mine, field: value}) == effective(mine)


def resolve_init_from(cfg, overrides: Sequence[str] = ()):
    """`cfg` (a Config) with the shape that `model.init_from`'s config.json gives; unchanged when
    init_from is not set. `overrides`: the command line's, whose `model.<field>=` and
    `model.options.<field>=` settings must agree with config.json (they would otherwise be
    dropped silently). Raises ConfigError."""
    from rayhybrid.models.registry import get_spec

    model = cfg.model
    if not model.init_from:
        return cfg
    directory = init_dir(model.init_from)
    hf = read_hf_config(directory)
    spec = get_spec(model)
    adapter = spec.hf
    chosen = f"model.module={model.module}" if model.module else f"model.name={model.name}"
    if adapter is None:
        raise ConfigError(
            "model.init_from",
            f"{chosen} has no Hugging Face adapter, so it cannot start from {directory} ({_found(hf)})" + _hint(hf),
        )
    if not adapter.accepts(hf):
        supported = ", ".join(adapter.architectures) or adapter.model_type
        raise ConfigError(
            "model.init_from",
            f"{directory}/{CONFIG_JSON} is {_found(hf)}; {chosen} reads {supported}" + _hint(hf),
        )
    try:
        fields = adapter.config_from_hf(hf)
    except ValueError as err:
        raise ConfigError("model.init_from", f"{directory}/{CONFIG_JSON}: {err}") from None
    shared = {f.name for f in dataclasses.fields(model)} - {"options"}
    own = {f.name for f in dataclasses.fields(spec.settings)} if spec.settings is not None else set()
    unknown = sorted(set(fields) - shared - own)
    if unknown:
        raise ConfigError("model.init_from", f"the adapter of {chosen} sets unknown model fields {unknown}")
    _check_overrides(fields, _flat(model), overrides, shared, directory, adapter)
    options = {**model.options, **{k: v for k, v in fields.items() if k in own}}
    shape = {k: v for k, v in fields.items() if k in shared}
    return dataclasses.replace(cfg, model=dataclasses.replace(model, init_from=directory, **shape, options=options))


def _check_overrides(fields: dict, mine: dict, overrides, shared: set, directory: str, adapter) -> None:
    """The command line's model settings must agree with config.json's `fields`; an untied run
    over a tied checkpoint (`model.options.tie_embeddings=false`) unties it (in `fields`)."""
    given = overridden_fields(overrides)
    for field in sorted(fields):
        setting = field if field in shared else f"options.{field}"
        if setting not in given:
            continue
        if field == "tie_embeddings" and fields[field] and not mine[field]:
            fields[field] = False  # untie: the output starts as a copy of the embedding
            continue
        if not _agree(mine, field, fields[field]):
            raise ConfigError(
                f"model.{setting}",
                f"{mine[field]!r} contradicts config.json's {adapter.hf_key(field)}={json.dumps(fields[field])} in "
                f"{directory}; remove the override",
            )
