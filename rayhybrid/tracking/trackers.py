"""`Trackers`: the enabled trackers of one run, fed every record; the one rule for steps trained
again; `tracking.json`, the state a resumed run continues the tracker runs from."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from rayhybrid.config.schema import Config
from rayhybrid.storage.store import Store, one_line, redact, secret_values, write_json
from rayhybrid.tracking.base import Start, Tracker, flatten, number, scrubbed, step_scalars, strings
from rayhybrid.tracking.mlflow import MLflowTracker
from rayhybrid.tracking.tensorboard import TensorBoardTracker
from rayhybrid.tracking.wandb import WandbTracker

log = logging.getLogger("rayhybrid")

TRACKING_FILE = "tracking.json"
"""At the root of the checkpoint store: the tracker runs' ids and the last step each logged."""
BACKENDS: tuple[type[Tracker], ...] = (MLflowTracker, WandbTracker, TensorBoardTracker)
"""The one registry of trackers: a new backend is a `Tracker` subclass in its own module, added
here. In the order they are checked and start (and get each record)."""


def check_settings(cfg: Config) -> None:
    """Raise ConfigError for a tracker setting that cannot work, from the settings alone: an
    unknown W&B mode, an empty project or experiment, a bad tag. Reads nothing else."""
    for backend in BACKENDS:
        if backend.enabled(cfg):
            backend.check_settings(cfg)


def check_environment(cfg: Config) -> None:
    """Raise ConfigError for an enabled tracker that cannot start here: its package not
    installed, W&B online without credentials, a database tracking URI that mlflow-skinny cannot
    use. Imports a package only when its tracker is enabled. Once per command
    (`rayhybrid.preflight.check_environment`), after `check_settings`."""
    for backend in BACKENDS:
        if backend.enabled(cfg):
            backend.check_environment(cfg)


class Trackers:
    """The enabled trackers of one run; with none enabled, an object that does nothing."""

    def __init__(self, trackers: list[Tracker], store: Store | None = None, saved: dict | None = None) -> None:
        self.trackers = trackers
        self.store = store
        self.saved = dict(saved or {})
        self.secrets: list[str] = []
        self.counts: dict[str, int] = dict(self.saved.get("events") or {})
        """Events of each kind so far, earlier processes of the run included."""
        self.events: list[dict] = []
        """This process's events, redacted."""
        self.closed = False
        self.save_failed = False

    @classmethod
    def open(cls, cfg: Config, run_dir: Path, store: Store | None, checkpoint_found: bool | None = None) -> Trackers:
        """Start every enabled tracker's run, or continue the one `tracking.json` in `store` names
        (no store: always a new run), and log the config (redacted). `checkpoint_found`: whether
        the store holds a checkpoint, when the caller has looked (else the store is listed).
        Raises ConfigError when a tracker cannot start (a server out of reach, a run it cannot
        create). The settings, packages and credentials were checked once, before the command
        started anything (`check_settings`, `check_environment`, run by `rayhybrid.preflight`)."""
        backends = [backend for backend in BACKENDS if backend.enabled(cfg)]
        if not backends:
            return cls([])
        settings = dataclasses.asdict(cfg)
        secrets = secret_values(settings, *strings(settings))
        config = scrubbed(flatten(redact(settings), "."), secrets)
        start = Start(Path(run_dir).resolve(), config, secrets, store, checkpoint_found=checkpoint_found)
        if any(backend.key for backend in backends) and start.resuming:
            start.saved = _read_state(store)
        trackers: list[Tracker] = []
        try:
            for backend in backends:
                trackers.append(backend.open(cfg, start))
        except BaseException:
            for tracker in trackers:
                tracker.abandon()
            raise
        self = cls(trackers, store, start.saved)
        self.secrets = secrets
        self._save()
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.trackers)

    @property
    def runs(self) -> dict[str, str]:
        """Each tracker's run id: {"wandb": ..., "mlflow": ...}."""
        return {t.key: t.run_id for t in self.trackers if t.key}

    def step(self, metrics: dict) -> None:
        """One step record: its numeric figures at step=metrics["step"], unless the tracker has
        that step already (trained again after a recovery or a resume). The one rule for steps
        trained again: each tracker keeps the values it logged first."""
        if not self.trackers:
            return
        step = int(metrics["step"])
        scalars = step_scalars(metrics)
        for tracker in self.trackers:
            if not tracker.active or step <= tracker.last_step:
                continue
            try:
                tracker.log_step(step, scalars, metrics.get("time"))
            except Exception as err:  # noqa: BLE001 - a tracker never fails training
                tracker.fail(f"logging step {step}", err)
                continue
            tracker.last_step, tracker.stepped = step, True

    def event(self, record: dict) -> None:
        """A non-step record: `events/<kind>` counts the kind's events so far (over the whole run),
        `<kind>/<field>` holds each of its numeric fields; the records themselves go to MLflow's
        events.json artifact and W&B's `event_log` table when the run closes."""
        if not self.trackers:
            return
        clean = scrubbed(redact(record), self.secrets)
        kind = str(clean.get("event", "event"))
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.events.append(clean)
        scalars = {f"events/{kind}": float(self.counts[kind])}
        for key, value in clean.items():
            if key != "event" and (n := number(value)) is not None:
                scalars[f"{kind}/{key}"] = n
        for tracker in self.trackers:
            if tracker.active:
                try:
                    tracker.log_event(kind, scalars, clean)
                except Exception as err:  # noqa: BLE001
                    tracker.fail(f"logging a {kind} event", err)
        self._save()

    def close(self, summary: dict) -> None:
        """The run's summary (summary.json's dict); ends each run as summary["status"] says:
        completed, failed or interrupted. Waits at most FINISH_TIMEOUT_S per tracker."""
        if self.closed or not self.trackers:
            self.closed = True
            return
        self.closed = True
        clean = scrubbed(redact(summary), self.secrets)
        status = str(summary.get("status", "failed"))
        self._save()
        for tracker in self.trackers:
            if not tracker.active:
                tracker.release()
                continue
            try:
                tracker.finish(clean, status, self.events)
            except Exception as err:  # noqa: BLE001
                tracker.fail("finishing", err)

    def _save(self) -> None:
        """tracking.json: the runs' ids, the last step each has and the event counts (only when a
        tracker keeps state there: TensorBoard alone writes none)."""
        kept = {t.key: t.state() for t in self.trackers if t.key}
        if self.store is None or not kept:
            return
        data = {**self.saved, **kept, "events": self.counts}
        try:
            write_json(self.store, TRACKING_FILE, data)
        except Exception as err:  # noqa: BLE001 - the checkpoint store's trouble is for checkpoints to report
            if not self.save_failed:
                self.save_failed = True
                log.warning(
                    "could not write %s (%s); a resumed run will start new tracker runs", TRACKING_FILE, one_line(err)
                )


def _read_state(store: Store | None) -> dict:
    if store is None:
        return {}
    try:
        data = json.loads(store.read_bytes(store.join(TRACKING_FILE)))
    except FileNotFoundError:
        return {}
    except Exception as err:  # noqa: BLE001
        log.warning("could not read %s (%s); starting new tracker runs", TRACKING_FILE, one_line(err))
        return {}
    return data if isinstance(data, dict) else {}
