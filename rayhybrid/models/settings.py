"""A model family's own settings (no torch): a frozen dataclass in the family's package, named
by its spec (`ModelSpec.settings`), read from `model.options`.

The shared `ModelConfig` holds only what every family has (layers, heads, widths, vocabulary);
what one family reads, Llama's `rope_theta` say, is a field of that family's dataclass
(`rayhybrid/models/llama3/settings.py`), set as `model.options.rope_theta=500000`. Adding a
family's setting touches its dataclass and the code that reads it, nothing shared.

    settings_of(cfg.model)        # LlamaSettings(n_kv_heads=2, rope_theta=500000.0, ...)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rayhybrid.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class NoSettings:
    """The settings of a family that has none of its own: any `model.options` key is refused."""


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _coerce(field: dataclasses.Field, value: Any, family: str) -> Any:
    """`value` as the type of the field's default (an int given for a float setting is that
    float, as a typed schema field would make it); ConfigError when it cannot be."""
    default = _default(field)
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, Mapping):
        ok = isinstance(value, Mapping)
        value = dict(value) if ok else value
    else:
        ok = True
    if not ok:
        kind = type(default).__name__
        raise ConfigError(f"model.options.{field.name}", f"the {family} model takes a {kind} here, got {value!r}")
    return value


def build_settings(cls: type, options: Mapping[str, Any], family: str) -> Any:
    """`cls` (a family's settings dataclass) from `options` (`model.options`): its defaults, with
    the options given; ConfigError naming `model.options.<key>` for a key the family does not
    read or a value of the wrong type."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        takes = f"it reads {', '.join(fields)}" if fields else "it has no settings of its own"
        raise ConfigError(
            f"model.options.{unknown[0]}",
            f"the {family} model does not use it (got {options[unknown[0]]!r}); remove it ({takes})",
        )
    return cls(**{name: _coerce(fields[name], options[name], family) for name in options})


def as_options(settings: Any) -> dict[str, Any]:
    """A settings dataclass as `model.options` (every field, defaults included)."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
