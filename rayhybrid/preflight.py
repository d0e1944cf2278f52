"""What every entry point does before a run: compose the config, give it the shape of
`model.init_from`, check it, and turn errors into exit codes.

    cfg = load_config(["+topology=dp2_pp2_tp2"])       # composed, shaped, checked
    cfg = load_run(overrides, run_dir=None)            # the same, with its run directory

The checks come in two kinds, and this is where they meet:
- `check_config`: the config's own (`rayhybrid.config.validate.check`), then each concern's
  checks of its settings, which live with the concern: the model's spec, `fault.inject`, the
  experiment trackers' settings, the data settings. Pure (no file, no network, no environment
  variable) and cheap: the tuner runs it for every candidate of a search.
- `check_environment`: what the settings name must be there: `cluster.code`'s directory,
  `checkpoint.dir`'s storage package, the trackers' packages and credentials, the data files
  and prepared datasets (their index.json) and `model.init_from`'s tokenizer. Once per command,
  never per search candidate.
`check` runs both, in that order. This module sits above all of them, so the configuration
layer imports none. It never imports torch or Ray.

Used by `python -m rayhybrid`, `rayhybrid.train()`, `python -m rayhybrid.plan`,
`python -m rayhybrid.tune` and `python -m rayhybrid.export`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from rayhybrid import tracking
from rayhybrid.config import validate as config_checks
from rayhybrid.config.compose import compose, task_overrides, to_config
from rayhybrid.config.schema import Config
from rayhybrid.data.sources import check_data_files, check_data_settings
from rayhybrid.errors import CONFIG_EXIT_CODE, ConfigError, RayHybridError
from rayhybrid.faults import validate_faults
from rayhybrid.models.hf import resolve_init_from
from rayhybrid.models.registry import validate_model
from rayhybrid.storage.store import scrub, secret_values, validate_url


def check_config(cfg: Config) -> None:
    """The config's own checks and each concern's checks of its settings, each raising a
    one-line `ConfigError` naming the setting and the fix. Reads no file and no environment."""
    config_checks.check(cfg)
    validate_model(cfg)
    validate_faults(cfg)
    tracking.check_settings(cfg)
    check_data_settings(cfg)


def check_environment(cfg: Config) -> None:
    """What the settings of a config that passed `check_config` name is there, here on the
    driver: one-line `ConfigError`s as well. Once per command (it reads files and index.json
    over the network)."""
    from rayhybrid.cluster.code import check_code_setting

    check_code_setting(cfg)
    validate_url("checkpoint.dir", cfg.checkpoint.dir)
    tracking.check_environment(cfg)
    check_data_files(cfg)


def check(cfg: Config) -> None:
    """Every check before a run: `check_config`, then `check_environment`."""
    check_config(cfg)
    check_environment(cfg)


def to_run_config(node, overrides: Sequence[str] | None = None) -> Config:
    """A composed node -> `Config` with the shape of `model.init_from`'s Hugging Face
    config.json (rayhybrid/models/hf.py). `overrides`: the command line's (default: the node's
    `hydra.overrides.task`), which must not contradict that shape."""
    if overrides is None:
        overrides = task_overrides(node)
    return resolve_init_from(to_config(node), overrides)


def load_config(overrides: Sequence[str] = ()) -> Config:
    """Compose, shape and `check` (cluster capacity is checked on connect)."""
    cfg = to_run_config(compose(overrides), overrides)
    check(cfg)
    return cfg


def load_run(overrides: Sequence[str] = (), run_dir: str | Path | None = None, *, check: bool = True) -> Config:
    """`load_config` with the run directory set: `run_dir`, else `hydra.run.dir`
    (outputs/<date>/<time>) made unique. `check=False` leaves the checks to the caller (the
    tuner checks its trials' configs instead)."""
    node = compose(overrides, return_hydra_config=True)
    run_dir = Path(run_dir) if run_dir is not None else make_run_dir(Path(str(node.hydra.run.dir)))
    cfg = dataclasses.replace(to_run_config(node, list(overrides)), run_dir=str(run_dir))
    if check:  # the parameter hides `check`: its two parts
        check_config(cfg)
        check_environment(cfg)
    return cfg


def make_run_dir(base: Path) -> Path:
    """`base`, or `base-1`, `base-2`, ... when it exists already (two runs in one second)."""
    run_dir, n = base, 1
    while run_dir.exists():
        run_dir, n = Path(f"{base}-{n}"), n + 1
    return run_dir


def scrub_run_files(hydra_dir: str | Path, cfg: Config) -> None:
    """Rewrite the files Hydra keeps of a run (.hydra/*.yaml) without the secrets of `cfg`
    (checkpoint.storage_options and data.storage_options values under secret keys, user:password
    in checkpoint.dir, data.path and data.val_path)."""
    ck, d = cfg.checkpoint, cfg.data
    options = {"checkpoint": ck.storage_options, "data": d.storage_options}
    secrets = secret_values(options, ck.dir, d.path, d.val_path)
    if not secrets:
        return
    for path in Path(hydra_dir).glob("*.yaml"):
        text = path.read_text()
        clean = scrub(text, secrets)
        if clean != text:
            path.write_text(clean)


def ensure_logging() -> None:
    """Show step lines when the caller has not configured logging (a notebook, a script)."""
    logger = logging.getLogger("rayhybrid")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)


def fail(err: Exception, code: int) -> None:
    print(f"rayhybrid: error: {err}", file=sys.stderr, flush=True)
    sys.exit(code)


@contextlib.contextmanager
def exit_codes(prog: str):
    """What the command-line entry points do with errors: a config error is one line and exit
    code 2, another rayhybrid error one line and 1, Ctrl-C a line and 130."""
    try:
        yield
    except ConfigError as err:
        fail(err, CONFIG_EXIT_CODE)
    except RayHybridError as err:
        fail(err, 1)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
