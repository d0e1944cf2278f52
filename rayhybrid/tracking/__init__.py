"""Experiment tracking: a run's config, step records, events and summary in Weights & Biases
and MLflow (`metrics.wandb`, `metrics.mlflow`). The driver logs; the workers never do.

    validate(cfg)                                   # static checks: ConfigError (exit code 2)
    trackers = Trackers.open(cfg, run_dir, store)   # starts (or continues) each enabled tracker's run
    trackers.step(metrics)                          # a step record, as metrics.jsonl has it
    trackers.event(record)                          # checkpoint, resume, restart, resize, preemption, ...
    trackers.close(summary)                         # summary.json's dict; ends the runs with its status

A resumed run continues the same tracker runs: their ids are kept in `tracking.json` at the root
of the checkpoint store. Trackers need steps that only grow, so a step already logged (trained
again after a recovery, or after a resume from an older checkpoint) is not logged again.

What reaches a tracker has gone through `rayhybrid.storage.redact` and `scrub` first: no
storage secret, no user:password of a URL. A tracker that fails during the run (a network
down, a server gone) logs one warning and records nothing more; training goes on. A setting
that cannot work fails `Trackers.open` with a ConfigError naming it.

Neither wandb nor mlflow is imported unless its tracker is enabled. Not thread-safe: one
thread (the driver's) calls these; MLflow's calls run on a thread of their own, so a slow
server never holds up a step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import netrc
import os
import queue
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from urllib.request import url2pathname

from rayhybrid.config.schema import Config
from rayhybrid.errors import ConfigError
from rayhybrid.storage import checkpoints as checkpoint_store
from rayhybrid.storage.store import Store, one_line, redact, redact_url, scrub, secret_values

log = logging.getLogger("rayhybrid")

TRACKING_FILE = "tracking.json"
"""At the root of the checkpoint store: the tracker runs' ids and the last step each logged."""
WANDB_MODES = ("online", "offline")
FINISH_TIMEOUT_S = 60.0
"""How long closing waits for a tracker's last records to go out before giving up on them."""
CONNECT_TIMEOUT_S = 10.0
"""How long `open` tries to reach an MLflow server (http://, https://) before a ConfigError."""
SKIPPED_KEYS = ("step", "time", "samples")
"""Step record keys that are not metrics: the x axis, the wall clock (the trackers keep their
own), the sample ranges read."""
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
BARE_URIS = ("databricks", "databricks-uc", "uc")
"""Tracking URIs without a `:` that MLflow reads as a store, not as a path."""
MLFLOW_STATUS = {"completed": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
WANDB_EXIT_CODE = {"completed": 0, "failed": 1, "interrupted": 130}
"""W&B marks a run finished for 0 and failed otherwise; 130 is the CLI's exit code when interrupted."""
MLFLOW_PARAM_MAX = 6000
STOP = ("stop",)
MLFLOW_TAG_MAX = 5000
MLFLOW_BATCH_PARAMS = 100
MLFLOW_BATCH_METRICS = 1000


# -- validation ---------------------------------------------------------------------------------


def validate(cfg: Config) -> None:
    """Raise ConfigError for a tracker setting that cannot work: an unknown W&B mode, an empty
    project or experiment, a tracker's package not installed, W&B online without credentials,
    a database tracking URI that mlflow-skinny cannot use. Imports a package only when its
    tracker is enabled."""
    wb, ml = cfg.metrics.wandb, cfg.metrics.mlflow
    if wb.enabled:
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
        _require("wandb", "metrics.wandb")
        if wb.mode == "online" and not _wandb_credentials():
            raise ConfigError(
                "metrics.wandb.mode",
                "online needs a W&B API key: set WANDB_API_KEY (or run `wandb login`), "
                "or use metrics.wandb.mode=offline and `wandb sync` later",
            )
    if ml.enabled:
        if not ml.experiment.strip():
            raise ConfigError("metrics.mlflow.experiment", "must not be empty; set metrics.mlflow.experiment=<name>")
        _require("mlflow", "metrics.mlflow")
        uri = mlflow_tracking_uri(cfg)
        scheme = urlsplit(uri).scheme.split("+")[0]
        if scheme in DATABASE_SCHEMES and not _importable("sqlalchemy"):
            raise ConfigError(
                "metrics.mlflow.tracking_uri",
                f"{scheme}:// needs the full mlflow package (mlflow-skinny has no database store): "
                "pip install mlflow, or use a file: path or an http:// tracking server",
            )


def _require(package: str, setting: str) -> None:
    if not _importable(package):
        raise ConfigError(
            setting, f"{setting}.enabled=true needs the {package} package: pip install 'rayhybrid[{package}]'"
        )


def _importable(package: str) -> bool:
    try:
        __import__(package)
    except ImportError:
        return False
    return True


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


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def step_scalars(metrics: dict) -> dict[str, float]:
    """A step record's numeric figures: None, strings and lists left out, `peak_mb` as
    `memory_mb/<rank/stage/phase>` (as in TensorBoard), other dicts as `<key>/<sub key>`."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key in SKIPPED_KEYS:
            continue
        if isinstance(value, dict):
            prefix = "memory_mb" if key == "peak_mb" else key
            out.update({name: n for name, v in flatten(value, "/", prefix).items() if (n := _number(v)) is not None})
        elif (n := _number(value)) is not None:
            out[key] = n
    return out


def _scrubbed(value: Any, secrets: list[str]) -> Any:
    if isinstance(value, str):
        return scrub(value, secrets)
    if isinstance(value, dict):
        return {scrub(str(k), secrets): _scrubbed(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_scrubbed(v, secrets) for v in value]
    return value


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


# -- the trackers ----------------------------------------------------------------------------------


class _Tracker:
    """One tracker's run. `last_step` is the last step it has (from this process or an earlier
    one); `stepped` whether this process logged a step yet."""

    key = ""
    """Its entry in tracking.json."""
    name = ""
    setting = ""

    def __init__(self) -> None:
        self.active = True
        self.last_step = 0
        self.stepped = False

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

    @property
    def run_id(self) -> str:
        raise NotImplementedError

    def state(self) -> dict:
        raise NotImplementedError

    def log_step(self, step: int, scalars: dict[str, float], wall: float | None) -> None:
        raise NotImplementedError

    def log_event(self, kind: str, scalars: dict[str, float], record: dict) -> None:
        raise NotImplementedError

    def finish(self, summary: dict, status: str, events: list[dict]) -> None:
        raise NotImplementedError

    def abandon(self) -> None:
        """Another tracker failed to open: end this one quietly (a run just created goes away)."""

    def release(self) -> None:
        """The run ends with this tracker off after a failure: free what it holds."""


class _Wandb(_Tracker):
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

    @classmethod
    def open(cls, cfg: Config, run_dir: Path, saved: dict | None, config: dict) -> _Wandb:
        import wandb

        wb = cfg.metrics.wandb
        if saved and (saved.get("project"), saved.get("entity", "")) != (wb.project, wb.entity):
            log.info("metrics.wandb: project or entity changed since tracking.json was written; a new W&B run")
            saved = None
        wanted = {
            "silent": True,
            "console": "off",  # the driver's own log has the step lines; nothing to capture
            "disable_git": True,
            "save_code": False,
            "x_disable_meta": True,  # no command line (it may hold secrets), host or environment
            "x_disable_stats": True,  # the driver's machine is not where training runs
            "finish_timeout": FINISH_TIMEOUT_S,
        }
        settings = wandb.Settings(**{k: v for k, v in wanted.items() if k in wandb.Settings.model_fields})
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
            run.config.update(config, allow_val_change=True)
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


class _MLflow(_Tracker):
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

    @classmethod
    def open(cls, cfg: Config, run_dir: Path, saved: dict | None, config: dict, secrets: list[str]) -> _MLflow:
        ml = cfg.metrics.mlflow
        uri = mlflow_tracking_uri(cfg)
        shown = redact_url(uri)
        if is_file_store(uri):
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # mlflow 3 refuses its file store without it
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
        try:
            from mlflow import MlflowClient

            client = MlflowClient(tracking_uri=uri)
            experiment = client.get_experiment_by_name(ml.experiment)
            if experiment is None:
                experiment_id = client.create_experiment(ml.experiment)
            elif experiment.lifecycle_stage != "active":
                raise ConfigError(
                    "metrics.mlflow.experiment",
                    f"experiment {ml.experiment!r} is deleted at {shown}; restore it "
                    "(mlflow experiments restore) or choose another name",
                )
            else:
                experiment_id = experiment.experiment_id
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - an unsupported URI, a missing package, a server error
            raise ConfigError(
                "metrics.mlflow.tracking_uri", f"{shown}: {scrub(one_line(err), secrets)}; check the URI and the server"
            ) from None
        if saved and (saved.get("tracking_uri"), saved.get("experiment")) != (shown, ml.experiment):
            log.info("metrics.mlflow: tracking URI or experiment changed since tracking.json was written; a new run")
            saved = None
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
                tags = {"rayhybrid.run_dir": str(run_dir), "rayhybrid.checkpoint_dir": config["checkpoint.dir"]}
                run = client.create_run(experiment_id, run_name=ml.run_name or run_dir.name, tags=tags)
            else:
                client.update_run(run.info.run_id, status="RUNNING")
            tracker = cls(client, shown, ml.experiment, experiment_id, run.info.run_id, created)
            if not created:
                history = client.get_metric_history(tracker.run_id, "loss")
                tracker.last_step = max([int(saved.get("last_step", 0))] + [m.step for m in history])
                tracker.earlier_events = tracker._download_json("events.json") or []
            tracker._log_params(config, run.data.params if not created else {})
        except Exception as err:  # noqa: BLE001
            if tracker is not None:  # no run left behind, and its thread stops
                tracker.abandon()
            raise ConfigError(
                "metrics.mlflow", f"could not start the MLflow run at {shown} ({scrub(one_line(err), secrets)})"
            ) from None
        log.info(
            "MLflow: %s run %s in experiment %r at %s%s",
            "started" if created else "continuing",
            tracker.run_id,
            ml.experiment,
            shown,
            "" if created else f" from step {tracker.last_step + 1}",
        )
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
        numbers = {k: n for k, v in flat.items() if (n := _number(v)) is not None and math.isfinite(n)}
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


class Trackers:
    """The enabled trackers of one run; with none enabled, an object that does nothing."""

    def __init__(self, trackers: list[_Tracker], store: Store | None = None, saved: dict | None = None) -> None:
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
    def open(cls, cfg: Config, run_dir: Path, store: Store | None) -> Trackers:
        """Start every enabled tracker's run, or continue the one `tracking.json` in `store` names
        (no store: always a new run), and log the config (redacted). Raises ConfigError when a
        tracker cannot start: a bad setting, no credentials, a server out of reach."""
        validate(cfg)
        if not (cfg.metrics.wandb.enabled or cfg.metrics.mlflow.enabled):
            return cls([])
        run_dir = Path(run_dir).resolve()
        settings = dataclasses.asdict(cfg)
        secrets = secret_values(settings, *_strings(settings))
        config = _scrubbed(flatten(redact(settings), "."), secrets)
        # Continue the runs tracking.json names only when there is a checkpoint to resume: a run
        # that starts over from step 1 (its first attempt failed before a checkpoint) is new.
        saved = _read_state(store) if store is not None and checkpoint_store.latest(store) is not None else {}
        trackers: list[_Tracker] = []
        try:
            if cfg.metrics.mlflow.enabled:
                trackers.append(_MLflow.open(cfg, run_dir, saved.get("mlflow"), config, secrets))
            if cfg.metrics.wandb.enabled:
                trackers.append(_Wandb.open(cfg, run_dir, saved.get("wandb"), config))
        except BaseException:
            for tracker in trackers:
                tracker.abandon()
            raise
        self = cls(trackers, store, saved)
        self.secrets = secrets
        self._save()
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.trackers)

    @property
    def runs(self) -> dict[str, str]:
        """Each tracker's run id: {"wandb": ..., "mlflow": ...}."""
        return {t.key: t.run_id for t in self.trackers}

    def step(self, metrics: dict) -> None:
        """One step record: its numeric figures at step=metrics["step"], unless the tracker has
        that step already (trained again after a recovery or a resume)."""
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
        clean = _scrubbed(redact(record), self.secrets)
        kind = str(clean.get("event", "event"))
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.events.append(clean)
        scalars = {f"events/{kind}": float(self.counts[kind])}
        for key, value in clean.items():
            if key != "event" and (n := _number(value)) is not None:
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
        clean = _scrubbed(redact(summary), self.secrets)
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
        """tracking.json: the runs' ids, the last step each has and the event counts."""
        if self.store is None:
            return
        data = {**self.saved, **{t.key: t.state() for t in self.trackers}, "events": self.counts}
        try:
            self.store.write_bytes(self.store.join(TRACKING_FILE), (json.dumps(data, indent=1) + "\n").encode())
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
