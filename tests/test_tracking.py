"""Experiment tracking (rayhybrid/tracking/): what W&B (offline), MLflow (a file store) and
TensorBoard receive from realistic records, read back from what they wrote; a rewind and a
resumed run; secrets; failures; the one-line errors. No Ray, no training."""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import struct
import sys
import threading
import time
from pathlib import Path

import pytest

from rayhybrid.config.schema import (
    CheckpointConfig,
    Config,
    MetricsConfig,
    MLflowConfig,
    TopologyConfig,
    WandbConfig,
)
from rayhybrid.errors import ConfigError
from rayhybrid.storage import checkpoints as cs
from rayhybrid.storage.store import Store
from rayhybrid.tracking import (
    TRACKING_FILE,
    Trackers,
    check_environment,
    check_settings,
    mlflow_tracking_uri,
    step_scalars,
)

SECRETS = ("AKIAXX", "SECRETXX", "SUPERSECRET1", "KEYVALUE22")


def config(tmp_path: Path, wandb: dict | None = None, mlflow: dict | None = None) -> Config:
    """A config with secrets in checkpoint.dir and checkpoint.storage_options."""
    return Config(
        topology=TopologyConfig(dp=2),
        checkpoint=CheckpointConfig(
            dir="s3://AKIAXX:SECRETXX@bucket/x",
            storage_options={"key": "KEYVALUE22", "secret": "SUPERSECRET1", "endpoint_url": "http://127.0.0.1:9000"},
        ),
        metrics=MetricsConfig(
            wandb=WandbConfig(**{"enabled": False, "mode": "offline", "project": "tests", **(wandb or {})}),
            mlflow=MLflowConfig(
                **{"enabled": False, "tracking_uri": str(tmp_path / "mlruns"), "experiment": "tests", **(mlflow or {})}
            ),
        ),
    )


def with_metrics(cfg: Config, **sections: dict) -> Config:
    changes = {name: dataclasses.replace(getattr(cfg.metrics, name), **fields) for name, fields in sections.items()}
    return dataclasses.replace(cfg, metrics=dataclasses.replace(cfg.metrics, **changes))


def step_record(step: int, loss: float, **extra) -> dict:
    """A step record as the driver writes it to metrics.jsonl."""
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "step_time_s": 0.25,
        "tokens_per_s": 4096.0,
        "consumed_samples": 16 * step,
        "num_microbatches": 2,
        "dp": 2,
        "pp": 2,
        "tp": 2,
        "samples": [[16 * (step - 1), 8], [16 * (step - 1) + 8, 8]],
        "bubble": None,
        "peak_mb": {"rank0/stage0/forward": 10.0 + step, "rank1/stage1/backward": 20.0},
        "tflops": 0.002,
        "mfu": None,
        "time": time.time(),
        **extra,
    }


def mlflow_client(tmp_path: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())


def history(client, run_id: str, key: str) -> dict[int, float]:
    points = client.get_metric_history(run_id, key)
    steps = [m.step for m in points]
    assert len(steps) == len(set(steps)), f"{key}: a step logged twice: {sorted(steps)}"
    return {m.step: m.value for m in points}


# -- reading a W&B offline run: its .wandb file is a LevelDB-style log of protobuf Records ---------


def wandb_records(run_dir: Path) -> list:
    """The records of the one offline run under `run_dir`/wandb."""
    from wandb.proto.wandb_internal_pb2 import Record

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    records, chunks, pos, block = [], [], 7, 32 * 1024
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # the rest of the block is padding
            pos += left
            continue
        chunks.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = Record()
            record.ParseFromString(b"".join(chunks))
            records.append(record)
            chunks = []
    return records


def item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def wandb_run(run_dir: Path) -> dict:
    """What one offline run holds: its id, config, history rows by step, summary, exit code."""
    out = {"history": {}, "config": {}, "summary": {}, "exit_code": None}
    for r in wandb_records(run_dir):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["id"], out["tags"], out["name"] = r.run.run_id, list(r.run.tags), r.run.display_name
            out["config"].update({item_key(u): json.loads(u.value_json) for u in r.run.config.update})
        elif kind == "config":
            out["config"].update({item_key(u): json.loads(u.value_json) for u in r.config.update})
        elif kind == "history":
            row = {item_key(i): json.loads(i.value_json) for i in r.history.item}
            out["history"][r.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "summary":
            out["summary"].update({item_key(u): json.loads(u.value_json) for u in r.summary.update})
        elif kind == "exit":
            out["exit_code"] = r.exit.exit_code
    return out


# -- both trackers: a rewind, a resumed run, secrets -------------------------------------------------


def test_both_trackers_log_steps_events_and_summary_once_across_a_rewind_and_a_resume(tmp_path, monkeypatch):
    for name in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # a secret on the command line must not reach W&B's metadata either
    monkeypatch.setattr(sys, "argv", ["rayhybrid", "checkpoint.storage_options.secret=SUPERSECRET1"])
    cfg = config(tmp_path, wandb={"enabled": True, "tags": ("ci",), "group": "g"}, mlflow={"enabled": True})
    store = Store.open(tmp_path / "checkpoints")

    first = first_process(cfg, tmp_path, store)
    second_process(cfg, tmp_path, store, first)
    check_mlflow_run(tmp_path, first)
    check_wandb_runs(tmp_path, first)

    # No secret anywhere: the W&B runs, W&B's own directories, the MLflow store, tracking.json.
    for path in tmp_path.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            leaked = [s for s in SECRETS if s.encode() in data]
            assert not leaked, f"{path} holds {leaked}"


def first_process(cfg: Config, tmp_path: Path, store: Store) -> Trackers:
    """The first process: steps 1..6, a checkpoint at 4, a failure in step 7, recovery from 4:
    steps 5..8 again; stopped by SIGTERM."""
    first = Trackers.open(cfg, tmp_path / "run1", store)
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"
    for step in range(1, 7):
        first.step(step_record(step, loss=10.0 - step))
    first.event(
        {
            "event": "checkpoint",
            "step": 4,
            "path": "s3://AKIAXX:SECRETXX@bucket/x/step_00000004",
            "blocked_s": 0.5,
            "upload_s": 1.5,
            "async": True,
        }
    )
    first.event({"event": "fault_injected", "step": 7, "kind": "kill", "rank": 3, "phase": "step"})
    first.event(
        {
            "event": "restart",
            "restart": 1,
            "failed_step": 7,
            "cause": "rank 3 died",
            "resume_step": 4,
            "replaced_ranks": [3],
            "dp_before": 2,
            "dp_after": 2,
            "total_s": 4.25,
        }
    )
    for step in range(5, 9):
        first.step(step_record(step, loss=20.0 - step, **({"val_loss": 7.5} if step == 8 else {})))
    first.close({"status": "interrupted", "steps": 8, "final_loss": 12.0, "error": "stopped by SIGTERM after step 8"})
    saved = json.loads((tmp_path / "checkpoints" / TRACKING_FILE).read_text())
    assert saved["mlflow"]["last_step"] == saved["wandb"]["last_step"] == 8
    assert saved["events"] == {"checkpoint": 1, "fault_injected": 1, "restart": 1}
    return first


def second_process(cfg: Config, tmp_path: Path, store: Store, first: Trackers) -> None:
    """The second process resumes from the checkpoint of step 6: steps 7 and 8 are trained again.
    (Without a committed checkpoint, a run starts over and so do its tracker runs: below.)"""
    path = cs.begin(store, 6)
    store.write_bytes(f"{path}/.metadata", b"m")
    cs.commit(store, path, {"step": 6})
    second = Trackers.open(cfg, tmp_path / "run2", store)
    assert second.runs == first.runs
    second.event({"event": "resume", "step": 6, "checkpoint": "s3://AKIAXX:SECRETXX@bucket/x/step_00000006"})
    for step in range(7, 11):
        second.step(step_record(step, loss=30.0 - step))
    summary = {
        "status": "completed",
        "steps": 10,
        "final_loss": 20.0,
        "best_val_loss": 7.5,
        "restarts": 1,
        "mean_tokens_per_s": 4096.0,
        "mfu": None,
        "checkpoint_dir": "s3://REDACTED@bucket/x",
        "checkpoints": {"saved": 3, "failed": 0},
        "recoveries": [{"restart": 1}],
    }
    second.close(summary)
    assert json.loads((tmp_path / "checkpoints" / TRACKING_FILE).read_text())["mlflow"]["last_step"] == 10


def check_mlflow_run(tmp_path: Path, first: Trackers) -> None:
    """MLflow: one run; every step once (5 and 6 as first logged), events, summary, status, config."""
    client = mlflow_client(tmp_path)
    experiment = client.get_experiment_by_name("tests")
    (run,) = client.search_runs([experiment.experiment_id])
    run_id = run.info.run_id
    assert first.runs["mlflow"] == run_id and run.info.status == "FINISHED"
    loss = history(client, run_id, "loss")
    assert loss == {1: 9, 2: 8, 3: 7, 4: 6, 5: 5, 6: 4, 7: 13, 8: 12, 9: 21, 10: 20}
    assert history(client, run_id, "val_loss") == {8: 7.5}
    assert history(client, run_id, "memory_mb/rank0/stage0/forward")[10] == 20.0
    assert history(client, run_id, "consumed_samples")[9] == 144
    assert not {"mfu", "bubble", "samples", "time", "step"} & set(run.data.metrics)
    assert history(client, run_id, "events/restart") == {6: 1}  # after step 6, before the steps trained again
    assert history(client, run_id, "restart/total_s") == {6: 4.25}
    assert history(client, run_id, "events/checkpoint") == {6: 1}
    assert history(client, run_id, "checkpoint/blocked_s") == {6: 0.5}
    assert history(client, run_id, "events/resume") == {9: 1}  # the first step the second process logs
    assert run.data.metrics["summary/final_loss"] == 20.0
    assert run.data.metrics["summary/checkpoints/saved"] == 3
    assert "summary/mfu" not in run.data.metrics
    params = run.data.params
    assert params["topology.dp"] == "2" and params["metrics.wandb.tags"] == '["ci"]'
    assert params["checkpoint.dir"] == "s3://REDACTED@bucket/x"
    assert params["checkpoint.storage_options.secret"] == params["checkpoint.storage_options.key"] == "REDACTED"
    assert run.data.tags["mlflow.runName"] == "run1" and run.data.tags["rayhybrid.run_dir"] == str(
        (tmp_path / "run1").resolve()
    )
    events = json.loads(Path(client.download_artifacts(run_id, "events.json", str(tmp_path / "dl"))).read_text())
    assert [e["event"] for e in events] == ["checkpoint", "fault_injected", "restart", "resume"]
    assert events[0]["path"] == "s3://REDACTED@bucket/x/step_00000004"
    logged = json.loads(Path(client.download_artifacts(run_id, "summary.json", str(tmp_path / "dl"))).read_text())
    assert logged["status"] == "completed" and logged["recoveries"] == [{"restart": 1}]


def check_wandb_runs(tmp_path: Path, first: Trackers) -> None:
    """W&B: two offline runs with one id; the second starts after the first's last step."""
    one, two = wandb_run(tmp_path / "run1"), wandb_run(tmp_path / "run2")
    assert one["id"] == two["id"] == first.runs["wandb"]
    assert one["tags"] == ["ci"] and one["name"] == "run1"
    assert sorted(one["history"]) == [1, 2, 3, 4, 5, 6, 7, 8] and sorted(two["history"]) == [9, 10]
    assert [one["history"][s]["loss"] for s in range(1, 9)] == [9, 8, 7, 6, 5, 4, 13, 12]
    assert one["history"][8]["val_loss"] == 7.5 and "val_loss" not in one["history"][7]
    assert one["history"][3]["memory_mb/rank1/stage1/backward"] == 20.0
    assert not {"mfu", "bubble", "samples", "time", "step"} & set(one["history"][3])
    assert one["history"][6]["events/restart"] == 1 and one["history"][6]["restart/failed_step"] == 7
    assert two["history"][9]["events/resume"] == 1 and two["history"][10]["loss"] == 20
    assert one["config"]["topology.dp"] == 2 and one["config"]["checkpoint.dir"] == "s3://REDACTED@bucket/x"
    assert one["config"]["checkpoint.storage_options.secret"] == "REDACTED"
    assert one["summary"]["summary/status"] == "interrupted" and one["exit_code"] == 130
    assert two["summary"]["summary/status"] == "completed" and two["exit_code"] == 0
    assert two["summary"]["summary/checkpoints/saved"] == 3 and two["summary"]["summary/best_val_loss"] == 7.5
    (table,) = glob.glob(str(tmp_path / "run1" / "wandb" / "offline-run-*" / "files" / "media" / "table" / "*.json"))
    rows = json.loads(Path(table).read_text())["data"]
    assert [row[0] for row in rows] == ["checkpoint", "fault_injected", "restart"]
    assert json.loads(rows[2][1])["cause"] == "rank 3 died"


# -- failures during the run ------------------------------------------------------------------------


class FakeWandbRun:
    """Stands in for a wandb Run (a real offline init costs seconds): records what it gets."""

    def __init__(self, fail_from: int | None = None, **kwargs) -> None:
        self.id, self.project, self.entity, self.starting_step = kwargs["id"], kwargs["project"], "", 0
        self.dir, self.url = "/nowhere/files", None
        self.fail_from = fail_from
        self.logged: list[tuple[int, dict]] = []
        self.config = type("Config", (), {"update": lambda *a, **k: None})()
        self.summary: dict = {}
        self.exit_code = None

    def log(self, data: dict, step: int) -> None:
        if self.fail_from is not None and step >= self.fail_from:
            raise ConnectionError("wandb-core is gone")
        self.logged.append((step, data))

    def finish(self, exit_code: int) -> None:
        self.exit_code = exit_code


def test_a_tracker_that_fails_mid_run_warns_once_and_the_others_go_on(tmp_path, monkeypatch, caplog):
    import wandb

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs: list[FakeWandbRun] = []
    monkeypatch.setattr(wandb, "init", lambda **kw: runs.append(FakeWandbRun(fail_from=3, **kw)) or runs[-1])
    cfg = config(tmp_path, wandb={"enabled": True}, mlflow={"enabled": True})
    caplog.set_level(logging.WARNING, logger="rayhybrid")

    # W&B fails at step 3: MLflow logs every step; no store, so no tracking.json.
    trackers = Trackers.open(cfg, tmp_path / "run", None)
    for step in range(1, 6):
        trackers.step(step_record(step, loss=float(step)))
    trackers.event({"event": "checkpoint", "step": 5, "path": "/x", "blocked_s": 0.1, "upload_s": 0.2, "async": True})
    trackers.close({"status": "failed", "steps": 5, "error": "rank 1: boom"})
    assert [step for step, _ in runs[0].logged] == [1, 2] and runs[0].exit_code is None
    client = mlflow_client(tmp_path)
    run = client.get_run(trackers.runs["mlflow"])
    assert sorted(history(client, run.info.run_id, "loss")) == [1, 2, 3, 4, 5]
    assert run.info.status == "FAILED" and run.data.tags["rayhybrid.error"] == "rank 1: boom"
    warnings = [r.getMessage() for r in caplog.records if r.name == "rayhybrid" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("metrics.wandb: W&B failed while logging step 3 (")

    # MLflow's server goes away at step 2: W&B logs every step, training never sees an error.
    caplog.clear()
    monkeypatch.setattr(wandb, "init", lambda **kw: runs.append(FakeWandbRun(**kw)) or runs[-1])
    trackers = Trackers.open(cfg, tmp_path / "run", None)
    assert trackers.runs["mlflow"] != run.info.run_id  # no store: a new run
    trackers.step(step_record(1, loss=1.0))
    (mlflow_tracker,) = [t for t in trackers.trackers if t.key == "mlflow"]
    sent = threading.Event()
    mlflow_tracker.queue.put(("call", sent.set, ()))  # step 1 goes out first
    assert sent.wait(30)

    def unreachable(*args, **kwargs):
        raise ConnectionError("Connection refused")

    monkeypatch.setattr(mlflow_tracker.client, "log_batch", unreachable)
    for step in range(2, 5):
        trackers.step(step_record(step, loss=float(step)))
    trackers.close({"status": "completed", "steps": 4})
    assert [step for step, _ in runs[-1].logged] == [1, 2, 3, 4] and runs[-1].exit_code == 0
    assert runs[-1].summary["summary/status"] == "completed"
    warnings = [r.getMessage() for r in caplog.records if r.name == "rayhybrid" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("metrics.mlflow: MLflow failed while logging (")
    assert not mlflow_tracker.thread.is_alive()


def test_wandb_events_before_the_first_step_join_its_row_or_else_the_summary(tmp_path, monkeypatch):
    import wandb

    runs: list[FakeWandbRun] = []
    monkeypatch.setattr(wandb, "init", lambda **kw: runs.append(FakeWandbRun(**kw)) or runs[-1])
    cfg = config(tmp_path, wandb={"enabled": True})
    trackers = Trackers.open(cfg, tmp_path / "run", None)
    trackers.event({"event": "resume", "step": 4, "checkpoint": "/c/step_00000004"})
    trackers.step(step_record(5, loss=1.0))
    trackers.event({"event": "checkpoint", "step": 5, "path": "/c/step_00000005", "blocked_s": 0.5})
    trackers.close({"status": "completed", "steps": 5})
    assert [(step, "events/resume" in row, "events/checkpoint" in row) for step, row in runs[0].logged] == [
        (5, True, False),
        (5, False, True),
        (5, False, False),  # the event_log table
    ]
    assert runs[0].logged[1][1]["checkpoint/blocked_s"] == 0.5

    # A process that ends before its first step: no row of its own (it would take step 6)
    trackers = Trackers.open(cfg, tmp_path / "run", None)
    trackers.event({"event": "resume", "step": 5, "checkpoint": "/c/step_00000005"})
    trackers.close({"status": "failed", "steps": 5})
    assert runs[1].logged == [] and runs[1].summary["events/resume"] == 1 and runs[1].exit_code == 1


def test_a_tracker_that_cannot_start_leaves_no_run_of_the_others_behind(tmp_path, monkeypatch):
    import wandb

    def refused(**kwargs):
        raise PermissionError("permission denied: entity 'team'")

    monkeypatch.setattr(wandb, "init", refused)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = config(tmp_path, wandb={"enabled": True}, mlflow={"enabled": True})
    with pytest.raises(ConfigError) as err:
        Trackers.open(cfg, tmp_path / "run", Store.open(tmp_path / "checkpoints"))
    assert str(err.value) == (
        "metrics.wandb: could not start the W&B run (PermissionError: permission denied: entity 'team'); "
        f"check that {(tmp_path / 'run').resolve()} is writable"
    )
    client = mlflow_client(tmp_path)
    experiment = client.get_experiment_by_name("tests")
    assert client.search_runs([experiment.experiment_id]) == []  # the MLflow run just created is deleted
    assert not (tmp_path / "checkpoints" / TRACKING_FILE).exists()


def test_an_mlflow_run_that_fails_half_way_through_its_start_is_not_left_behind(tmp_path, monkeypatch):
    from rayhybrid import tracking

    def refused(self, config, existing):
        raise PermissionError("no permission to log parameters")

    monkeypatch.setattr(tracking._MLflow, "_log_params", refused)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match="could not start the MLflow run .* no permission to log parameters"):
        Trackers.open(config(tmp_path, mlflow={"enabled": True}), tmp_path / "run", None)
    client = mlflow_client(tmp_path)
    assert client.search_runs([client.get_experiment_by_name("tests").experiment_id]) == []


def test_a_run_that_starts_over_without_a_checkpoint_starts_a_new_tracker_run(tmp_path, monkeypatch):
    """A first attempt that failed before its first checkpoint: the retry trains from step 1
    again, so it gets a new MLflow run (with the old one's steps it would skip 1..3)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = config(tmp_path, mlflow={"enabled": True})
    store = Store.open(tmp_path / "checkpoints")
    first = Trackers.open(cfg, tmp_path / "run1", store)
    for step in (1, 2, 3):
        first.step(step_record(step, loss=5.0))
    first.close({"status": "failed"})
    assert (tmp_path / "checkpoints" / TRACKING_FILE).exists()
    second = Trackers.open(cfg, tmp_path / "run2", store)
    second.step(step_record(1, loss=4.0))
    second.close({"status": "completed"})
    assert second.runs["mlflow"] != first.runs["mlflow"]
    assert history(mlflow_client(tmp_path), second.runs["mlflow"], "loss") == {1: 4.0}


# -- TensorBoard: a tracker like the others ---------------------------------------------------------


def tensorboard_points(event_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a directory's TensorBoard event files (TFRecord frames of `Event`
    protobufs), read without TensorBoard: tag -> [(step, value), ...], oldest file first."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(event_dir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12 : i + 12 + length])
            i += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def tensorboard_process(cfg: Config, run_dir: Path, steps: list, store: Store, event: dict | None = None) -> dict:
    """One driver process with only TensorBoard on, fed as the driver feeds it: the observer's
    figures, then the trackers. `steps`: (step, loss) in order; `event` after the sixth. Returns
    the observer's figures."""
    from rayhybrid.driver.observe import Observer

    observer = Observer(cfg, run_dir)
    observer.after_workers_start([{"rank": 0, "dp": 0, "pp": 0, "tp": 0}], {"device_name": "cpu"})
    trackers = Trackers.open(cfg, run_dir, store)
    history = []
    for i, (step, loss) in enumerate(steps):
        history.append(
            observer.before_step(step_record(step, loss, **({"val_loss": loss / 2} if step % 4 == 0 else {})))
        )
        trackers.step(history[-1])
        if i == 5 and event:
            trackers.event(event)
    figures = {}
    observer.before_close(figures, history)
    trackers.close({"status": "completed", "steps": steps[-1][0]})
    return figures


def test_tensorboard_writes_each_step_once_across_a_rewind_and_a_resume(tmp_path):
    """As the driver feeds it: the observer's figures, then the trackers. A recovery trains steps
    5 and 6 again, and a resume into the same run directory steps 7 and 8: TensorBoard keeps the
    values first written, like W&B and MLflow (the Observer used to write every step it saw),
    under the tags it always had; nothing of it goes into tracking.json."""
    cfg = config(tmp_path)
    cfg = dataclasses.replace(cfg, metrics=dataclasses.replace(cfg.metrics, tensorboard=True, peak_tflops=0.001))
    run_dir, store = tmp_path / "run", Store.open(tmp_path / "checkpoints")
    restart = {"event": "restart", "restart": 1, "failed_step": 7, "resume_step": 4, "total_s": 4.25}
    figures = tensorboard_process(
        cfg, run_dir, [(s, 10.0 - s) for s in range(1, 7)] + [(s, 20.0 - s) for s in range(5, 9)], store, restart
    )
    assert figures["tensorboard"] == str(run_dir / "tensorboard")
    points = tensorboard_points(run_dir / "tensorboard")
    assert points["train/loss"] == [(1, 9), (2, 8), (3, 7), (4, 6), (5, 5), (6, 4), (7, 13), (8, 12)]
    for tag, logged in points.items():
        assert len({step for step, _ in logged}) == len(logged), f"{tag}: a step written twice: {logged}"
    assert points["val/loss"] == [(4, 3.0), (8, 6.0)]
    assert [step for step, _ in points["train/mfu"]] == list(range(1, 9))
    assert dict(points["memory_mb/rank0/stage0/forward"])[3] == 13.0
    assert {f"train/{key}" for key in ("lr", "grad_norm", "tokens_per_s", "step_time_s", "tflops", "dp")} <= set(points)
    assert not {"train/bubble", "train/samples", "train/time", "train/step"} & set(points)

    # A resume from the checkpoint of step 6 into the same run directory: 7 and 8 are not written again.
    path = cs.begin(store, 6)
    store.write_bytes(f"{path}/.metadata", b"m")
    cs.commit(store, path, {"step": 6})
    tensorboard_process(cfg, run_dir, [(s, 30.0 - s) for s in range(7, 11)], store)
    loss = tensorboard_points(run_dir / "tensorboard")["train/loss"]
    assert loss == [(1, 9), (2, 8), (3, 7), (4, 6), (5, 5), (6, 4), (7, 13), (8, 12), (9, 21), (10, 20)]
    assert not (tmp_path / "checkpoints" / TRACKING_FILE).exists()

    # A run that starts over from step 1 (no checkpoint in its store) writes every step again.
    tensorboard_process(cfg, run_dir, [(1, 1.0)], Store.open(tmp_path / "other"))
    assert tensorboard_points(run_dir / "tensorboard")["train/loss"][-1] == (1, 1.0)


# -- no tracker, bad settings -----------------------------------------------------------------------


def test_no_tracker_enabled_is_a_no_op_that_imports_neither_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing either would raise ImportError
    monkeypatch.setitem(sys.modules, "mlflow", None)
    store = Store.open(tmp_path / "checkpoints")
    trackers = Trackers.open(config(tmp_path), tmp_path / "run", store)
    assert not trackers.enabled
    trackers.step(step_record(1, loss=1.0))
    trackers.event({"event": "checkpoint", "step": 1})
    trackers.close({"status": "completed"})
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "run").exists()


def no_wandb_credentials(monkeypatch, tmp_path) -> None:
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))


@pytest.mark.parametrize(
    "change, hide, message",
    [
        (
            {"wandb": {"enabled": True, "mode": "onlin"}},
            None,
            "metrics.wandb.mode: unknown value 'onlin'; choose one of: online, offline",
        ),
        (
            {"wandb": {"enabled": True}},
            "wandb",
            "metrics.wandb: metrics.wandb.enabled=true needs the wandb package: pip install 'rayhybrid[wandb]'",
        ),
        (
            {"mlflow": {"enabled": True}},
            "mlflow",
            "metrics.mlflow: metrics.mlflow.enabled=true needs the mlflow package: pip install 'rayhybrid[mlflow]'",
        ),
        (
            {"wandb": {"enabled": True, "project": " "}},
            None,
            "metrics.wandb.project: must not be empty; set metrics.wandb.project=<name>",
        ),
        (
            {"wandb": {"enabled": True, "project": "team/p"}},
            None,
            "metrics.wandb.project: 'team/p' may not contain /; choose another name",
        ),
        (
            {"mlflow": {"enabled": True, "experiment": ""}},
            None,
            "metrics.mlflow.experiment: must not be empty; set metrics.mlflow.experiment=<name>",
        ),
        (
            {"mlflow": {"enabled": True, "tracking_uri": "sqlite:///mlflow.db"}},
            "sqlalchemy",
            (
                "metrics.mlflow.tracking_uri: sqlite:// needs the full mlflow package (mlflow-skinny has no database "
                "store): pip install mlflow, or use a file: path or an http:// tracking server"
            ),
        ),
        (
            {"wandb": {"enabled": True, "mode": "online"}},
            None,
            (
                "metrics.wandb.mode: online needs a W&B API key: set WANDB_API_KEY (or run `wandb login`), "
                "or use metrics.wandb.mode=offline and `wandb sync` later"
            ),
        ),
    ],
)
def test_the_checks_say_which_setting_and_the_fix(tmp_path, monkeypatch, change, hide, message):
    """A setting alone is refused by `check_settings`, which looks at nothing else; a package
    or a credential missing here by `check_environment`; and the entry points' checks
    (`rayhybrid.preflight.check`) refuse both before any tracker starts."""
    from rayhybrid.preflight import check

    no_wandb_credentials(monkeypatch, tmp_path)
    if hide:
        monkeypatch.setitem(sys.modules, hide, None)
    cfg = with_metrics(config(tmp_path), **change)
    environment = bool(hide) or "online needs" in message
    if environment:
        check_settings(cfg)  # the settings are fine: what is missing is here, on the driver
        with pytest.raises(ConfigError) as err:
            check_environment(cfg)
    else:
        with pytest.raises(ConfigError) as err:
            check_settings(cfg)
    assert str(err.value) == message
    with pytest.raises(ConfigError) as err:  # the run stops before any tracker starts
        check(cfg)
    assert str(err.value) == message and not (tmp_path / "run").exists()


def test_the_checks_accept_what_works(tmp_path, monkeypatch):
    no_wandb_credentials(monkeypatch, tmp_path)
    for cfg in (
        config(tmp_path, wandb={"enabled": True}, mlflow={"enabled": True}),  # offline, a file store
        with_metrics(config(tmp_path), wandb={"mode": "typo"}),  # disabled: not checked
    ):
        check_settings(cfg)
        check_environment(cfg)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    check_settings(config(tmp_path, wandb={"enabled": True, "mode": "online"}))
    check_environment(config(tmp_path, wandb={"enabled": True, "mode": "online"}))


def test_opening_the_trackers_checks_nothing_again(tmp_path, monkeypatch):
    """The checks run once per command, before the driver opens the trackers (they used to run
    again in `Trackers.open`)."""
    from rayhybrid.tracking import WandbTracker

    calls = []
    for name in ("check_settings", "check_environment"):
        monkeypatch.setattr(WandbTracker, name, classmethod(lambda cls, cfg, name=name: calls.append(name)))

    def opened(cls, cfg, start):
        raise RuntimeError("opened")

    monkeypatch.setattr(WandbTracker, "open", classmethod(opened))
    with pytest.raises(RuntimeError, match="opened"):
        Trackers.open(config(tmp_path, wandb={"enabled": True}), tmp_path / "run", None)
    assert calls == []


def test_an_mlflow_server_out_of_reach_stops_the_run_at_open(tmp_path):
    import socket

    with socket.socket() as sock:  # a port where nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = config(tmp_path, mlflow={"enabled": True, "tracking_uri": f"http://user:pw123@127.0.0.1:{port}"})
    with pytest.raises(ConfigError) as err:
        Trackers.open(cfg, tmp_path / "run", None)
    text = str(err.value)
    assert text.startswith(f"metrics.mlflow.tracking_uri: cannot reach http://REDACTED@127.0.0.1:{port} (")
    assert text.endswith("); start the server or fix the URI") and "pw123" not in text and "\n" not in text


def test_mlflow_tracking_uri(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = config(tmp_path)

    def uri(value: str) -> str:
        return mlflow_tracking_uri(with_metrics(cfg, mlflow={"tracking_uri": value}))

    assert uri("") == (tmp_path / "mlruns").as_uri()
    assert uri("runs/ml") == uri("file:runs/ml") == (tmp_path / "runs" / "ml").as_uri()
    assert uri("/srv/mlruns") == "file:///srv/mlruns"
    assert uri("http://mlflow:5000") == "http://mlflow:5000"
    assert uri("databricks") == "databricks" and uri("databricks://profile") == "databricks://profile"  # not paths
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://elsewhere:5000")
    assert uri("") == "http://elsewhere:5000"


def test_step_scalars():
    record = step_record(3, loss=2.0, val_loss=1.5, activation_mb={"rank0/stage0/forward": 4.0})
    scalars = step_scalars(record)
    assert scalars["loss"] == 2.0 and scalars["val_loss"] == 1.5 and scalars["dp"] == 2.0
    assert scalars["memory_mb/rank0/stage0/forward"] == 13.0 and scalars["activation_mb/rank0/stage0/forward"] == 4.0
    assert not {"step", "time", "samples", "mfu", "bubble", "peak_mb"} & set(scalars)
