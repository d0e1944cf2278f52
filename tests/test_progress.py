"""Terminal output: a progress bar only on a terminal, one line per logged step."""

from __future__ import annotations

import io
import json
import logging
import time

from rayhybrid.driver.runlog import ProgressBar, RunLog
from rayhybrid.preflight import load_config


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal():
    tty, pipe = FakeTerminal(), io.StringIO()
    for stream in (tty, pipe):
        bar = ProgressBar(10, stream=stream)
        bar.update(5, 2.5, 75)
        bar.clear()
    assert pipe.getvalue() == ""
    assert "[###############...............] 5/10 loss 2.5000 eta 1m15s" in tty.getvalue()
    assert tty.getvalue().endswith("\r\033[K")


def test_one_line_per_logged_step(tmp_path, caplog):
    import dataclasses

    cfg = load_config(["train.steps=4", "train.log_every=2"])
    cfg = dataclasses.replace(cfg, run_dir=str(tmp_path))
    out = RunLog(cfg)
    with caplog.at_level(logging.INFO, logger="rayhybrid"):
        for step in range(1, 5):
            out.step(
                {
                    "step": step,
                    "loss": 3.0 / step,
                    "lr": 1e-3,
                    "grad_norm": 0.5,
                    "tokens_per_s": 1000.0,
                    "step_time_s": 0.1,
                    "consumed_samples": 16 * step,
                }
            )
    out.close("completed")
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step")]
    assert [line.split("|")[0].strip() for line in logged] == ["step 1/4", "step 2/4", "step 4/4"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("event") for r in records[4:]] == ["goodput"]  # the run's wall time by cause, at the end
    records = records[:4]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    times = [r["time"] for r in records]  # wall clock of each step's record, in order
    assert times == sorted(times) and abs(times[-1] - time.time()) < 60
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


def test_python_entry_point_survives_importing_the_trainer():
    import rayhybrid
    import rayhybrid.trainer.loop

    assert callable(rayhybrid.train)
