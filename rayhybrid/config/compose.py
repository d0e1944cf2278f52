"""Hydra composition: `conf/` YAML over the schema dataclasses -> a frozen `Config`.

This package is the only one that imports Hydra/OmegaConf (docs/design.md, invariant 7). It
imports nothing of rayhybrid above configuration: the shape `model.init_from` implies and the
checks of every concern are applied by `rayhybrid.preflight.load_config`, which entry points use.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from rayhybrid.config.schema import Config, ModelConfig
from rayhybrid.errors import ConfigError

CONFIG_NAME = "config"
OPTIONAL_GROUPS = ("topology", "experiment", "debug")
"""Groups that are not in config.yaml's defaults list: `+topology=dp2` appends one;
`topology=dp2` is accepted too and rewritten to the append form. `experiment` holds whole
recipes and `debug` development settings (`+experiment=gpt3_xl_elastic`, `+debug=fast`)."""


def conf_dir() -> str:
    """Absolute path of the YAML tree: the installed `rayhybrid.conf` package data, else the
    source checkout's `conf/` next to the `rayhybrid/` package."""
    spec = importlib.util.find_spec("rayhybrid.conf")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if os.path.isfile(os.path.join(location, f"{CONFIG_NAME}.yaml")):
                return os.path.abspath(location)
    source = Path(__file__).resolve().parents[2] / "conf"
    if (source / f"{CONFIG_NAME}.yaml").is_file():
        return str(source)
    raise FileNotFoundError("rayhybrid's conf/ YAML is missing; reinstall the package (pip install .)")


def _unfreeze(node: DictConfig) -> None:
    """Frozen dataclasses become read-only OmegaConf nodes; Hydra must merge YAML into them."""
    OmegaConf.set_readonly(node, None)
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _unfreeze(child)


@functools.cache
def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    if not OmegaConf.has_resolver(REQUIRED):
        OmegaConf.register_new_resolver(REQUIRED, _raise_required)
    node = OmegaConf.structured(Config)
    _unfreeze(node)
    ConfigStore.instance().store(name="base_config", node=node)


FREE_FORM = ("checkpoint.storage_options.", "data.storage_options.", "model.options.")


def _family_setting(key: str) -> None:
    """`model.rope_theta=...`: a setting that is not ModelConfig's is a model family's own, under
    model.options (rayhybrid/models/<family>/settings.py); say so in one line."""
    parts = key.lstrip("+~").split(".")
    shared = {f.name for f in dataclasses.fields(ModelConfig)}
    if len(parts) >= 2 and parts[0] == "model" and parts[1] not in shared:
        new = "model.options." + ".".join(parts[1:])
        raise ConfigError(
            f"model.{parts[1]}",
            f"is not a setting every model has; a model family's own settings are under model.options: write {new}=...",
        )


@functools.cache
def _bool_settings() -> frozenset[str]:
    """The schema's settings typed `bool` (`train.offload_activations`, ...), by dotted name."""
    import typing

    out = set()
    for section in dataclasses.fields(Config):
        hints = typing.get_type_hints(typing.get_type_hints(Config)[section.name])
        out.update(f"{section.name}.{name}" for name, hint in hints.items() if hint is bool)
    return frozenset(out)


def _strict_bool(key: str, value: str) -> None:
    """A bool setting takes `true` or `false` only: OmegaConf would read `2`, `yes` or `on` as
    true and start the run. A sweep's values (`true,false`, `choice(true,false)`) each."""
    values = re.sub(r"^\s*choice\((.*)\)\s*$", r"\1", value).split(",")
    if key.lstrip("+~") in _bool_settings() and any(v.strip().lower() not in ("true", "false") for v in values):
        raise ConfigError(key.lstrip("+~"), f"{value!r} is not a valid bool; use true or false")


def normalize_overrides(overrides: Sequence[str]) -> list[str]:
    """`topology=dp2` -> `+topology=dp2` (topology is not in the defaults list), and
    `checkpoint.storage_options.K=V` -> `++...` (free-form keys: added or replaced). A model
    family's setting given as `model.K=V` is refused, naming `model.options.K`."""
    out = []
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" in item:
            _family_setting(key)
            _strict_bool(key, item.split("=", 1)[1])
        if key in OPTIONAL_GROUPS and "=" in item:
            item = "+" + item
        elif (key.startswith(FREE_FORM) or f"{key}." in FREE_FORM) and "=" in item:
            item = "++" + item
        out.append(item)
    return out


def available_options(group: str) -> list[str]:
    root = Path(conf_dir()) / group
    return sorted(p.stem for p in root.glob("*.yaml"))


def composition_error(err: Exception) -> ConfigError:
    """Hydra's multi-line composition errors as one line naming the setting and the fix."""
    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException):
        missing = err.missing_cfg_file or ""
        group, _, name = missing.rpartition("/")
        if group:
            options = ", ".join(available_options(group))
            return ConfigError(group, f"no preset named {name!r}; available: {options}")
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    cause = err.__cause__
    while cause is not None and cause.__cause__ is not None:
        cause = cause.__cause__
    if cause is not None:
        lines.append(str(cause).splitlines()[0].strip())
    return ConfigError("overrides", " ".join(dict.fromkeys(lines)))


REQUIRED = "required"
"""The resolver that marks a setting the user must give: `checkpoint.dir: ${required:}`, or with
a hint for the error line, `${required:'a bucket every node reaches'}`. (`???` cannot: merged
over a schema field that has a default, OmegaConf keeps the default.)"""
_REQUIRED_VALUE = re.compile(r"^\$\{" + REQUIRED + r":\s*(.*?)\s*\}$", re.DOTALL)


def _required_hint(value: object) -> str | None:
    """The hint of a `${required:...}` value (empty without one); None for any other value."""
    match = _REQUIRED_VALUE.match(value) if isinstance(value, str) else None
    if match is None:
        return None
    hint = match.group(1)
    return hint[1:-1] if len(hint) >= 2 and hint[0] == hint[-1] and hint[0] in "'\"" else hint


def _required_error(keys: Sequence[str], hints: dict[str, str]) -> ConfigError:
    first, rest = keys[0], keys[1:]
    hint = f" ({hints[first]})" if hints.get(first) else ""
    also = f", and so {'are' if len(rest) > 1 else 'is'} {', '.join(rest)}" if rest else ""
    adds = " ".join(f"{key}=..." for key in keys)
    return ConfigError(first, f"is required{hint}{also}; add {adds} to the command line")


def _raise_required(hint: str = "", *, _node_) -> None:
    """Resolving a `${required:}` that was never set (only `--cfg job --resolve` gets here:
    `to_config` checks first)."""
    key = _node_._get_full_key(None)
    raise _required_error([key], {key: str(hint)})


def missing_settings(cfg: DictConfig) -> tuple[list[str], dict[str, str]]:
    """The settings still at `${required:...}` (or at `???` where the schema has no default), in
    the config's order, and their hints."""
    found: list[str] = []
    hints: dict[str, str] = {}

    def walk(node: DictConfig, prefix: str) -> None:
        for key in node:
            name = f"{prefix}{key}"
            child = node._get_node(key)
            hint = _required_hint(child._value()) if child._is_interpolation() else None
            if hint is not None:
                found.append(name)
                hints[name] = hint
            elif child._is_missing():
                found.append(name)
            elif isinstance(child, DictConfig):
                walk(child, f"{name}.")

    walk(cfg, "")
    return found, hints


def _check_settings(cfg: DictConfig) -> None:
    """Every top-level key is a section of the schema, and every required setting is given."""
    fields = {f.name for f in dataclasses.fields(Config)}
    for key in cfg:
        if key not in fields:
            raise ConfigError(
                str(key), f"is not a setting of rayhybrid; remove it (the sections are: {', '.join(sorted(fields))})"
            )
    missing, hints = missing_settings(cfg)
    if missing:
        raise _required_error(missing, hints)


def task_overrides(cfg: DictConfig) -> list[str]:
    """The command line's overrides a composed node carries (`hydra.overrides.task`)."""
    return list(OmegaConf.select(cfg, "hydra.overrides.task", default=None) or [])


def to_config(cfg: DictConfig) -> Config:
    """Composed OmegaConf node (with or without the `hydra` key) -> frozen `Config`, as the
    YAML and overrides give it (`rayhybrid.preflight.to_run_config` adds `model.init_from`'s
    shape)."""
    cfg = cfg.copy()
    if "hydra" in cfg:
        OmegaConf.set_struct(cfg, False)
        cfg.pop("hydra")
    _check_settings(cfg)
    try:
        obj = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as err:
        key = err.full_key
        raise ConfigError(key, f"is required; add {key}=... to the command line") from None
    except OmegaConfBaseException as err:
        raise ConfigError(getattr(err, "full_key", "") or "config", str(err).splitlines()[0]) from None
    assert isinstance(obj, Config)
    return obj


def compose(overrides: Sequence[str] = (), *, return_hydra_config: bool = False) -> DictConfig:
    """Compose `conf/config.yaml` with command-line style overrides; raises `ConfigError`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    register_schema()
    try:
        with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
            return hydra_compose(
                CONFIG_NAME, overrides=normalize_overrides(overrides), return_hydra_config=return_hydra_config
            )
    except HydraException as err:
        raise composition_error(err) from None


def replace(cfg: Config, **sections: dict) -> Config:
    """`replace(cfg, topology={"dp": 2})`: a copy with some fields of some sections changed."""
    changes = {}
    for name, fields in sections.items():
        current = getattr(cfg, name)
        changes[name] = dataclasses.replace(current, **fields) if isinstance(fields, dict) else fields
    return dataclasses.replace(cfg, **changes)


def tool_override_error(err: Exception, command: str) -> ConfigError:
    """Hydra's error for a bad override of `python -m <command>` (prepare, goodput) as one line
    naming the setting."""
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
            first = str(cause).splitlines()[0].strip()
            return ConfigError(str(cause.full_key), f"{first}; python -m {command} --help lists the settings")
        cause = cause.__cause__ or cause.__context__
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return ConfigError("overrides", " ".join(lines[:2]) or type(err).__name__)


def compose_tool(config_name: str, command: str, overrides: list[str]) -> DictConfig:
    """`conf/<config_name>.yaml` (a tool's settings, its schema registered) with normalized
    overrides, not yet checked; a bad override is a ConfigError naming it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    try:
        with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
            return hydra_compose(config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise tool_override_error(err, command) from None


def quote_value(value: str) -> str:
    """A path or URL quoted for Hydra's override grammar, so that globs ([0-9], {a,b}) and other
    characters it reserves reach the setting as typed; a value already quoted is kept."""
    if value[:1] in ("'", '"'):
        return value
    if "'" not in value and not value.endswith("\\"):
        return f"'{value}'"
    if '"' not in value and not value.endswith("\\"):
        return f'"{value}"'
    return value
