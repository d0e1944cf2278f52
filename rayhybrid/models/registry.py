"""Which model a config names: `get_spec(cfg.model)` -> its `ModelSpec`.

Built-in models are modules of this package, imported only when asked for; `model.module`
names one outside it. Nothing here imports torch.
"""

from __future__ import annotations

import functools
import importlib

from rayhybrid.errors import ConfigError
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


def validate_model(cfg) -> None:
    """The model's own checks (its spec's `validate`), after Hugging Face's config.json has set
    the shape (`model.init_from`, see rayhybrid/models/hf.py)."""
    spec = get_spec(cfg.model)
    if cfg.model.module and cfg.model.init_from and spec.hf is None:
        raise ConfigError("model.init_from", f"model.module={cfg.model.module} has no Hugging Face adapter (SPEC.hf)")
    if spec.validate is not None:
        spec.validate(cfg)
