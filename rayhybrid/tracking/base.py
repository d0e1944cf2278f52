"""What every tracker implements (`Tracker`), what `open` gets (`Start`), and what the trackers
share: the step record's scalars, flattening, secret scrubbing, the package checks."""

from __future__ import annotations

import dataclasses
import functools
import logging
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from rayhybrid.config.schema import Config
from rayhybrid.errors import ConfigError
from rayhybrid.storage import checkpoints as checkpoint_store
from rayhybrid.storage.store import Store, one_line, scrub

log = logging.getLogger("rayhybrid")

FINISH_TIMEOUT_S = 60.0
"""How long closing waits for a tracker's last records to go out before giving up on them."""
SKIPPED_KEYS = ("step", "time", "samples")
"""Step record keys that are not metrics: the x axis, the wall clock (the trackers keep their
own), the sample ranges read."""


@dataclasses.dataclass
class Start:
    """What a tracker's `open` gets besides the config."""

    run_dir: Path
    """The run directory, resolved."""
    config: dict
    """Every setting, flattened with `.`, redacted and scrubbed: the run's config as logged."""
    secrets: list[str]
    """The secret values in the settings: scrubbed from what a tracker reports."""
    store: Store | None = None
    saved: dict = dataclasses.field(default_factory=dict)
    """tracking.json when the run resumes, else empty: each tracker's entry under its `key`."""

    checkpoint_found: bool | None = None
    """Whether the store holds a checkpoint, when the caller has looked already (None: look)."""

    @functools.cached_property
    def resuming(self) -> bool:
        """Whether the run continues from a checkpoint in the store. Only then do the trackers
        continue the runs of earlier processes: a run that starts over from step 1 (its first
        attempt failed before a checkpoint) is new."""
        if self.store is None:
            return False
        if self.checkpoint_found is not None:
            return self.checkpoint_found
        return checkpoint_store.latest(self.store) is not None


class Tracker(ABC):
    """One tracker's run in this process. `Trackers` opens it, hands it each step it does not
    have yet (`last_step`: the replay rule is `Trackers`'), each event, and the summary at the
    end. After `open`, what it raises turns it off (`fail`): a tracker never fails training."""

    key = ""
    """Its entry in tracking.json and in `Trackers.runs`; empty: it keeps nothing there."""
    name = ""
    setting = ""
    """The setting that enables it, for messages."""

    def __init__(self) -> None:
        self.active = True
        self.last_step = 0
        """The last step it has, logged by this process or an earlier one of the run."""
        self.stepped = False
        """Whether this process logged a step yet."""

    @staticmethod
    @abstractmethod
    def enabled(cfg: Config) -> bool:
        """Whether the config turns this tracker on."""

    @classmethod
    def check_settings(cls, cfg: Config) -> None:
        """The checks of its settings alone (it is enabled): ConfigError. No package, file,
        network or environment variable is looked at. Nothing by default."""

    @classmethod
    def check_environment(cls, cfg: Config) -> None:
        """What it needs where the driver runs (it is enabled, its settings passed): its package
        installed, credentials; ConfigError. Once per command. Nothing by default."""

    @classmethod
    @abstractmethod
    def open(cls, cfg: Config, start: Start) -> Tracker:
        """Start its run, or continue the one `start.saved[key]` names; ConfigError when it cannot."""

    @abstractmethod
    def log_step(self, step: int, scalars: dict[str, float], wall: float | None) -> None:
        """A step's scalars (`step_scalars`); `wall`: when the driver had the step."""

    @abstractmethod
    def log_event(self, kind: str, scalars: dict[str, float], record: dict) -> None:
        """An event record (redacted) and its scalars (`events/<kind>`, `<kind>/<field>`)."""

    @abstractmethod
    def finish(self, summary: dict, status: str, events: list[dict]) -> None:
        """The summary (redacted) and this process's events; ends the run as `status` says."""

    @property
    def run_id(self) -> str:
        return ""

    def state(self) -> dict:
        """Its entry in tracking.json (with a `key`): what a resumed run needs to continue it."""
        return {}

    def fail(self, doing: str, err: BaseException) -> None:
        """Called on any error after open: one warning, then the tracker is off for this run."""
        if self.active:
            self.active = False
            log.warning(
                "%s: %s failed while %s (%s); it records nothing more of this run, training goes on",
                self.setting,
                self.name,
                doing,
                one_line(err),
            )

    def abandon(self) -> None:
        """Another tracker failed to open: end this one quietly (a run just created goes away)."""

    def release(self) -> None:
        """The run ends with this tracker off after a failure: free what it holds."""


# -- what the trackers get -------------------------------------------------------------------------


def flatten(value: dict, sep: str, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> one level, keys joined with `sep`; an empty dict disappears."""
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(item, dict):
            out.update(flatten(item, sep, name))
        else:
            out[name] = item
    return out


def number(value: Any) -> float | None:
    """A number as a float; None for anything else (booleans too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def step_scalars(metrics: dict) -> dict[str, float]:
    """A step record's numeric figures: None, strings and lists left out, `peak_mb` as
    `memory_mb/<rank/stage/phase>`, other dicts as `<key>/<sub key>`. The one list of names:
    every tracker logs these (TensorBoard with its prefixes, `tensorboard.tag`)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key in SKIPPED_KEYS:
            continue
        if isinstance(value, dict):
            prefix = "memory_mb" if key == "peak_mb" else key
            out.update({name: n for name, v in flatten(value, "/", prefix).items() if (n := number(v)) is not None})
        elif (n := number(value)) is not None:
            out[key] = n
    return out


def scrubbed(value: Any, secrets: list[str]) -> Any:
    """`value` (nested dicts and lists too) with every secret in its strings and keys replaced."""
    if isinstance(value, str):
        return scrub(value, secrets)
    if isinstance(value, dict):
        return {scrub(str(k), secrets): scrubbed(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrubbed(v, secrets) for v in value]
    return value


def strings(value: Any) -> list[str]:
    """Every string in `value`, nested dicts and lists included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in strings(v)]
    return []


# -- validation -----------------------------------------------------------------------------------


def require(package: str, setting: str) -> None:
    """ConfigError unless `package` (a tracker's extra) imports."""
    if not importable(package):
        raise ConfigError(
            setting, f"{setting}.enabled=true needs the {package} package: pip install 'rayhybrid[{package}]'"
        )


def importable(package: str) -> bool:
    try:
        __import__(package)
    except ImportError:
        return False
    return True
