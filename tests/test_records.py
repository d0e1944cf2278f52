"""What a run records (rayhybrid/records.py): interruption records, the run summary, the
metrics.jsonl/summary.json writer and mean throughput. No Ray."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest

from rayhybrid.config.schema import Config
from rayhybrid.driver.records import TIMINGS, Interruption, RunSummary, mean_throughput
from rayhybrid.driver.runlog import RunLog


def step_record(step: int, loss: float = 2.0, tokens_per_s: float = 1000.0, step_time_s: float = 0.5) -> dict:
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_s": tokens_per_s,
        "step_time_s": step_time_s,
        "consumed_samples": 16 * step,
    }


def summary(**changes) -> RunSummary:
    fields = {
        "topology": {"dp": 2},
        "model": {"name": "gpt_tiny"},
        "data": {"name": "synthetic"},
        "global_batch_size": 16,
        "micro_batch_size": 4,
        "run_dir": "/runs/a",
        "checkpoint_dir": "/runs/a/checkpoints",
    }
    return RunSummary(**{**fields, **changes})


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- Interruption -------------------------------------------------------------------------

TIMED = {
    "detect_s": 0.12345,
    "save_s": 1.00049,
    "teardown_s": 0.2,
    "place_s": 0.3333,
    "init_s": 2.5,
    "restore_s": 0.0004,
    "first_step_s": 0.75,
    "total_s": 5.55555,
}


def test_restart_record():
    intr = Interruption(
        "restart", "rank 1: boom", 9, 3, restart=2, dp_after=2, resume_step=5, replaced_ranks=[1], **TIMED
    ).but(healed="checkpoint", steps_redone=3)
    assert intr.restart_record() == {
        "event": "restart",
        "restart": 2,
        "failed_step": 9,
        "cause": "rank 1: boom",
        "resume_step": 5,
        "healed": "checkpoint",
        "steps_redone": 3,
        "bytes_sent": 0,
        "replaced_ranks": [1],
        "dp_before": 3,
        "dp_after": 2,
        "detect_s": 0.123,
        "save_s": 1.0,
        "teardown_s": 0.2,
        "place_s": 0.333,
        "init_s": 2.5,
        "restore_s": 0.0,
        "first_step_s": 0.75,
        "total_s": 5.556,
    }


def test_resize_record_after_a_restart_names_the_lost_replica():
    intr = Interruption("restart", "rank 1: boom", 9, 3, restart=1, dp_after=2, resume_step=5, **TIMED)
    record = intr.resize_record()
    assert record == {
        "event": "resize",
        "step": 5,
        "from_dp": 3,
        "to_dp": 2,
        "cause": "replica lost (rank 1: boom)",
        "detect_s": 0.123,
        "save_s": 1.0,
        "teardown_s": 0.2,
        "place_s": 0.333,
        "init_s": 2.5,
        "restore_s": 0.0,
        "first_step_s": 0.75,
        "resize_s": 5.556,
    }
    assert "total_s" not in record


def test_resize_record_of_a_grow():
    intr = Interruption("grow", "2 more replicas placed", 20, 2, dp_after=4, resume_step=20, save_s=0.5, total_s=3.0)
    record = intr.resize_record()
    assert record["cause"] == "2 more replicas placed"
    assert (record["step"], record["from_dp"], record["to_dp"]) == (20, 2, 4)
    assert record["resize_s"] == 3.0 and record["save_s"] == 0.5 and record["detect_s"] == 0.0


def test_resize_step_is_the_resume_step_not_the_failed_step():
    intr = Interruption("restart", "x", 9, 2, dp_after=1, resume_step=4)
    assert intr.resize_record()["step"] == 4 and intr.restart_record()["failed_step"] == 9


def test_defaults():
    intr = Interruption("restart", "x", 1, 1)
    assert intr.replaced_ranks == [] and intr.restart == 0 and intr.dp_after == 0
    assert all(getattr(intr, key) == 0.0 for key in (*TIMINGS, "total_s"))
    assert Interruption("restart", "x", 1, 1).replaced_ranks is not intr.replaced_ranks


def test_close_sets_first_step_and_a_total_from_since_plus_detect():
    before = time.perf_counter()
    intr = Interruption("restart", "x", 3, 2, detect_s=1.5, since=before - 0.25)
    intr = intr.close(0.4)
    elapsed = time.perf_counter() - before
    assert intr.first_step_s == 0.4
    assert intr.total_s >= intr.detect_s
    assert 1.5 + 0.25 <= intr.total_s <= 1.5 + 0.25 + elapsed + 1e-9


def test_close_without_detect():
    intr = Interruption("grow", "x", 3, 2)
    intr = intr.close(0.1)
    assert intr.total_s >= 0.0 and intr.first_step_s == 0.1


# -- RunSummary ---------------------------------------------------------------------------


def test_finish_from_the_history():
    s = summary()
    history = [step_record(1, loss=5.0, tokens_per_s=10.0), step_record(2, loss=4.0), step_record(3, loss=3.0)]
    s.finish(history)
    assert (s.steps, s.initial_loss, s.final_loss, s.consumed_samples) == (3, 5.0, 3.0, 48)
    assert s.mean_tokens_per_s == 1000.0  # the first step (warm-up) does not count


def test_finish_with_an_empty_history_after_a_resume():
    s = summary(resumed_step=40)
    s.finish([])
    assert s.steps == 40 and s.initial_loss is None and s.final_loss is None and s.consumed_samples is None
    assert s.mean_tokens_per_s == 0.0


def test_finish_with_nothing():
    s = summary()
    s.finish([])
    assert s.steps == 0 and s.mean_tokens_per_s == 0.0


OPTIONAL = ("startup_s", "train_s", "resumed_from", "resumed_step", "last_checkpoint", "error")


def test_to_dict_drops_the_optional_keys_that_are_none():
    out = summary().to_dict()
    assert not set(OPTIONAL) & set(out)
    assert "workers" not in out and "figures" not in out
    # the others stay, also when None
    assert out["initial_loss"] is None and out["final_loss"] is None and out["status"] == "failed"
    assert out["recoveries"] == [] and out["resizes"] == [] and out["faults_injected"] == []


def test_to_dict_keeps_the_optional_keys_that_are_set_and_merges_workers_and_figures():
    values = {
        "startup_s": 1.0,
        "train_s": 2.0,
        "resumed_from": "/ckpt/step_5",
        "resumed_step": 5,
        "last_checkpoint": "/c",
        "error": "boom",
    }
    s = summary(**values, workers={"backend": "gloo", "params": 123}, figures={"mfu": 0.4, "plots": ["a.png"]})
    out = s.to_dict()
    assert {k: out[k] for k in OPTIONAL} == values
    assert out["backend"] == "gloo" and out["params"] == 123 and out["mfu"] == 0.4 and out["plots"] == ["a.png"]
    assert "workers" not in out and "figures" not in out
    assert out["topology"] == {"dp": 2} and out["run_dir"] == "/runs/a"
    json.dumps(out)  # serializable


def test_resumed_step_zero_is_kept():
    assert summary(resumed_step=0).to_dict()["resumed_step"] == 0


# -- RunLog -------------------------------------------------------------------------------


@pytest.fixture
def runlog(tmp_path):
    cfg = dataclasses.replace(Config(), run_dir=str(tmp_path))
    log = RunLog(cfg)
    yield log
    log.metrics_file.close()


def test_step_appends_a_line_with_the_time(runlog, tmp_path):
    before = time.time()
    runlog.step(step_record(1))
    runlog.step(step_record(2, loss=1.5))
    lines = read_lines(tmp_path / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2] and lines[1]["loss"] == 1.5
    assert all(before <= line["time"] <= time.time() for line in lines)
    assert runlog.history == lines


def test_event(runlog, tmp_path):
    runlog.step(step_record(1))
    runlog.event({"event": "checkpoint", "step": 1, "path": "/c"})
    lines = read_lines(tmp_path / "metrics.jsonl")
    assert lines[1] == {"event": "checkpoint", "step": 1, "path": "/c"}
    assert len(runlog.history) == 1  # events are not steps


def test_rewind_forgets_later_steps_but_keeps_events(runlog, tmp_path):
    for step in (1, 2, 3):
        runlog.step(step_record(step))
    runlog.event({"event": "checkpoint", "step": 2})
    runlog.step(step_record(4))
    runlog.event({"event": "fault_injected", "step": 5})
    runlog.rewind(2)
    lines = read_lines(tmp_path / "metrics.jsonl")
    assert [(line.get("event"), line["step"]) for line in lines] == [
        (None, 1),
        (None, 2),
        ("checkpoint", 2),
        ("fault_injected", 5),
    ]
    assert [m["step"] for m in runlog.history] == [1, 2]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
    # training goes on: the steps trained again appear once
    runlog.step(step_record(3, loss=0.5))
    steps = [line for line in read_lines(tmp_path / "metrics.jsonl") if "event" not in line]
    assert [m["step"] for m in steps] == [1, 2, 3] and steps[-1]["loss"] == 0.5
    assert [m["step"] for m in runlog.history] == [1, 2, 3]


def test_interruption_restart_without_resize(runlog, tmp_path):
    s = runlog.summary
    intr = Interruption("restart", "boom", 7, 2, restart=1, dp_after=2, resume_step=5, replaced_ranks=[3])
    runlog.interruption(intr)
    (line,) = read_lines(tmp_path / "metrics.jsonl")
    assert line == intr.restart_record()
    assert s.recoveries == [{k: v for k, v in intr.restart_record().items() if k != "event"}]
    assert s.resizes == []


def test_interruption_restart_that_shrank(runlog, tmp_path):
    s = runlog.summary
    intr = Interruption("restart", "node lost", 7, 3, restart=1, dp_after=2, resume_step=5, total_s=4.0)
    runlog.interruption(intr)
    assert read_lines(tmp_path / "metrics.jsonl") == [intr.restart_record(), intr.resize_record()]
    assert len(s.recoveries) == 1 and "event" not in s.recoveries[0]
    assert s.resizes == [intr.resize_record()]
    assert s.resizes[0]["cause"] == "replica lost (node lost)"


def test_interruption_grow(runlog, tmp_path):
    s = runlog.summary
    intr = Interruption("grow", "replicas placed", 20, 2, dp_after=4, resume_step=20)
    runlog.interruption(intr)
    assert read_lines(tmp_path / "metrics.jsonl") == [intr.resize_record()]
    assert s.recoveries == [] and s.resizes == [intr.resize_record()]


def test_close_writes_the_summary(runlog, tmp_path):
    runlog.step(step_record(1))
    runlog.step(step_record(2))
    s = runlog.summary
    s.workers, s.figures = {"backend": "gloo"}, {"mfu": 0.1}
    data = runlog.close("completed", restarts=1)
    assert data == s.to_dict() and data["status"] == "completed" and data["restarts"] == 1
    assert json.loads((tmp_path / "summary.json").read_text()) == data
    assert data["steps"] == 2 and data["backend"] == "gloo" and "error" not in data
    assert not (tmp_path / "summary.json.tmp").exists()
    assert runlog.metrics_file.closed


def test_write_json(runlog, tmp_path):
    runlog.write_json("workers.json", {"0": {"node": "a"}})
    assert json.loads((tmp_path / "workers.json").read_text()) == {"0": {"node": "a"}}


# -- mean_throughput ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "steps, expected",
    [
        ([], 0.0),
        ([(500.0, 1.0)], 500.0),  # only one step: it counts
        ([(1.0, 9.0), (1000.0, 1.0), (2000.0, 1.0)], 1500.0),  # the first is warm-up
        ([(1.0, 9.0), (1000.0, 3.0), (2000.0, 1.0)], 1250.0),  # weighted by step time
        ([(1.0, 1.0), (100.0, 0.0)], 0.0),  # no time
        ([(1.0, 1.0), (math.nan, 1.0)], 0.0),
        ([(1.0, 1.0), (1000.0 / 3, 1.0)], 333.3),  # rounded to 0.1
    ],
)
def test_mean_throughput(steps, expected):
    history = [{"tokens_per_s": tps, "step_time_s": t} for tps, t in steps]
    assert mean_throughput(history) == expected


def test_a_commit_whose_report_was_lost_is_recorded_when_it_is_restored(tmp_path):
    """An asynchronous save's commit reaches the driver with the next step's results; a failure
    in that step takes the report with it. Recovery restores that committed checkpoint, and the
    driver records it then, so every checkpoint resumed from was recorded as saved."""
    from rayhybrid.driver.ledger import CheckpointLedger
    from rayhybrid.driver.state import RunState
    from rayhybrid.preflight import load_config
    from rayhybrid.storage.checkpoints import Checkpoint
    from rayhybrid.storage.store import Store

    cfg = dataclasses.replace(load_config(), run_dir=str(tmp_path))

    def found(step: int) -> Checkpoint:
        return Checkpoint(str(tmp_path / "checkpoints" / f"step_{step:08d}"), {"step": step})

    def ledger() -> CheckpointLedger:
        return CheckpointLedger(cfg, Store.open(str(tmp_path / "checkpoints")), RunLog(cfg))

    resumed = ledger()
    run = resumed.restored(RunState(), found(4))  # the run's first restore: a checkpoint it found, not saved
    run = run.but(committed=8)  # the driver had step 8's report
    run = resumed.restored(run, found(8))  # restoring it after a failure: nothing new
    run = resumed.restored(run, found(10))  # committed, its report lost with the failure
    summary_ = resumed.log.summary
    assert run.committed == 10 and summary_.checkpoints["saved"] == 1
    assert summary_.last_checkpoint == found(10).path
    fresh = ledger()
    run = fresh.restored(RunState(), None)  # from scratch
    run = fresh.restored(run, found(2))
    assert run.committed == 2 and fresh.log.summary.checkpoints["saved"] == 1
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"], e["path"]) for e in events] == [
        ("checkpoint", 10, found(10).path),
        ("checkpoint", 2, found(2).path),
    ]
    assert events[0]["blocked_s"] is None and events[0]["upload_s"] is None  # not known
