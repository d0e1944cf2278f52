"""What every entry point does before a run: compose the config, give it the shape of
`model.init_from`, check it, and turn errors into exit codes.

    cfg = load_config(["+topology=dp2_pp2_tp2"])       # composed, shaped, checked
    cfg = load_run(overrides, run_dir=None)            # the same, with its run directory

`validate` is where the checks meet: the config's own (`rayhybrid.config.validate`), then each
concern's, which live with the concern: the model's spec, `fault.inject`, `checkpoint.dir`'s
store, the experiment trackers and the data files. This module sits above all of them, so the
configuration layer imports none. It never imports torch or Ray.

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

from rayhybrid.config import validate as config_checks
from rayhybrid.config.compose import compose, task_overrides, to_config
from rayhybrid.config.schema import Config
from rayhybrid.data.sources import validate_data
from rayhybrid.errors import CONFIG_EXIT_CODE, ConfigError, RayHybridError
from rayhybrid.faults import validate_faults
from rayhybrid.models.hf import resolve_init_from
from rayhybrid.models.registry import validate_model
from rayhybrid.storage.store import scrub, secret_values, validate_url
from rayhybrid.tracking import validate as validate_tracking


def validate(cfg: Config) -> None:
    """Every static check, each raising a one-line `ConfigError` naming the setting and the fix."""
    config_checks.validate(cfg)
    validate_model(cfg)
    validate_faults(cfg)
    validate_url("checkpoint.dir", cfg.checkpoint.dir)
    validate_tracking(cfg)
    validate_data(cfg)


def to_run_config(node, overrides: Sequence[str] | None = None) -> Config:
    """A composed node -> `Config` with the shape of `model.init_from`'s Hugging Face
    config.json (rayhybrid/models/hf.py). `overrides`: the command line's (default: the node's
    `hydra.overrides.task`), which must not contradict that shape."""
    if overrides is None:
        overrides = task_overrides(node)
    return resolve_init_from(to_config(node), overrides)


def load_config(overrides: Sequence[str] = ()) -> Config:
    """Compose, shape and validate (static checks only; cluster capacity is checked on connect)."""
    cfg = to_run_config(compose(overrides), overrides)
    validate(cfg)
    return cfg


def load_run(overrides: Sequence[str] = (), run_dir: str | Path | None = None, *, check: bool = True) -> Config:
    """`load_config` with the run directory set: `run_dir`, else `hydra.run.dir`
    (outputs/<date>/<time>) made unique. `check=False` leaves validation to the caller (the
    tuner validates each trial's config instead)."""
    node = compose(overrides, return_hydra_config=True)
    run_dir = Path(run_dir) if run_dir is not None else make_run_dir(Path(str(node.hydra.run.dir)))
    cfg = dataclasses.replace(to_run_config(node, list(overrides)), run_dir=str(run_dir))
    if check:
        validate(cfg)
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
