"""Which model a config names: `get_spec(cfg.model)` -> its `ModelSpec`.

Built-in models are modules of this package, imported only when asked for; `model.module`
names one outside it. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

from rayhybrid.config.schema import ModelConfig
from rayhybrid.errors import ConfigError
from rayhybrid.models.settings import build_settings
from rayhybrid.models.spec import ModelSpec

BUILTIN = {
    "gpt": "rayhybrid.models.gpt",
    "llama3": "rayhybrid.models.llama3",
}
"""model.name -> the module that exposes its `SPEC`."""


def get_spec(model) -> ModelSpec:
    """The spec of `model` (a ModelConfig): `model.module`'s if set, else the built-in `model.name`."""
    if model.module:
        return load_module_spec(model.module)
    if model.name not in BUILTIN:
        raise ConfigError(
            "model.name",
            f"unknown model {model.name!r}; built in: {', '.join(BUILTIN)}, "
            "or set model.module=<your package.module exposing SPEC>",
        )
    return builtin_spec(model.name)


def builtin_spec(name: str) -> ModelSpec:
    """The spec of built-in model `name` (a key of BUILTIN)."""
    return _load(BUILTIN[name], "model.name")


def load_module_spec(module: str) -> ModelSpec:
    return _load(module, "model.module")


@functools.cache
def _load(module: str, setting: str) -> ModelSpec:
    try:
        mod = importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(
            setting,
            f"cannot import {module!r} ({err}); install the package, or add its directory to PYTHONPATH "
            "(cluster.code ships it to the workers; with cluster.code=off they need it installed)",
        ) from None
    spec = getattr(mod, "SPEC", None)
    if not isinstance(spec, ModelSpec):
        raise ConfigError(
            setting,
            f"module {module!r} has no SPEC (a rayhybrid.models.spec.ModelSpec); see examples/custom_model/",
        )
    return spec


def settings_of(model):
    """The family's own settings (its spec's `settings` dataclass) from `model.options`; None for
    a family whose `model.options` is free-form. Raises ConfigError naming `model.options.<key>`."""
    spec = get_spec(model)
    if spec.settings is None:
        return None
    return build_settings(spec.settings, model.options, model.module or spec.name)


def validate_model(cfg) -> None:
    """The model's own checks: its settings (`settings_of`), then its spec's `validate`, after
    Hugging Face's config.json has set the shape (`model.init_from`, see rayhybrid/models/hf.py)."""
    spec = get_spec(cfg.model)
    chosen = f"model.module={cfg.model.module}" if cfg.model.module else f"model.name={cfg.model.name}"
    if cfg.model.init_from and spec.hf is None:
        raise ConfigError("model.init_from", f"{chosen} has no Hugging Face adapter (SPEC.hf)")
    if cfg.train.compile and not spec.compiles:
        raise ConfigError(
            "train.compile",
            f"{chosen} does not compile its blocks (its SPEC has compiles=False; see docs/models.md); "
            "set train.compile=false",
        )
    if cfg.train.offload_activations and not spec.offloads:
        raise ConfigError(
            "train.offload_activations",
            f"{chosen} does not offload its blocks' activations (its SPEC has offloads=False; see docs/models.md); "
            "set train.offload_activations=false",
        )
    settings_of(cfg.model)
    if spec.validate is not None:
        spec.validate(cfg)


def model_from_record(recorded: dict):
    """A ModelConfig from a checkpoint's recorded model (meta.json "model", written as
    `dataclasses.asdict(cfg.model)`). A family's settings that an older rayhybrid recorded at
    the top level (`rope_theta`, ...) move into `options` when the family reads them; the
    ones it does not (the old defaults every record carried) are dropped."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    model = ModelConfig(**{k: v for k, v in recorded.items() if k in known})
    spec = get_spec(model)
    if spec.settings is None:
        return model
    family = {f.name for f in dataclasses.fields(spec.settings)}
    lifted = {k: v for k, v in recorded.items() if k not in known and k in family}
    return dataclasses.replace(model, options={**lifted, **model.options})


def comparable(model) -> dict:
    """`model` (a ModelConfig) as flat settings to compare two models by: the shared fields, and
    the family's settings with their defaults (`options.<name>`), so that an option left at its
    default and one set to it agree."""
    out = {f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.name != "options"}
    settings = settings_of(model)
    own = model.options if settings is None else dataclasses.asdict(settings)
    return out | {f"options.{k}": v for k, v in own.items()}


def comparable_record(recorded: dict) -> dict:
    """A checkpoint's recorded model (meta.json "model") as `comparable` gives it: the shared
    fields it recorded (one written before a field existed lacks it) and its family's settings;
    as recorded when its family cannot be loaded here."""
    try:
        flat = comparable(model_from_record(recorded))
    except ConfigError:
        return dict(recorded)
    return {k: v for k, v in flat.items() if k in recorded or k.startswith("options.")}
