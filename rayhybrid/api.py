"""The Python entry point, for notebooks and scripts.

    import rayhybrid
    summary = rayhybrid.train(["+topology=dp2_pp2_tp2", "train.steps=20"])
    print(summary["final_loss"])

Takes the same overrides as the command line and returns the `summary.json` contents.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rayhybrid.preflight import ensure_logging, load_run, scrub_run_files


def train(overrides: Sequence[str] = (), *, run_dir: str | Path | None = None) -> dict:
    """Compose the config from `overrides` (e.g. ``["+topology=dp2", "train.steps=20"]``),
    check it (once: `rayhybrid.preflight.check`), train, and return the summary. Raises `rayhybrid.errors.ConfigError` for bad
    input. `run_dir` defaults to `hydra.run.dir` (outputs/<date>/<time>), made unique."""
    from omegaconf import OmegaConf

    from rayhybrid.driver.controller import Controller
    from rayhybrid.plan.dry_run import check_run_host_memory

    overrides = list(overrides)
    cfg = load_run(overrides, run_dir)
    check_run_host_memory(cfg)
    hydra_dir = Path(cfg.run_dir) / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), hydra_dir / "config.yaml")
    OmegaConf.save(OmegaConf.create(overrides), hydra_dir / "overrides.yaml")
    scrub_run_files(hydra_dir, cfg)
    ensure_logging()
    return Controller(cfg).run()
