"""`python -m rayhybrid [overrides...]`: compose the config with Hydra, validate, train.

Exit codes: 0 done, 1 the run failed, 2 bad configuration (one line on stderr), 130 interrupted
(Ctrl-C, or SIGTERM, which first saves a checkpoint after the step in progress).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from pathlib import Path

from rayhybrid.errors import CONFIG_EXIT_CODE, ConfigError, RayHybridError

log = logging.getLogger("rayhybrid")
HYDRA_FLAGS_WITHOUT_RUN = ("--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--shell-completion", "-sc")


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


def task(node) -> None:
    from hydra.core.hydra_config import HydraConfig

    from rayhybrid.config.compose import scrub_run_files, to_config
    from rayhybrid.config.validate import validate
    from rayhybrid.controller import Controller

    with exit_codes("rayhybrid"):
        hydra = HydraConfig.get()
        cfg = dataclasses.replace(to_config(node, list(hydra.overrides.task)), run_dir=hydra.runtime.output_dir)
        if hydra.output_subdir:
            scrub_run_files(Path(cfg.run_dir) / hydra.output_subdir, cfg)
        validate(cfg)
        summary = Controller(cfg).run()
    if summary["status"] == "interrupted":  # SIGTERM: stopped after a final checkpoint
        sys.exit(130)
    if summary["status"] != "completed":
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    import hydra

    from rayhybrid.config.compose import conf_dir, load_config, normalize_overrides, register_schema

    argv = list(sys.argv[1:] if argv is None else argv)
    multirun = any(a in ("-m", "--multirun") for a in argv)
    if not multirun and not any(a.split("=")[0] in HYDRA_FLAGS_WITHOUT_RUN for a in argv):
        # Fail fast, in one line, before Hydra creates a run directory or Ray starts.
        try:
            load_config([a for a in argv if not a.startswith("-")])
        except ConfigError as err:
            fail(err, CONFIG_EXIT_CODE)
    register_schema()
    sys.argv = [sys.argv[0], *normalize_overrides(argv)]
    hydra.main(config_path=conf_dir(), config_name="config", version_base="1.3")(task)()


if __name__ == "__main__":
    main()
