"""MLflow (`metrics.mlflow`): the tracking URI, its settings' checks and its tracker. `import
mlflow` only happens when it is enabled."""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import socket
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import url2pathname

from rayhybrid.config.schema import Config
from rayhybrid.errors import ConfigError
from rayhybrid.storage.store import one_line, redact_url, scrub
from rayhybrid.tracking.base import FINISH_TIMEOUT_S, Start, Tracker, flatten, importable, number, require

log = logging.getLogger("rayhybrid")

CONNECT_TIMEOUT_S = 10.0
"""How long `open` tries to reach an MLflow server (http://, https://) before a ConfigError."""
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
BARE_URIS = ("databricks", "databricks-uc", "uc")
"""Tracking URIs without a `:` that MLflow reads as a store, not as a path."""
MLFLOW_STATUS = {"completed": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
MLFLOW_PARAM_MAX = 6000
MLFLOW_TAG_MAX = 5000
MLFLOW_BATCH_PARAMS = 100
MLFLOW_BATCH_METRICS = 1000
STOP = ("stop",)


def mlflow_tracking_uri(cfg: Config) -> str:
    """metrics.mlflow.tracking_uri, else MLFLOW_TRACKING_URI, else `file:<cwd>/mlruns`; a plain
    path (or a relative file: URI) becomes an absolute file: URI; `databricks` stays as it is."""
    uri = cfg.metrics.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri:
        return (Path.cwd() / "mlruns").as_uri()
    if uri in BARE_URIS:
        return uri
    parts = urlsplit(uri)
    if parts.scheme == "file":
        path = url2pathname(parts.path)
        return Path(path).expanduser().resolve().as_uri() if not os.path.isabs(path) else uri
    if not parts.scheme or len(parts.scheme) == 1:  # a path (or a Windows drive letter)
        return Path(uri).expanduser().resolve().as_uri()
    return uri


def is_file_store(uri: str) -> bool:
    return urlsplit(uri).scheme == "file"


def _reach(uri: str, shown: str) -> None:
    """A server (http://, https://) that does not answer within CONNECT_TIMEOUT_S: ConfigError."""
    parts = urlsplit(uri)
    if parts.scheme in ("http", "https"):
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            socket.create_connection((parts.hostname, port), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as err:
            raise ConfigError(
                "metrics.mlflow.tracking_uri",
                f"cannot reach {shown} ({one_line(err)}); start the server or fix the URI",
            ) from None


def _experiment(uri: str, shown: str, name: str, secrets: list[str]):
    """A client of the tracking URI and the id of the experiment `name` (created when missing)."""
    try:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            return client, client.create_experiment(name)
        if experiment.lifecycle_stage != "active":
            raise ConfigError(
                "metrics.mlflow.experiment",
                f"experiment {name!r} is deleted at {shown}; restore it "
                "(mlflow experiments restore) or choose another name",
            )
        return client, experiment.experiment_id
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - an unsupported URI, a missing package, a server error
        raise ConfigError(
            "metrics.mlflow.tracking_uri", f"{shown}: {scrub(one_line(err), secrets)}; check the URI and the server"
        ) from None


class MLflowTracker(Tracker):
    """MLflow through an explicit `MlflowClient` (two runs in one process do not share the fluent
    API's global state); after `open`, every call runs on a thread of its own, in order."""

    key = "mlflow"
    name = "MLflow"
    setting = "metrics.mlflow"

    def __init__(self, client, uri: str, experiment: str, experiment_id: str, run_id: str, created: bool) -> None:
        super().__init__()
        self.client, self.uri, self.created = client, uri, created
        self.experiment, self.experiment_id, self._run_id = experiment, experiment_id, run_id
        self.earlier_events: list[dict] = []
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._work, name="rayhybrid-mlflow", daemon=True)
        self.thread.start()

    @staticmethod
    def enabled(cfg: Config) -> bool:
        return cfg.metrics.mlflow.enabled

    @classmethod
    def check_settings(cls, cfg: Config) -> None:
        """An empty experiment."""
        if not cfg.metrics.mlflow.experiment.strip():
            raise ConfigError("metrics.mlflow.experiment", "must not be empty; set metrics.mlflow.experiment=<name>")

    @classmethod
    def check_environment(cls, cfg: Config) -> None:
        """No mlflow package; a database URI (the setting's, else MLFLOW_TRACKING_URI) that
        mlflow-skinny cannot use. The server itself is reached when the run opens (`open`)."""
        require("mlflow", "metrics.mlflow")
        scheme = urlsplit(mlflow_tracking_uri(cfg)).scheme.split("+")[0]
        if scheme in DATABASE_SCHEMES and not importable("sqlalchemy"):
            raise ConfigError(
                "metrics.mlflow.tracking_uri",
                f"{scheme}:// needs the full mlflow package (mlflow-skinny has no database store): "
                "pip install mlflow, or use a file: path or an http:// tracking server",
            )

    @classmethod
    def open(cls, cfg: Config, start: Start) -> MLflowTracker:
        ml = cfg.metrics.mlflow
        uri = mlflow_tracking_uri(cfg)
        shown = redact_url(uri)
        if is_file_store(uri):
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # mlflow 3 refuses its file store without it
        _reach(uri, shown)
        client, experiment_id = _experiment(uri, shown, ml.experiment, start.secrets)
        saved = start.saved.get(cls.key)
        if saved and (saved.get("tracking_uri"), saved.get("experiment")) != (shown, ml.experiment):
            log.info("metrics.mlflow: tracking URI or experiment changed since tracking.json was written; a new run")
            saved = None
        run_name = ml.run_name or start.run_dir.name
        tracker = cls._start(client, shown, ml.experiment, experiment_id, saved, run_name, start)
        log.info(
            "MLflow: %s run %s in experiment %r at %s%s",
            "started" if tracker.created else "continuing",
            tracker.run_id,
            ml.experiment,
            shown,
            "" if tracker.created else f" from step {tracker.last_step + 1}",
        )
        return tracker

    @classmethod
    def _start(cls, client, shown: str, experiment: str, experiment_id: str, saved, run_name: str, start: Start):
        """Continue the run `saved` names (set back to RUNNING) when it is still there, else create
        one; log the params. On an error, no run is left behind."""
        run = tracker = None
        try:
            if saved:
                try:
                    run = client.get_run(saved["run_id"])
                except Exception as err:  # noqa: BLE001
                    log.warning(
                        "metrics.mlflow: run %s is gone (%s); starting a new one", saved["run_id"], one_line(err)
                    )
                if run is not None and run.info.lifecycle_stage != "active":
                    log.warning("metrics.mlflow: run %s is deleted; starting a new one", saved["run_id"])
                    run = None
            created = run is None
            if created:
                tags = {
                    "rayhybrid.run_dir": str(start.run_dir),
                    "rayhybrid.checkpoint_dir": start.config["checkpoint.dir"],
                }
                run = client.create_run(experiment_id, run_name=run_name, tags=tags)
            else:
                client.update_run(run.info.run_id, status="RUNNING")
            tracker = cls(client, shown, experiment, experiment_id, run.info.run_id, created)
            if not created:
                history = client.get_metric_history(tracker.run_id, "loss")
                tracker.last_step = max([int(saved.get("last_step", 0))] + [m.step for m in history])
                tracker.earlier_events = tracker._download_json("events.json") or []
            tracker._log_params(start.config, run.data.params if not created else {})
        except Exception as err:  # noqa: BLE001
            if tracker is not None:  # no run left behind, and its thread stops
                tracker.abandon()
            raise ConfigError(
                "metrics.mlflow", f"could not start the MLflow run at {shown} ({scrub(one_line(err), start.secrets)})"
            ) from None
        return tracker

    def _log_params(self, config: dict, existing: dict) -> None:
        """Params are written once: a resumed run adds new settings, a changed one keeps its first value."""
        from mlflow.entities import Param

        params = [
            Param(key[:250], (v if isinstance(v, str) else json.dumps(v))[:MLFLOW_PARAM_MAX])
            for key, v in config.items()
            if key[:250] not in existing
        ]
        for i in range(0, len(params), MLFLOW_BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=params[i : i + MLFLOW_BATCH_PARAMS])

    def _download_json(self, name: str):
        if name not in {a.path for a in self.client.list_artifacts(self.run_id)}:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            return json.loads(Path(self.client.download_artifacts(self.run_id, name, tmp)).read_text())

    # The thread: the calls in the order they came; metric batches queued up go out together.
    def _work(self) -> None:
        ahead = None  # an item taken from the queue while gathering metrics, next to run
        while True:
            item, ahead = (ahead, None) if ahead is not None else (self.queue.get(), None)
            if item[0] == "stop":
                return
            if not self.active:
                continue
            try:
                if item[0] == "metrics":
                    metrics = list(item[1])
                    while len(metrics) < MLFLOW_BATCH_METRICS:
                        try:
                            more = self.queue.get_nowait()
                        except queue.Empty:
                            break
                        if more[0] != "metrics":
                            ahead = more
                            break
                        metrics += more[1]
                    for i in range(0, len(metrics), MLFLOW_BATCH_METRICS):
                        self.client.log_batch(self.run_id, metrics=metrics[i : i + MLFLOW_BATCH_METRICS])
                else:
                    item[1](*item[2])
            except Exception as err:  # noqa: BLE001
                self.fail("logging", err)

    def _metrics(self, scalars: dict[str, float], step: int, wall: float | None) -> None:
        from mlflow.entities import Metric

        ms = int((wall if wall is not None else time.time()) * 1000)
        self.queue.put(("metrics", [Metric(key, value, ms, step) for key, value in scalars.items()]))

    @property
    def run_id(self) -> str:
        return self._run_id

    def event_step(self) -> int:
        """Where an event goes: the last step this process logged, else the next step."""
        return self.last_step if self.stepped else self.last_step + 1

    def state(self) -> dict:
        return {
            "run_id": self.run_id,
            "experiment_id": self.experiment_id,
            "experiment": self.experiment,
            "tracking_uri": self.uri,
            "last_step": self.last_step,
        }

    def log_step(self, step: int, scalars: dict[str, float], wall: float | None) -> None:
        self._metrics(scalars, step, wall)

    def log_event(self, kind: str, scalars: dict[str, float], record: dict) -> None:
        self._metrics(scalars, self.event_step(), None)

    def finish(self, summary: dict, status: str, events: list[dict]) -> None:
        flat = flatten(summary, "/", "summary")
        numbers = {k: n for k, v in flat.items() if (n := number(v)) is not None and math.isfinite(n)}
        self._metrics(numbers, self.last_step, None)
        if summary.get("error"):
            self.queue.put(
                ("call", self.client.set_tag, (self.run_id, "rayhybrid.error", summary["error"][:MLFLOW_TAG_MAX]))
            )
        self.queue.put(("call", self.client.log_dict, (self.run_id, self.earlier_events + events, "events.json")))
        self.queue.put(("call", self.client.log_dict, (self.run_id, summary, "summary.json")))
        self.queue.put(("call", self.client.set_terminated, (self.run_id, MLFLOW_STATUS.get(status, "FAILED"))))
        self.stop()

    def stop(self) -> None:
        self.queue.put(STOP)
        self.thread.join(FINISH_TIMEOUT_S)
        if self.thread.is_alive():
            self.fail(f"finishing (still busy after {FINISH_TIMEOUT_S:.0f}s)", TimeoutError("gave up"))

    def release(self) -> None:
        self.queue.put(STOP)

    def abandon(self) -> None:
        """Another tracker could not start: a run this process created is deleted, one it
        continued (set back to RUNNING) is ended as KILLED."""
        self.queue.put(STOP)
        try:
            if self.created:
                self.client.delete_run(self.run_id)
            else:
                self.client.set_terminated(self.run_id, status="KILLED")
        except Exception as err:  # noqa: BLE001
            log.debug("metrics.mlflow: could not abandon the run: %s", one_line(err))
