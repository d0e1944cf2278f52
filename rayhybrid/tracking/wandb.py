"""Weights & Biases (`metrics.wandb`): its settings' checks and its tracker. `import wandb` only
happens when it is enabled."""

from __future__ import annotations

import json
import logging
import netrc
import os
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from rayhybrid.config.schema import Config
from rayhybrid.errors import ConfigError
from rayhybrid.storage.store import one_line
from rayhybrid.tracking.base import FINISH_TIMEOUT_S, Start, Tracker, flatten, require

log = logging.getLogger("rayhybrid")

WANDB_MODES = ("online", "offline")
WANDB_EXIT_CODE = {"completed": 0, "failed": 1, "interrupted": 130}
"""W&B marks a run finished for 0 and failed otherwise; 130 is the CLI's exit code when interrupted."""


def _wandb_credentials() -> bool:
    """Whether wandb would find credentials without asking: WANDB_API_KEY, an identity token
    file, the .netrc entry `wandb login` writes, or its settings files."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    base_url = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    try:
        from wandb.sdk.lib import wbauth

        found = wbauth.authenticate_session(host=base_url, source="rayhybrid", prompt=False, update_session=False)
        return found is not None
    except Exception:  # noqa: BLE001 - wandb's internals differ (another version): read the .netrc
        try:
            path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
            return netrc.netrc(path).authenticators(urlsplit(base_url).hostname or "") is not None
        except (OSError, netrc.NetrcParseError):
            return False


def _settings(wandb):
    """What the run collects: nothing beyond what the driver logs (settings this wandb lacks are left out)."""
    wanted = {
        "silent": True,
        "console": "off",  # the driver's own log has the step lines; nothing to capture
        "disable_git": True,
        "save_code": False,
        "x_disable_meta": True,  # no command line (it may hold secrets), host or environment
        "x_disable_stats": True,  # the driver's machine is not where training runs
        "finish_timeout": FINISH_TIMEOUT_S,
    }
    return wandb.Settings(**{k: v for k, v in wanted.items() if k in wandb.Settings.model_fields})


class WandbTracker(Tracker):
    key = "wandb"
    name = "W&B"
    setting = "metrics.wandb"

    def __init__(self, run, project: str, entity: str, saved: dict | None) -> None:
        super().__init__()
        self.run, self.project, self.entity = run, project, entity
        self.created = saved is None
        self.pending: dict[str, float] = {}
        """Events before this process's first step: they go into that step's row (a row of their
        own would take a step number from the steps still to come)."""
        if saved:
            # W&B's own count is the truth for an online run; an offline run knows nothing of
            # what earlier processes logged, so tracking.json's count stands in.
            self.last_step = max(int(saved.get("last_step", 0)), int(run.starting_step or 0) - 1, 0)

    @staticmethod
    def enabled(cfg: Config) -> bool:
        return cfg.metrics.wandb.enabled

    @classmethod
    def check_settings(cls, cfg: Config) -> None:
        """An unknown mode, an empty or unusable project, a bad tag."""
        wb = cfg.metrics.wandb
        if wb.mode not in WANDB_MODES:
            raise ConfigError(
                "metrics.wandb.mode", f"unknown value {wb.mode!r}; choose one of: {', '.join(WANDB_MODES)}"
            )
        if not wb.project.strip():
            raise ConfigError("metrics.wandb.project", "must not be empty; set metrics.wandb.project=<name>")
        bad = sorted(set(wb.project) & set("/\\#?%:"))
        if bad:
            raise ConfigError(
                "metrics.wandb.project", f"{wb.project!r} may not contain {' '.join(bad)}; choose another name"
            )
        for tag in wb.tags:
            if not str(tag).strip() or len(str(tag)) > 64:
                raise ConfigError("metrics.wandb.tags", f"tag {tag!r}: a tag is 1 to 64 characters")

    @classmethod
    def check_environment(cls, cfg: Config) -> None:
        """No wandb package; online without credentials (WANDB_API_KEY, a token file, ~/.netrc)."""
        wb = cfg.metrics.wandb
        require("wandb", "metrics.wandb")
        if wb.mode == "online" and not _wandb_credentials():
            raise ConfigError(
                "metrics.wandb.mode",
                "online needs a W&B API key: set WANDB_API_KEY (or run `wandb login`), "
                "or use metrics.wandb.mode=offline and `wandb sync` later",
            )

    @classmethod
    def open(cls, cfg: Config, start: Start) -> WandbTracker:
        import wandb

        wb, run_dir, saved = cfg.metrics.wandb, start.run_dir, start.saved.get(cls.key)
        if saved and (saved.get("project"), saved.get("entity", "")) != (wb.project, wb.entity):
            log.info("metrics.wandb: project or entity changed since tracking.json was written; a new W&B run")
            saved = None
        settings = _settings(wandb)
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            wandb.setup(wandb.Settings(silent=True))  # its login messages follow the process's settings
            run = wandb.init(
                project=wb.project,
                entity=wb.entity or None,
                name=wb.name or (None if saved else run_dir.name),  # a resumed run keeps its name
                group=wb.group or None,
                tags=list(wb.tags) or None,
                dir=str(run_dir),
                id=saved["id"] if saved else uuid.uuid4().hex[:12],
                resume="allow",
                mode=wb.mode,
                settings=settings,
                reinit="create_new",
            )
            run.config.update(start.config, allow_val_change=True)
        except Exception as err:  # noqa: BLE001 - wandb raises many kinds; all mean the same here
            online = wb.mode == "online"
            fix = "check WANDB_API_KEY, the network and the project" if online else f"check that {run_dir} is writable"
            raise ConfigError("metrics.wandb", f"could not start the W&B run ({one_line(err)}); {fix}") from None
        tracker = cls(run, wb.project, wb.entity, saved)
        where = run.url if wb.mode == "online" else f"{Path(run.dir).parent} (upload it with `wandb sync`)"
        log.info(
            "W&B: %s run %s at %s%s",
            "continuing" if saved else "started",
            run.id,
            where,
            f" from step {tracker.last_step + 1}" if saved else "",
        )
        return tracker

    @property
    def run_id(self) -> str:
        return self.run.id

    def state(self) -> dict:
        return {
            "id": self.run.id,
            "project": self.project,
            "entity": self.entity,
            "last_step": self.last_step,
        }

    def log_step(self, step: int, scalars: dict[str, float], wall: float | None) -> None:
        self.run.log({**self.pending, **scalars}, step=step)
        self.pending = {}

    def log_event(self, kind: str, scalars: dict[str, float], record: dict) -> None:
        if self.stepped:  # W&B still holds the last step's row open: the event joins it
            self.run.log(scalars, step=self.last_step)
        else:
            self.pending.update(scalars)

    def finish(self, summary: dict, status: str, events: list[dict]) -> None:
        import wandb

        if events and self.stepped:
            table = wandb.Table(columns=["event", "record"], data=[[e.get("event"), json.dumps(e)] for e in events])
            self.run.log({"event_log": table}, step=self.last_step)
        flat = flatten(summary, "/", "summary")
        scalars = {k: v for k, v in flat.items() if isinstance(v, (int, float, str, bool))}
        self.run.summary.update({**self.pending, **scalars})
        self.run.finish(exit_code=WANDB_EXIT_CODE.get(status, 1))

    def abandon(self) -> None:
        try:
            self.run.finish(exit_code=1)
        except Exception as err:  # noqa: BLE001
            log.debug("metrics.wandb: could not finish the run: %s", one_line(err))
