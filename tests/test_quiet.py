"""A quiet terminal after a handled failure: the user sees rayhybrid's one line per event, and
Ray's own text (the raylet's "A worker died ..." paragraph, the workers' stderr, the `ray`
logger) goes to the run's log file; and the local Ray that rayhybrid starts keeps Ray's
metrics off unless `cluster.ray_metrics` (docs/observability.md, "Ray's own text")."""

from __future__ import annotations

import functools
import gc
import logging
import sys

import pytest
import ray
import ray._private.worker as ray_worker
from ray._private.ray_logging import global_worker_stdstream_dispatcher

from rayhybrid.cluster.connect import connect, local_system_config
from rayhybrid.driver import raytext
from rayhybrid.driver.raytext import RayText
from rayhybrid.preflight import load_config
from tests.test_cli import run_cli

RAY_TEXT = ("A worker died", "(raylet)", "RayActorError", "Traceback", "pid=", "injecting fault")


@pytest.mark.slow  # Ray or several processes; see the quick tier in README.md
def test_a_killed_rank_is_rayhybrids_lines_on_the_terminal_and_rays_text_in_the_log(tmp_path):
    """`python -m rayhybrid` on dp2 with rank 1 SIGKILLed at step 3: the terminal has the
    failure and the recovery as rayhybrid's lines and none of Ray's paragraphs, which are in
    the run's log file (`__main__.log`) with the worker's own line about the fault."""
    run_dir = tmp_path / "run"
    args = ["+debug=fast", "+topology=dp2", "train.steps=4", "fault.inject=[kill@3:1]", f"hydra.run.dir={run_dir}"]
    proc = run_cli(args, cwd=tmp_path, timeout=240)
    terminal = proc.stdout + proc.stderr
    assert proc.returncode == 0, terminal[-3000:]
    assert "step 3 failed: rank 1: worker died" in proc.stdout
    assert "recovered from the failure at step 3" in proc.stdout
    assert [word for word in RAY_TEXT if word in terminal] == [], terminal
    logged = (run_dir / "__main__.log").read_text()
    assert "[ray][WARNING] (raylet) A worker died or was killed" in logged
    assert "(TrainWorker pid=" in logged and "injecting fault kill@3" in logged
    assert "recovered from the failure at step 3" in logged  # rayhybrid's lines, in the same file


@pytest.mark.slow
def test_the_local_ray_runs_no_metrics_exporter_unless_asked(monkeypatch):
    """cluster.ray_metrics=false (the default): the local Ray that rayhybrid starts has metrics
    collection off, so its node's agent runs no Prometheus exporter (MetricsExportPort -1,
    where Ray's default has a port); true: Ray's defaults."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert local_system_config(load_config(["cluster.ray_metrics=true"])) == {}
    if ray.is_initialized():
        pytest.skip("needs to start its own Ray")
    assert connect(load_config(["cluster.num_cpus=1"]))
    try:
        (node,) = ray.nodes()
        assert node["MetricsExportPort"] == -1
    finally:
        ray.shutdown()


def test_ray_text_goes_to_the_run_log_until_the_run_ends(tmp_path, capsys):
    """A run's RayText on a driver already connected with log_to_driver (a notebook's Ray):
    the workers' stderr, the raylet's messages and the `ray` logger's records go to `ray.log`
    in the run directory (no Hydra log file there), the workers' stdout to the terminal; at
    the end Ray prints as before."""
    gc.collect()  # a run log another test left open is gone
    original = ray_worker.print_to_stdstream
    dispatcher = global_worker_stdstream_dispatcher
    ray_logger = logging.getLogger("ray")
    ray_handlers = list(ray_logger.handlers)
    connected = "ray_print_logs" in dict(dispatcher.handlers)
    if not connected:  # what ray.init(log_to_driver=True) registers
        dispatcher.add_handler("ray_print_logs", functools.partial(original, ignore_prefix=False))
    worker = {"ip": "127.0.0.1", "localhost": "127.0.0.1", "pid": 4242, "actor_name": "TrainWorker", "job": ""}
    try:
        text = RayText(tmp_path)
        routed = ray_worker.print_to_stdstream
        assert routed is not original and dict(dispatcher.handlers)["ray_print_logs"].func is routed
        dispatcher.emit({**worker, "is_err": True, "lines": ["Traceback (most recent call last):"]})
        dispatcher.emit({**worker, "is_err": False, "lines": ["a print of the model's"]})
        ray_worker.print_to_stdstream({"lines": ["A worker died ..."], "pid": "raylet", "is_err": False}, False)
        ray_logger.error("Unhandled error: RayActorError(...)")
        text.close()
        assert ray_worker.print_to_stdstream is original and ray_logger.handlers == ray_handlers
        assert dict(dispatcher.handlers)["ray_print_logs"].func is original
    finally:
        if not connected:
            dispatcher.remove_handler("ray_print_logs")
    out, err = capsys.readouterr()
    assert "TrainWorker pid=4242" in out and "a print of the model's" in out  # as Ray prints it
    assert [word for word in ("A worker died", "(raylet)", "RayActorError", "Traceback") if word in out + err] == []
    logged = (tmp_path / "ray.log").read_text()
    for line in (
        "[ray][INFO] (TrainWorker pid=4242) Traceback (most recent call last):",
        "[ray][WARNING] (raylet) A worker died ...",
        "Unhandled error: RayActorError(...)",
    ):
        assert line in logged, logged
    assert "a print of the model's" not in logged


@pytest.fixture
def fresh_ray_internals():
    """RayText looks Ray's private parts up once per process: again for this test, and after."""
    raytext._ray_internals.cache_clear()
    yield
    raytext._ray_internals.cache_clear()


def test_a_ray_without_its_private_printer_leaves_its_text_on_the_terminal(
    tmp_path, caplog, monkeypatch, fresh_ray_internals
):
    """A Ray whose `print_to_stdstream` moved: the run goes on, Ray prints as it does, and the
    log has one warning line saying so (once per process)."""
    monkeypatch.delattr(ray_worker, "print_to_stdstream")
    ray_logger = logging.getLogger("ray")
    handlers = list(ray_logger.handlers)
    dispatched = list(global_worker_stdstream_dispatcher.handlers)
    caplog.set_level(logging.WARNING, logger="rayhybrid")
    text = RayText(tmp_path)
    RayText(tmp_path).close()  # a second run: no second warning
    text.close()
    assert not hasattr(ray_worker, "print_to_stdstream")  # nothing put in its place
    assert ray_logger.handlers == handlers and list(global_worker_stdstream_dispatcher.handlers) == dispatched
    assert RayText.open_runs == [] and not (tmp_path / "ray.log").exists()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "\n" not in warning and "Ray's own text stays on the terminal" in warning
    assert "print_to_stdstream" in warning and "ray==2.60" in warning


def test_what_the_process_prints_inside_printed_goes_to_the_run_log(tmp_path, capsys):
    """`RayText.printed` (the tune's hold on Ray Tune's banners and tables): what is printed
    meanwhile, to stdout or stderr, is in the run's log file line by line, not on the terminal;
    afterwards printing reaches the terminal again."""
    gc.collect()
    text = RayText(tmp_path)
    with text.printed():
        print("╭── Configuration for experiment ──╮\n│ Search algorithm │")
        print("a last line without its newline", end="")
        print("a warning", file=sys.stderr)
    print("after")
    text.close()
    out, err = capsys.readouterr()
    assert (out, err) == ("after\n", "")
    logged = (tmp_path / "ray.log").read_text()
    for line in (
        "[stdout][INFO] ╭── Configuration for experiment ──╮",
        "[stdout][INFO] │ Search algorithm │",
        "[stdout][INFO] a last line without its newline",
        "[stderr][INFO] a warning",
    ):
        assert line in logged, logged
