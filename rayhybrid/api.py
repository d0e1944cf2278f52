"""The Python entry point, for notebooks and scripts.

    import rayhybrid
    summary = rayhybrid.train(["+topology=dp2_pp2_tp2", "train.steps=20"])
    print(summary["final_loss"])

Takes the same overrides as the command line and returns the `summary.json` contents.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from rayhybrid.config.compose import compose, scrub_run_files, to_config
from rayhybrid.config.validate import validate


def _ensure_logging() -> None:
    """Show step lines when the caller has not configured logging (a notebook, a script)."""
    logger = logging.getLogger("rayhybrid")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)


def make_run_dir(base: Path) -> Path:
    """`base`, or `base-1`, `base-2`, ... when it exists already (two runs in one second)."""
    run_dir, n = base, 1
    while run_dir.exists():
        run_dir, n = Path(f"{base}-{n}"), n + 1
    return run_dir


def train(overrides: Sequence[str] = (), *, run_dir: str | Path | None = None) -> dict:
    """Compose the config from `overrides` (e.g. ``["+topology=dp2", "train.steps=20"]``),
    validate it, train, and return the summary. Raises `rayhybrid.errors.ConfigError` for bad
    input. `run_dir` defaults to `hydra.run.dir` (outputs/<date>/<time>), made unique."""
    from omegaconf import OmegaConf

    from rayhybrid.driver.controller import Controller

    overrides = list(overrides)
    node = compose(overrides, return_hydra_config=True)
    run_dir = Path(run_dir) if run_dir is not None else make_run_dir(Path(str(node.hydra.run.dir)))
    cfg = dataclasses.replace(to_config(node), run_dir=str(run_dir))
    validate(cfg)
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), hydra_dir / "config.yaml")
    OmegaConf.save(OmegaConf.create(overrides), hydra_dir / "overrides.yaml")
    scrub_run_files(hydra_dir, cfg)
    _ensure_logging()
    return Controller(cfg).run()
