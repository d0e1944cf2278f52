"""The start-up's phases (rayhybrid/trainer/startup.py): a clock whose phases add up to the time
it ran, and the workers' phases laid along the critical path of the driver's window."""

from __future__ import annotations

import pytest

from rayhybrid.trainer import startup
from rayhybrid.trainer.startup import PHASES, PhaseClock, critical_path


def test_marks_add_up_to_the_time_since_the_start_in_phase_order():
    clock = PhaseClock(since=100.0)
    clock.mark("launch", now=101.0)
    clock.mark("ray", now=104.0)
    clock.mark("launch", now=104.5)  # a phase marked again adds up
    clock.mark("first_step", now=106.0)
    ordered = clock.ordered()
    assert list(ordered) == list(PHASES)
    assert ordered["launch"] == 1.5 and ordered["ray"] == 3.0 and ordered["first_step"] == 1.5
    assert sum(ordered.values()) == pytest.approx(clock.last - clock.since)


def test_workers_phases_end_when_the_last_rank_ended_them():
    # Rank 0 is up at 11 and imports until 13; rank 1 is up at 12 and imports until 15; both
    # leave the rendezvous at 16; rank 0 is done at 17, and the driver hears at 18.
    readings = [
        {"since": 11.0, "seconds": {"imports": 2.0, "device_init": 3.0, "model_build": 0.5, "parallelize": 0.5}},
        {"since": 12.0, "seconds": {"imports": 3.0, "device_init": 1.0, "model_build": 0.25, "parallelize": 0.25}},
    ]
    phases = critical_path(readings, start=10.0, end=18.0)
    assert phases["processes"] == 2.0 and phases["imports"] == 3.0 and phases["device_init"] == 1.0
    assert phases["model_build"] == 0.5 and phases["parallelize"] == 0.5 + 1.0  # the answers' way back counts
    assert sum(phases.values()) == pytest.approx(8.0)


def test_a_worker_clock_ahead_of_the_drivers_stays_inside_its_window():
    readings = [{"since": 30.0, "seconds": {"imports": 5.0}}]  # another node's clock, seconds ahead
    phases = critical_path(readings, start=10.0, end=12.0)
    assert all(s >= 0 for s in phases.values()) and sum(phases.values()) == pytest.approx(2.0)


def test_a_process_clock_reports_once_and_marks_nothing_when_not_started(monkeypatch):
    monkeypatch.setattr(startup, "_CLOCK", None)  # a worker built in this process earlier began one
    startup.mark("imports")  # no clock: nothing
    assert startup.reading() is None
    startup.begin(since=0.0)
    startup.mark("imports")
    reading = startup.reading()
    assert reading["since"] == 0.0 and reading["seconds"]["imports"] > 0
    assert startup.reading() is None  # a later join reports nothing


def test_the_command_start_is_before_now():
    import time

    started = startup.command_started()
    assert started is None or 0 <= time.time() - started < 24 * 3600


def test_a_worker_without_a_pipeline_does_not_import_torchs_pipelining():
    """Every rank imports the trainer at start-up (`imports`); torch's pipelining pulls in dynamo
    (about a quarter of a second per rank on a CPU) and is imported only where pp > 1."""
    import subprocess
    import sys

    code = (
        "import sys, rayhybrid.trainer.loop, rayhybrid.cluster.worker; "
        "print(sorted(m for m in ('torch.distributed.pipelining', 'torch._dynamo') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_slow_first_batch_is_its_own_phase_and_the_phases_still_add_up(tmp_path):
    """The first batch's wait is the start of the first step: it is marked as its own phase and
    the first step keeps only the rest, so the phases add up to startup_s exactly (but for
    rounding), however slow the first batch was."""
    import dataclasses
    import time

    from rayhybrid.config.schema import Config
    from rayhybrid.driver.runlog import RunLog

    cfg = dataclasses.replace(Config(), run_dir=str(tmp_path))
    log = RunLog(cfg, started=time.time() - 10.0)
    log.summary.workers = {"params": 1, "loss_floor": None}
    log.clock.mark("launch", now=time.time() - 2.0)  # the first step began 2 s ago
    log.started_up(1, first_batch_s=1.5)
    phases, total = log.summary.startup, log.summary.startup_s
    assert phases["first_batch"] == pytest.approx(1.5, abs=0.01)
    assert phases["first_step"] == pytest.approx(0.5, abs=0.05)
    assert sum(phases.values()) == pytest.approx(total, abs=0.001 * len(PHASES)), phases
    log.close("completed")


def test_a_worker_imports_the_trainer_without_collecting_and_freezes_what_it_made():
    """`warm_up` imports the trainer with the collector off (each full collection over what the
    imports made would take ~0.2 s of CPU per rank), freezes it out of later collections, and
    leaves the collector on as it was; a second call changes nothing."""
    import subprocess
    import sys

    code = (
        "import gc, rayhybrid.cluster.worker as w; before = gc.get_stats()[2]['collections']; "
        "w.TrainWorker.warm_up(None); frozen = gc.get_freeze_count(); w.TrainWorker.warm_up(None); "
        "print(gc.get_stats()[2]['collections'] - before, frozen > 100_000, gc.get_freeze_count() == frozen, "
        "gc.isenabled())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["0", "True", "True", "True"], out.stdout + out.stderr
