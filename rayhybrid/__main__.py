"""`python -m rayhybrid [overrides...]`: compose the config with Hydra, check it, train.

Every check runs once per job (`rayhybrid.preflight.check`), before Hydra makes a run directory
or Ray starts; a sweep's jobs are all checked before the first one trains.

Exit codes: 0 done, 1 the run failed, 2 bad configuration (one line on stderr), 130 interrupted
(Ctrl-C, or SIGTERM, which first saves a checkpoint after the step in progress).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rayhybrid.errors import CONFIG_EXIT_CODE, ConfigError
from rayhybrid.preflight import exit_codes, fail

if TYPE_CHECKING:
    from rayhybrid.config.schema import Config

log = logging.getLogger("rayhybrid")
# Hydra flags that change which config is composed (or take a separate value): the checks
# before Hydra compose rayhybrid's own conf/ and would misjudge them, so Hydra checks alone.
HYDRA_FLAGS_WITH_CONFIG = (
    "--config-dir",
    "-cd",
    "--config-name",
    "-cn",
    "--config-path",
    "-cp",
    "--experimental-rerun",
)
HYDRA_FLAGS_WITHOUT_RUN = ("--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--shell-completion", "-sc")
CHECKED: list[Config] = []
"""The configs `main` checked before Hydra started (one per job of a sweep), without their run
directory: a job whose config is one of them is not checked again (the environment's checks
run once per command)."""
STARTED: list[float | None] = []
"""When the command started (`main` sets it): where the first job's start-up begins; a later
job of a sweep starts its own when it begins."""


def task(node) -> None:
    from hydra.core.hydra_config import HydraConfig

    from rayhybrid.driver.controller import Controller
    from rayhybrid.plan.dry_run import check_run_host_memory
    from rayhybrid.preflight import check, scrub_run_files, to_run_config

    with exit_codes("rayhybrid"):
        hydra = HydraConfig.get()
        composed = to_run_config(node, list(hydra.overrides.task))
        cfg = dataclasses.replace(composed, run_dir=hydra.runtime.output_dir)
        if hydra.output_subdir:
            scrub_run_files(Path(cfg.run_dir) / hydra.output_subdir, cfg)
        if composed not in CHECKED:  # a config main could not check first (Hydra's own flags or sweeper)
            check(cfg)
        check_run_host_memory(cfg)
        summary = Controller(cfg, started=STARTED.pop() if STARTED else None).run()
    if summary["status"] == "interrupted":  # SIGTERM: stopped after a final checkpoint
        sys.exit(130)
    if summary["status"] != "completed":
        sys.exit(1)


def sweep_jobs(overrides: list[str]) -> list[list[str]] | None:
    """The overrides of each job of a `--multirun` sweep, as Hydra's basic sweeper will run them
    (`train.lr=1e-3,3e-3` -> two jobs; `range(...)`, `choice(...)` and `glob(...)` expand too).
    None when another sweeper is chosen or the sweep uses a syntax only such a sweeper reads
    (`interval(...)`): Hydra then checks the jobs itself. A malformed override: ConfigError."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra._internal.utils import create_config_search_path
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, OverrideParseException

    from rayhybrid.config.compose import conf_dir

    if any(o.lstrip("+~").startswith(("hydra/sweeper", "hydra.sweeper")) for o in overrides):
        return None
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(conf_dir()))
    try:
        parsed = OverridesParser.create(config_loader=loader).parse_overrides(overrides)
    except OverrideParseException as err:
        raise ConfigError("overrides", " ".join(line.strip() for line in str(err).splitlines()[:1])) from None
    try:
        (jobs,) = BasicSweeper.split_arguments(parsed, None)
    except HydraException:
        return None
    return jobs


def check_sweep(overrides: list[str]) -> None:
    """Check every job of a sweep before the first one starts: a bad value in the last job
    fails now, in one line, not after the others have trained."""
    from rayhybrid.preflight import load_config

    jobs = sweep_jobs(overrides)
    for num, job in enumerate(jobs or ()):
        try:
            CHECKED.append(load_config(job))
        except ConfigError as err:
            shown = " ".join(o for o in job if not o.lstrip("+~").startswith("hydra"))
            where = f" (sweep job #{num}: {shown})" if len(jobs) > 1 else ""
            raise ConfigError(err.setting, f"{err.message}{where}") from None


def main(argv: list[str] | None = None) -> None:
    import hydra

    from rayhybrid.config.compose import conf_dir, normalize_overrides, register_schema
    from rayhybrid.preflight import load_config
    from rayhybrid.trainer.startup import command_started

    CHECKED.clear()
    STARTED[:] = [command_started() if argv is None else time.time()]  # called in-process: from now
    argv = list(sys.argv[1:] if argv is None else argv)
    multirun = any(a in ("-m", "--multirun") for a in argv)
    flags = {a.split("=")[0] for a in argv if a.startswith("-")}
    if not flags & {*HYDRA_FLAGS_WITHOUT_RUN, *HYDRA_FLAGS_WITH_CONFIG}:
        # Fail fast, in one line, before Hydra creates a run (or sweep) directory or Ray starts.
        overrides = [a for a in argv if not a.startswith("-")]
        try:
            if multirun:
                register_schema()
                check_sweep(normalize_overrides(overrides))
            else:
                CHECKED.append(load_config(overrides))
        except ConfigError as err:
            fail(err, CONFIG_EXIT_CODE)
    register_schema()
    try:  # --cfg job and the other Hydra flags skip the checks above, not the spelling's
        sys.argv = [sys.argv[0], *normalize_overrides(argv)]
    except ConfigError as err:
        fail(err, CONFIG_EXIT_CODE)
    hydra.main(config_path=conf_dir(), config_name="config", version_base="1.3")(task)()


if __name__ == "__main__":
    main()
