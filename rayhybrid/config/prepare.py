"""The settings of `python -m rayhybrid.prepare`, composed with Hydra from `conf/prepare.yaml`
like the trainer's (`compose.py`) into a frozen `PrepareConfig`.

    cfg = compose_prepare(["input=s3://b/raw/*.jsonl", "output=s3://b/tok", "tokenizer=/models/llama3"])

Every mistake is a one-line `ConfigError` naming the setting: an unknown key, a value of the
wrong type, a required setting left out, a choice that does not exist. What needs the inputs,
the tokenizer or the store (does the input match files, is the output writable), and which
input formats there are (`rayhybrid.prepare.formats`, a registry), is checked by
`rayhybrid.prepare`, which owns them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rayhybrid.config.compose import _unfreeze, compose_tool, missing_settings, quote_value, tool_override_error
from rayhybrid.errors import ConfigError

CONFIG_NAME = "prepare"


@dataclass(frozen=True)
class PrepareConfig:
    """What to tokenize, with which tokenizer, and where the prepared dataset goes."""

    input: str
    output: str
    tokenizer: str
    format: str = "auto"
    field: str = "text"
    workers: int = 0
    bos: bool = False
    val_fraction: float = 0.0
    address: str = ""
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)


SETTINGS = {
    "input": "a file, a directory (searched recursively), a glob or a URL (s3://bucket/raw/*.jsonl); required",
    "output": "where the prepared dataset goes: a directory or a URL (s3://bucket/tokens); required",
    "tokenizer": "a local directory holding a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json); required",
    "format": "auto (each file's by its name; a directory holding a format's marker file, such as a saved "
    "Hugging Face dataset's state.json, as that format) or one of the input formats listed below",
    "field": "the JSON key, or the Parquet/Arrow column, that holds each document's text",
    "workers": "tokenizer actors; 0: one per CPU of the cluster (together they reserve all but one CPU, for reading and writing)",
    "bos": "true: each document starts with the tokenizer's BOS id (every document ends with its EOS id)",
    "val_fraction": "a fraction of whole documents held out for evaluation (0: none)",
    "address": "a Ray cluster (ip:port, auto or ray://...); empty: RAY_ADDRESS, else a local Ray",
    "storage_options": "options for fsspec's filesystem of input and output, e.g. "
    "storage_options.endpoint_url=http://host:9000 (credentials: the store's own environment variables, or "
    "storage_options.key=... and .secret=..., which are never logged or recorded)",
}
"""One line per setting: what `--help` prints (every field of PrepareConfig is here)."""

STRING_VALUES = ("input", "output", "tokenizer")
"""Paths and URLs: quoted for Hydra's override grammar, so globs ([0-9], {a,b}) and other
characters it reserves reach the setting as typed."""


def usage() -> str:
    """The settings, their defaults and what each does, for `--help`."""
    defaults = {f.name: f.default for f in dataclasses.fields(PrepareConfig)}
    lines = []
    for name, text in SETTINGS.items():
        default = defaults.get(name, dataclasses.MISSING)
        shown = "" if default is dataclasses.MISSING else f" (default: {_yaml(default)})"
        if name == "storage_options":
            shown = " (default: {})"
        lines.append(f"  {name}=...{shown}\n      {text}")
    return "\n".join(lines)


def _yaml(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if value == "" else str(value)


@functools.cache
def register_prepare_schema() -> None:
    from hydra.core.config_store import ConfigStore

    node = OmegaConf.structured(PrepareConfig)
    _unfreeze(node)  # frozen dataclasses become read-only nodes; Hydra must merge into them
    ConfigStore.instance().store(name="prepare_schema", node=node)


def normalize(overrides: Sequence[str]) -> list[str]:
    """Check that every override is `key=value` of a known setting; quote paths; merge
    `storage_options={...}` and `storage_options.K=V` with `++` (its keys are free-form)."""
    names = [f.name for f in dataclasses.fields(PrepareConfig)]
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        bare = key.lstrip("+~")
        if not sep:
            raise ConfigError(item, "is not a setting; give key=value (python -m rayhybrid.prepare --help lists them)")
        top = bare.split(".", 1)[0]
        if top not in names or ("." in bare and top != "storage_options"):
            raise ConfigError(
                bare, f"is not a setting of rayhybrid.prepare; remove it (the settings are: {', '.join(names)})"
            )
        if top == "storage_options":
            item = f"++{bare}={value}"
        elif bare in STRING_VALUES:
            item = f"{bare}={quote_value(value)}"
        out.append(item)
    return out


def compose_node(overrides: Sequence[str] = ()) -> DictConfig:
    """`conf/prepare.yaml` with the command line's overrides, not yet checked."""
    register_prepare_schema()
    return compose_tool(CONFIG_NAME, "rayhybrid.prepare", normalize(overrides))


def check(cfg: PrepareConfig) -> None:
    """The settings' own checks (no file is touched)."""
    for name in STRING_VALUES:
        if not str(getattr(cfg, name)).strip():
            raise ConfigError(name, f"is empty; {SETTINGS[name]}")
    if not cfg.field.strip():
        raise ConfigError("field", "is empty; give the JSON key or column that holds the text (e.g. field=text)")
    if cfg.workers < 0:
        raise ConfigError("workers", f"is {cfg.workers}; give a count of tokenizer actors, or 0 for automatic")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ConfigError("val_fraction", f"is {cfg.val_fraction}; give a fraction in [0, 1), e.g. 0.01")


def compose_prepare(overrides: Sequence[str] = ()) -> PrepareConfig:
    """Compose and check the settings of `python -m rayhybrid.prepare`; raises `ConfigError`."""
    node = compose_node(overrides)
    missing, _ = missing_settings(node)
    if missing:
        adds = " ".join(f"{key}=..." for key in missing)
        raise ConfigError(missing[0], f"is required; add {adds} to the command line")
    try:
        cfg = OmegaConf.to_object(node)
    except OmegaConfBaseException as err:
        raise tool_override_error(err, "rayhybrid.prepare") from None
    assert isinstance(cfg, PrepareConfig)
    check(cfg)
    return cfg
