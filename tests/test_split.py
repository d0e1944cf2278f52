"""The MFU split (rayhybrid/trainer/split.py, docs/observability.md "The MFU split"): a step's
time charged to the innermost part open, the pipeline's idle split into bubble and pp
communication by the schedule's ideal share, the ranks' splits merged into the record's."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import statistics
import threading
import time
from pathlib import Path

import pytest

from rayhybrid.cluster.merge import merge_steps, split_mean
from rayhybrid.trainer import split as split_module
from rayhybrid.trainer.results import SPLIT_PARTS, StepResult
from rayhybrid.trainer.split import StepClock, ideal_bubble, split_step


class FakeTime:
    """A perf_counter the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def fake_time(monkeypatch) -> FakeTime:
    clock = FakeTime()
    monkeypatch.setattr(split_module, "time", clock)
    return clock


def test_each_second_goes_to_the_innermost_part(fake_time):
    clock = StepClock()
    clock.begin()
    fake_time.now += 1.0  # host: the step's own bookkeeping
    with clock.part("data"):
        fake_time.now += 0.5
    with clock.part("compute"):  # a forward: its waits are tp's
        fake_time.now += 2.0
        with clock.wait():
            fake_time.now += 0.25
        with clock.wait("pp"):
            fake_time.now += 0.75
        fake_time.now += 1.0
    with clock.part("compute", "dp"), clock.wait():  # clipping: its waits are dp's
        fake_time.now += 0.125
    seconds = clock.end()
    assert seconds == {"compute": 3.0, "host": 1.0, "data": 0.5, "tp": 0.25, "dp": 0.125, "pp": 0.75}


def test_outside_a_step_parts_count_nothing_and_hooks_pass_through(fake_time):
    clock = StepClock()
    calls = []
    waited = split_module._waited(lambda x: calls.append(x) or x * 2, "pp")
    assert waited(3) == 6  # no step running: straight through
    clock.begin()
    assert split_module.ACTIVE is clock
    fake_time.now += 1.0
    with clock.part("compute"):
        assert waited(4) == 8  # charged as a pp wait, though it took no (fake) time
        fake_time.now += 0.5
    seconds = clock.end()
    assert split_module.ACTIVE is None and calls == [3, 4]
    assert seconds["host"] == 1.0 and seconds["compute"] == 0.5
    with clock.part("compute"):  # an evaluation's forward, after the step: not counted
        fake_time.now += 7.0
    assert clock.seconds["compute"] == 0.5


def test_a_clock_that_never_began_ends_with_nothing():
    clock = StepClock()  # an evaluation before the first step ends no step
    assert sum(clock.end().values()) == 0 and split_module.ACTIVE is None


def test_a_hooked_wait_is_charged_to_the_running_step(fake_time):
    clock = StepClock()

    def blocked() -> None:
        fake_time.now += 0.3

    hooked = split_module._waited(blocked, None)  # funcol's: the enclosing part's kind
    clock.begin()
    with clock.part("compute", "dp"):
        hooked()
    with clock.part("compute"):
        hooked()
    seconds = clock.end()
    assert seconds["dp"] == pytest.approx(0.3) and seconds["tp"] == pytest.approx(0.3)


def test_the_hooks_go_in_once_and_a_place_torch_moved_is_one_warning(monkeypatch, caplog):
    from torch.distributed.pipelining import schedules

    split_module.install()
    hooked = schedules._wait_batch_p2p
    split_module.install()  # once per process: not wrapped twice
    assert schedules._wait_batch_p2p is hooked and hooked.__wrapped__ is not None
    monkeypatch.setattr(split_module, "_INSTALLED", False)
    moved = [("torch.distributed.pipelining.schedules", "", ("_a_wait_torch_moved",), "pp", "pp")]
    with caplog.at_level(logging.WARNING, logger="rayhybrid.trainer.split"):
        split_module.install(moved)
    (record,) = caplog.records
    assert "does not see the pp waits, which count as compute" in record.getMessage()
    assert schedules._wait_batch_p2p is hooked


class FakeEvent:
    """torch.cuda.Event on a device whose stream runs `lag` seconds behind the host's clock."""

    clock: FakeTime
    lag = 0.0
    synchronized = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = self.clock.now + FakeEvent.lag

    def synchronize(self) -> None:
        FakeEvent.synchronized += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as torch's


def test_on_cuda_the_waits_are_the_streams_between_two_events(fake_time, monkeypatch):
    """The device's waits (event pairs on the current stream) replace the host's readings of
    them; a wait inside a wait is the outer one's time, not counted twice."""
    import torch

    FakeEvent.clock = fake_time
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    clock = StepClock(torch.device("cuda"))
    clock.begin()
    with clock.part("compute"):
        fake_time.now += 1.0
        with clock.wait():  # the host returns at once; the stream waits 0.5 s behind it
            FakeEvent.lag = 0.0
            with clock.wait("dp"):  # inside the tp wait: were it timed, dp would hold its 0.2 s
                FakeEvent.lag = 0.2
            FakeEvent.lag = 0.5
    with clock.part("compute", "dp"), clock.wait():
        FakeEvent.lag = 0.75
    seconds = clock.end()
    assert seconds["tp"] == pytest.approx(0.5) and seconds["dp"] == pytest.approx(0.25)
    assert FakeEvent.synchronized == 2  # two outer waits, read once each
    assert seconds["compute"] == pytest.approx(1.0 - 0.75)  # the device's waits come out of compute


def test_on_cuda_the_loss_sync_is_compute_and_the_device_waits_come_out_of_it(fake_time, monkeypatch):
    """A simulated CUDA step: 20 ms of launches (15 ms of device waits among them), the loss
    all-reduce launched, the loss read blocking 75 ms on the device's forward and backward, 5 ms
    of the host's own: compute 80 ms, host 5 ms, waits 15 ms, adding up to the 100 ms step."""
    import torch

    FakeEvent.clock, FakeEvent.lag, FakeEvent.synchronized = fake_time, 0.0, 0
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    clock = StepClock(torch.device("cuda"))
    clock.begin()
    with clock.part("compute"):  # forward and backward: the host launches
        fake_time.now += 0.010
        with clock.wait():  # a tp collective: the stream waits 15 ms on it, the host not at all
            FakeEvent.lag = 0.0
            fake_time.now += 0.001
            FakeEvent.lag = 0.015 - 0.001
        fake_time.now += 0.009
    FakeEvent.lag = 0.0
    with clock.wait("dp"):  # the loss all-reduce: launched, no device wait of its own
        pass
    with clock.sync():  # float(loss): the host waits for the device's whole step
        fake_time.now += 0.075
    fake_time.now += 0.005  # the host's own bookkeeping
    seconds = clock.end()
    split = split_step(seconds, 0.100, window_s=0.0, ideal=0.0)
    assert split["compute_s"] == pytest.approx(0.080) and split["host_s"] == pytest.approx(0.005)
    assert split["comm_tp_s"] == pytest.approx(0.015) and split["comm_dp_s"] == pytest.approx(0.0)
    assert seconds["compute"] == pytest.approx(0.080) and sum(split.values()) == pytest.approx(0.100)
    # On CPU nothing is pending at the loss read: its time stays the host's.
    cpu = StepClock()
    cpu.begin()
    with cpu.sync():
        fake_time.now += 0.075
    assert cpu.end()["host"] == pytest.approx(0.075)


def test_the_ideal_bubble_of_a_schedule():
    assert ideal_bubble("1f1b", 1, 1, 8) == 0.0
    assert ideal_bubble("1f1b", 2, 1, 4) == pytest.approx(1 / 5)  # (p-1)/(m+p-1)
    assert ideal_bubble("gpipe", 2, 1, 4) == pytest.approx(1 / 5)
    assert ideal_bubble("interleaved_1f1b", 4, 2, 8) == pytest.approx(3 / 19)  # interleaved: v*m
    # Zero bubble: the planner's smaller share, not 1F1B's (so pp comm is not reported as bubble).
    assert ideal_bubble("interleaved_zb", 4, 2, 8) == pytest.approx(3 / (3 * 2 * 8 + 3))
    assert ideal_bubble("zbv", 2, 2, 4) == 0.0  # m >= 2p-1


def test_the_pipeline_idle_is_bubble_up_to_the_ideal_share_and_pp_comm_beyond():
    seconds = {"compute": 5.0, "host": 0.5, "data": 0.25, "tp": 1.0, "dp": 0.75, "pp": 2.0}
    split = split_step(seconds, 10.0, window_s=8.0, ideal=0.2)  # ideal bubble 1.6 s of 2.0 s idle
    assert list(split) == list(SPLIT_PARTS)
    assert split["bubble_s"] == pytest.approx(1.6) and split["comm_pp_s"] == pytest.approx(0.4)
    assert split["comm_tp_s"] == 1.0 and split["comm_dp_s"] == 0.75 and split["data_wait_s"] == 0.25
    assert split["host_s"] == 0.5
    assert sum(split.values()) == pytest.approx(10.0, abs=1e-12)
    # Less idle than the ideal: all of it is bubble.
    small = split_step({**seconds, "pp": 1.0}, 10.0, window_s=8.0, ideal=0.2)
    assert small["bubble_s"] == 1.0 and small["comm_pp_s"] == 0.0
    # Compute is what the step leaves once the rest is out (the clock's own compute reading
    # differs from it by the time between the step's timer and the clock's).
    assert split["compute_s"] == pytest.approx(10.0 - 0.25 - 2.0 - 0.75 - 1.0 - 0.5)


def test_device_waits_longer_than_the_host_step_are_scaled_to_fit():
    split = split_step({"tp": 3.0, "dp": 1.0, "host": 0.0, "data": 0.0}, 2.0, window_s=0.0, ideal=0.0)
    assert split["compute_s"] == 0.0
    assert split["comm_tp_s"] == pytest.approx(1.5) and split["comm_dp_s"] == pytest.approx(0.5)
    assert sum(split.values()) == pytest.approx(2.0)


def rank_metrics(rank: int, step_time_s: float, compute_s: float) -> dict:
    parts = {"data_wait_s": 0.1, "bubble_s": 0.2, "comm_dp_s": 0.3, "comm_tp_s": 0.1, "comm_pp_s": 0.0}
    host = step_time_s - compute_s - sum(parts.values())
    split = {"compute_s": compute_s, **parts, "host_s": host}
    metrics = {"step": 1, "step_time_s": step_time_s, "split": split, "compute_s": compute_s}
    metrics |= {"samples_read": [rank * 2, 2], "data_wait_s": 0.1, "consumed_samples": 4, "dp": 2}
    return metrics | ({"loss": 1.0} if rank == 0 else {})


def test_the_record_holds_the_ranks_mean_split_scaled_to_its_step_time_and_each_ranks_compute():
    ranks = [rank_metrics(0, 2.0, 1.0), rank_metrics(1, 2.2, 1.6)]
    (record,) = merge_steps([[StepResult(m)] for m in ranks], dp=2, replica_size=1)
    m = record.metrics
    assert m["compute_s_by_rank"] == [1.0, 1.6]
    assert sum(m["split"].values()) == pytest.approx(2.0, abs=1e-9)  # rank 0's step time
    scale = 2.0 / 2.1
    assert m["split"]["compute_s"] == pytest.approx(1.3 * scale) == m["compute_s"]
    assert m["split"]["comm_dp_s"] == pytest.approx(0.3 * scale)


def test_a_rank_with_no_figures_of_the_step_has_none_in_compute_by_rank():
    ranks = [[StepResult(rank_metrics(0, 2.0, 1.0))], None, [StepResult(rank_metrics(2, 2.0, 0.5))]]
    (record,) = merge_steps(ranks, dp=3, replica_size=1)
    assert record.metrics["compute_s_by_rank"] == [1.0, None, 0.5]


def test_a_split_of_nothing_is_zeros():
    assert split_mean([dict.fromkeys(SPLIT_PARTS, 0.0)], 1.0) == dict.fromkeys(SPLIT_PARTS, 0.0)


# -- real runs (Ray, gloo on CPU) -------------------------------------------------------------------

SMALL = ["train.global_batch_size=8", "train.micro_batch_size=2", "data.seq_len=32"]


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


def step_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "event" not in r and "step_time_s" in r]


@pytest.mark.slow
def test_a_hybrid_run_splits_every_step_into_its_seven_parts(local_ray, tmp_path, caplog):
    """dp2_pp2_tp2: every record's split adds up to its step time and shows each kind of wait;
    summary.json holds the run's split and the log its table."""
    import rayhybrid

    with caplog.at_level(logging.INFO, logger="rayhybrid"):
        summary = rayhybrid.train(["+topology=dp2_pp2_tp2", *SMALL, "train.steps=4"], run_dir=tmp_path / "run")
    steps = step_records(Path(summary["run_dir"]))
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        split = r["split"]
        assert list(split) == list(SPLIT_PARTS) and min(split.values()) >= 0
        assert abs(sum(split.values()) - r["step_time_s"]) < 1e-6, r
        assert split["comm_tp_s"] > 0 and split["comm_dp_s"] > 0, split
        assert split["comm_pp_s"] + split["bubble_s"] > 0, split
        assert len(r["compute_s_by_rank"]) == 8 and all(c > 0 for c in r["compute_s_by_rank"])
        assert r["compute_s"] == split["compute_s"]
    table = summary["mfu_split"]
    assert table["steps"] == 3 and table["first_step_left_out"]
    assert sum(table["shares"].values()) == pytest.approx(1.0, abs=1e-3)
    kept = [r["split"] for r in steps[1:]]
    assert table["seconds"]["comm_tp_s"] == pytest.approx(sum(s["comm_tp_s"] for s in kept), abs=1e-5)
    assert "MFU split over 3 kept steps after the first" in caplog.text and "comm pp" in caplog.text


def duty_cycle(pid: int, done: threading.Event, stopped_s: float = 0.01, running_s: float = 0.01) -> None:
    """Stop and continue process `pid` in turn (half the time stopped) until `done`; it is left
    running."""
    try:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(running_s)
    except ProcessLookupError:
        return
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def when_step(run_dir: Path, step: int, thread: threading.Thread, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and thread.is_alive():
        path = run_dir / "metrics.jsonl"
        if path.exists() and sum('"loss"' in line for line in path.read_text().splitlines()) >= step:
            return
        time.sleep(0.02)
    raise TimeoutError(f"step {step} not reached")


def slowness(record: dict, rank: int) -> float:
    """A rank's compute_s over the median of the others' in one step record."""
    by_rank = record["compute_s_by_rank"]
    others = statistics.median(c for r, c in enumerate(by_rank) if r != rank)
    return by_rank[rank] / others


BIGGER = ["train.global_batch_size=32", "train.micro_batch_size=8", "data.seq_len=256"]
"""Steps of about 0.17 s at dp2 on 2 cores: the untouched ranks' noise (the machine's other
processes taking a core for a few milliseconds) a smaller share of each step."""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("topology", "size", "untouched", "steps"),
    [("dp2", BIGGER, 33, 60), ("dp2_tp2", [*SMALL[:1], "train.micro_batch_size=4", "data.seq_len=128"], 5, 30)],
)
def test_a_rank_stopped_half_the_time_computes_twice_as_long_and_its_peers_do_not(
    local_ray, tmp_path, topology, size, untouched, steps
):
    """The first `untouched` steps run as they are: at dp2, over steps 2-33, no rank is 1.2x
    slower than the median of the others for 5 steps in a row. Then rank 1's process is stopped
    and continued on a 50% duty cycle from outside, and its own compute_s is at least 1.3x the
    others' median over most of the following steps: its peers, which wait for it in the
    gradient reduction (and at tp2 its tp peer in the tensor-parallel collectives), do not
    count the wait as compute. No warm standby: its start (a process importing torch) takes
    one of this machine's two cores for the first ten steps or so, which slows one rank of the
    two, the noise the calm steps must not have."""
    import rayhybrid

    run_dir = tmp_path / "run"
    result: dict = {}

    def train() -> None:
        overrides = [f"+topology={topology}", *size, f"train.steps={steps}", "fault.standby=0"]
        result["summary"] = rayhybrid.train(overrides, run_dir=run_dir)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    when_step(run_dir, untouched, thread)
    pid = json.loads((run_dir / "workers.json").read_text())[1]["pid"]
    done = threading.Event()
    stopper = threading.Thread(target=duty_cycle, args=(pid, done), daemon=True)
    stopper.start()
    thread.join(timeout=600)
    done.set()
    stopper.join(timeout=10)
    assert "summary" in result, "the run did not finish"
    records = {r["step"]: r for r in step_records(run_dir)}
    ranks = range(len(records[1]["compute_s_by_rank"]))
    calm = [max(slowness(records[s], rank) for rank in ranks) for s in range(2, untouched + 1)]
    stopped = [slowness(records[s], 1) for s in range(untouched + 2, steps + 1)]
    print(f"{topology}: slowest rank untouched {[round(x, 2) for x in calm]}")
    print(f"{topology}: rank 1 stopped half the time {[round(x, 2) for x in stopped]}")
    if untouched >= 30:
        streaks = [calm[i : i + 5] for i in range(len(calm) - 4)]
        assert not any(min(streak) >= 1.2 for streak in streaks), [round(x, 2) for x in calm]
    assert sum(x >= 1.3 for x in stopped) >= 0.7 * len(stopped), [round(x, 2) for x in stopped]
    assert statistics.median(stopped) >= 1.5, [round(x, 2) for x in stopped]


# -- from_run: the run's measured goodput beside the simulator's (no Ray) ------------------------------


def synthetic_run(root: Path, goodput: dict | None) -> Path:
    """A run of 8 ranks (dp2 x pp2 x tp2), 40 steps of 0.5 s, one restart, as the run log writes
    it; summary.json with `goodput` (the driver's measured seconds by cause) unless None."""
    run = root / "run"
    run.mkdir()
    topo = {"dp": 2, "pp": 2, "tp": 2}
    records = [{"step": s, "loss": 1.0, "step_time_s": 0.5, **topo} for s in range(1, 41)]
    records.append(
        {"event": "restart", "restart": 1, "failed_step": 20, "cause": "rank 3: boom", "resume_step": 18}
        | {"detect_s": 2.0, "teardown_s": 1.0, "place_s": 0.5, "init_s": 3.0, "restore_s": 1.5, "first_step_s": 1.0}
    )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"status": "completed"} | ({"goodput": goodput} if goodput is not None else {})
    (run / "summary.json").write_text(json.dumps(summary))
    return run


MEASURED = {
    "productive": 20.0,
    "startup": 6.0,
    "data_wait": 0.5,
    "bubble": 3.0,
    "exposed_comm": 2.0,
    "host_overhead": 0.5,
    "checkpoint": 1.0,
    "evaluation": 0.0,
    "detection": 2.0,
    "teardown": 1.0,
    "worker_init": 3.5,
    "restore": 1.5,
    "redone": 1.0,
    "waiting_for_nodes": 0.0,
    "preemption_drain": 0.0,
}


def test_from_run_puts_the_runs_measured_goodput_beside_the_simulated_one(tmp_path, capsys):
    from rayhybrid.goodput.__main__ import main

    wall = sum(MEASURED.values())  # 42 s
    goodput = {"seconds": MEASURED, "wall_s": wall, "effective_time": 20.0 / wall, "processes": 2}
    run = synthetic_run(tmp_path, goodput)
    main(["gpus=1024", "days=1", f"from_run={run}", f"output_dir={tmp_path / 'out'}", "strategy=all"])
    report = json.loads((tmp_path / "out" / "goodput.json").read_text())
    beside = report["from_run"]["vs_simulated"]
    # The simulator ran the run itself: its 8 ranks in replicas of pp x tp = 4, over its wall time.
    assert (beside["ranks"], beside["replica_ranks"], beside["wall_s"], beside["processes"]) == (8, 4, wall, 2)
    measured = beside["measured"]
    assert measured["effective_time"] == pytest.approx(20.0 / wall)
    assert measured["lost_s"] == {
        "detection": 2.0,
        "restart": 6.0,  # teardown + worker_init + restore
        "redone_work": 1.0,
        "checkpoint": 1.0,
        "waiting_for_nodes": 0.0,
        "stopped": 0.0,
    }
    not_simulated = {"startup": 6.0, "data_wait": 0.5, "bubble": 3.0, "exposed_comm": 2.0, "host_overhead": 0.5}
    assert beside["not_simulated_s"] == not_simulated | {"evaluation": 0.0, "preemption_drain": 0.0}
    assert set(beside["simulated"]) == {"restart_all", "replace_failed", "peer_heal", "elastic", "elastic_no_spares"}
    for strategy in beside["simulated"].values():
        assert 0.0 < strategy["effective_time"] <= 1.0
        lost = sum(strategy["lost_s"].values())
        assert strategy["effective_time"] == pytest.approx(1.0 - lost / wall, abs=1e-3)
    out = capsys.readouterr().out
    assert "the run beside the simulator at its own size: 8 ranks" in out
    assert f"{20.0 / wall:.4f}" in out and "not simulated: startup 6.0" in out


def test_from_run_without_a_measured_goodput_is_one_line_naming_the_setting(tmp_path, capsys):
    from rayhybrid.goodput.__main__ import main

    run = synthetic_run(tmp_path, None)
    with pytest.raises(SystemExit) as exit_:
        main(["gpus=1024", "days=1", f"from_run={run}", f"output_dir={tmp_path / 'out'}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error: from_run:" in err and "has no goodput" in err, err
    assert "summary.json's goodput" in err  # the fix


def test_the_tied_copies_all_reduce_is_a_dp_wait_not_compute(fake_time, monkeypatch):
    """The last stage blocked in the tied all-reduce on a slow first stage is waiting, not
    computing: `sum_grads` runs its all-reduce inside the clock's wait (dp, as clipping's)."""
    import torch

    from rayhybrid.parallel import tied as tied_module

    def all_reduce(tensor, group=None):  # the peer on the first stage is 0.5 s late
        fake_time.now += 0.5

    monkeypatch.setattr(tied_module.dist, "all_reduce", all_reduce)
    copies = tied_module.TiedCopies.__new__(tied_module.TiedCopies)
    weight = torch.nn.Parameter(torch.zeros(2))
    weight.grad = torch.ones(2)
    copies.sources, copies.copies, copies.group = {}, {"embed.weight": weight}, object()
    clock = StepClock()
    clock.begin()
    with clock.part("compute", "dp"):  # as Trainer.clip_gradients
        fake_time.now += 0.25
        copies.sum_grads(waiting=clock.wait)
    seconds = clock.end()
    assert seconds["dp"] == pytest.approx(0.5) and seconds["compute"] == pytest.approx(0.25)
