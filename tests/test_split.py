"""The MFU split (rayhybrid/trainer/split.py, docs/observability.md "The MFU split"): a step's
time charged to the innermost part open, the pipeline's idle split into bubble and pp
communication by the schedule's ideal share, the ranks' splits merged into the record's."""

from __future__ import annotations

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


def test_the_ideal_bubble_of_a_schedule():
    assert ideal_bubble(1, 1, 8) == 0.0
    assert ideal_bubble(2, 1, 4) == pytest.approx(1 / 5)  # (p-1)/(m+p-1)
    assert ideal_bubble(4, 2, 8) == pytest.approx(3 / 19)  # interleaved: v*m


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
