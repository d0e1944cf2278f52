"""Live goodput (rayhybrid/driver/wallclock.py): every second of a run's wall time given to one
cause. The ledger with synthetic records (the sum is the wall time, debts, redone steps, a
restart's phases, a restart that resized counted once, earlier processes of a resumed run),
then real runs: an uninterrupted one resumed by a second process, and one whose rank is
SIGKILLed and restored from its checkpoint."""

from __future__ import annotations

import itertools
import json
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rayhybrid.driver import wallclock
from rayhybrid.driver.records import Interruption
from rayhybrid.driver.wallclock import CAUSES, KEPT, Wallclock, WallLedger, effective_time, settled, step_pieces

T0 = 1_000.0


def step(n: int, t: float = 1.0, **fields) -> dict:
    return {"step": n, "step_time_s": t, **fields}


def assert_adds_up(ledger: WallLedger, now: float) -> None:
    assert set(ledger.totals) == set(CAUSES)
    assert min(ledger.totals.values()) >= 0
    assert sum(ledger.totals.values()) == pytest.approx(now - T0, abs=1e-9)


def test_every_second_goes_to_one_cause():
    ledger = WallLedger(T0)
    ledger.step(step(1, 2.0, data_wait_s=0.5), T0 + 10.0, startup_restore=1.5)  # start-up, restore, step 1
    assert ledger.totals["restore"] == 1.5 and ledger.totals["data_wait"] == 0.5
    assert ledger.totals["productive"] == pytest.approx(1.5) and ledger.totals["startup"] == pytest.approx(6.5)
    ledger.step(step(2, 1.0, bubble=0.25, eval_s=0.5), T0 + 12.0)
    assert ledger.totals["bubble"] == 0.25 and ledger.totals["evaluation"] == 0.5
    assert ledger.totals["host_overhead"] == pytest.approx(0.5)  # the rest between kept steps
    ledger.event({"event": "checkpoint", "step": 2, "blocked_s": 0.75})
    split = {"compute_s": 0.5, "data_wait_s": 0.1, "bubble_s": 0.1, "comm_dp_s": 0.1, "comm_tp_s": 0.05}
    ledger.step(step(3, 1.0, split={**split, "comm_pp_s": 0.05, "host_s": 0.1}), T0 + 14.0)
    assert ledger.totals["checkpoint"] == 0.75 and ledger.totals["exposed_comm"] == pytest.approx(0.2)
    ledger.close(T0 + 15.0)
    assert_adds_up(ledger, T0 + 15.0)
    kept = sum(ledger.totals[c] for c in KEPT)
    assert effective_time(ledger.totals, 15.0) == pytest.approx(kept / 15.0)


def test_a_piece_that_overruns_its_interval_is_a_debt_never_a_negative():
    ledger = WallLedger(T0)
    ledger.step(step(1, 0.5), T0 + 1.0)
    ledger.event({"event": "checkpoint", "step": 1, "blocked_s": 3.0})  # reported late (an async save)
    ledger.step(step(2, 0.5), T0 + 2.0)
    assert_adds_up(ledger, T0 + 2.0)
    assert ledger.totals["checkpoint"] == 0.5 and ledger.debt  # 3 s to give: 0.5 s of room after step 2's own
    for n in range(3, 8):
        ledger.step(step(n, 0.5), T0 + n)
        assert_adds_up(ledger, T0 + n)
    assert ledger.totals["checkpoint"] == pytest.approx(3.0) and not ledger.debt
    assert ledger.totals["productive"] == pytest.approx(3.5)  # every step's 0.5 s, each in its own interval


def test_an_asynchronous_save_counts_when_it_blocked_not_again_when_committed():
    ledger = WallLedger(T0)
    ledger.step(step(1, 0.5), T0 + 1.0)
    ledger.save_blocked(1, 0.25)
    ledger.step(step(2, 0.5), T0 + 2.0)
    assert ledger.totals["checkpoint"] == 0.25 and ledger.totals["host_overhead"] == pytest.approx(0.25)
    ledger.event({"event": "checkpoint", "step": 1, "blocked_s": 0.25})  # its record, with the next step's results
    ledger.step(step(3, 0.5), T0 + 3.0)
    assert ledger.totals["checkpoint"] == 0.25 and ledger.totals["host_overhead"] == pytest.approx(0.75)
    assert_adds_up(ledger, T0 + 3.0)


def test_steps_rewound_are_redone():
    ledger = WallLedger(T0)
    for n in range(1, 6):
        ledger.step(step(n, 0.8), T0 + n)
        if n == 2:
            ledger.event({"event": "checkpoint", "step": 2, "blocked_s": 0.0})
    before = dict(ledger.totals)
    ledger.rewind(2)  # steps 3, 4 and 5 will be trained again
    assert ledger.totals["redone"] == pytest.approx(3.0)  # their 0.8 s and the 0.2 s between
    assert ledger.totals["productive"] == pytest.approx(before["productive"] - 2.4)
    assert sum(ledger.totals.values()) == pytest.approx(sum(before.values()))
    ledger.step(step(3, 0.8), T0 + 7.0)
    assert_adds_up(ledger, T0 + 7.0)
    # A step trained again without a rewind (healed back): its first record's seconds are redone too.
    ledger.step(step(3, 0.8), T0 + 8.0)
    assert ledger.totals["redone"] == pytest.approx(3.0 + 2.0)


def test_a_run_without_checkpoints_spends_constant_time_per_step_and_holds_a_bounded_ledger():
    ledger = WallLedger(T0)
    started = time.perf_counter()
    for n in range(1, 100_001):
        ledger.step(step(n, 0.5, data_wait_s=0.1), T0 + n)
        if n % 1000 == 0:  # fail as soon as it is too slow (it was quadratic)
            assert time.perf_counter() - started < 2.0, f"{n} steps took over 2 s"
    assert len(ledger.by_step) <= 2 * wallclock.STEP_WINDOW
    ledger.rewind(0)  # a failure with no checkpoint: every step is trained again
    assert ledger.totals["redone"] == pytest.approx(100_000 - 0.5) and ledger.totals["productive"] == 0.0
    assert sum(ledger.totals.values()) == pytest.approx(100_000)


def test_steps_folded_together_count_as_they_did_one_by_one(monkeypatch):
    def replay() -> dict[str, float]:
        ledger = WallLedger(T0)
        for n in range(1, 41):
            ledger.step(step(n, 0.6, data_wait_s=0.1), T0 + n)
            if n == 5:
                ledger.event({"event": "checkpoint", "step": 5, "blocked_s": 0.2})
                ledger.committed(5)
            if n == 20:
                ledger.rewind(5)  # restored from step 5 (the steps after it folded or not)
            if n == 30:
                ledger.event({"event": "checkpoint", "step": 30, "blocked_s": 2.5})  # a debt, for step 31
                ledger.committed(30)
        ledger.step(step(40, 0.6), T0 + 41.0)  # step 40 trained again (healed back)
        ledger.rewind(30)
        ledger.close(T0 + 42.0)
        assert_adds_up(ledger, T0 + 42.0)
        return ledger.totals

    one_by_one = replay()
    monkeypatch.setattr(wallclock, "STEP_WINDOW", 2)  # folds every few steps
    assert replay() == pytest.approx(one_by_one) and one_by_one["redone"] > 15


def test_a_restart_records_phases_and_a_resize_with_it_counts_once():
    ledger = WallLedger(T0)
    ledger.step(step(1, 1.0), T0 + 1.0)
    intr = Interruption("restart", "rank 1: gone", 2, 2, dp_after=1, detect_s=2.0, teardown_s=0.5, place_s=1.5)
    intr = intr.but(init_s=3.0, restore_s=1.0, first_step_s=1.0, total_s=9.0)
    ledger.event(intr.restart_record())
    ledger.event(intr.resize_record())  # dp changed: the same timings again
    ledger.step(step(2, 1.0), T0 + 10.0)
    got = ledger.totals
    assert (got["detection"], got["teardown"], got["waiting_for_nodes"]) == (2.0, 0.5, 1.5)
    assert (got["worker_init"], got["restore"]) == (3.0, 1.0)
    assert got["host_overhead"] == pytest.approx(0.0, abs=1e-9) and not ledger.debt
    assert_adds_up(ledger, T0 + 10.0)


def test_a_start_again_after_one_that_never_joined_counts_its_restore_once():
    """The first start failed before its workers joined; the second one's restore is both the
    start-up's restore phase and the restart's restore_s. A first start whose first step failed
    restored twice: both count."""
    intr = Interruption("restart", "rank 0: never joined", 1, 2, place_s=1.0, init_s=2.0, restore_s=1.5)
    for starts, restores in ((1, 1.5), (2, 3.0)):
        ledger = WallLedger(T0)
        for _ in range(starts):
            ledger.started()
        ledger.event(intr.restart_record())
        ledger.step(step(1, 1.0), T0 + 10.0, startup_restore=1.5)
        assert ledger.totals["restore"] == restores
        assert ledger.totals["startup"] == pytest.approx(10.0 - 1.0 - 1.0 - 2.0 - restores)
        assert_adds_up(ledger, T0 + 10.0)


def test_a_step_healed_forward_counts_with_its_recovery():
    """The survivors took step 2 before the failure; its record comes in the recovery, before the
    restart record, whose detection (from step 1's record) holds step 2's time."""
    ledger = WallLedger(T0)
    ledger.step(step(1, 1.0), T0 + 1.0)
    ledger.step(step(2, 1.0, healed_forward=True), T0 + 6.0)
    assert ledger.cursor == T0 + 1.0  # nothing given out yet
    intr = Interruption("restart", "rank 1: gone", 3, 2, detect_s=2.0, teardown_s=0.5, init_s=3.0, restore_s=1.0)
    ledger.event(intr.restart_record())
    ledger.step(step(3, 1.0), T0 + 9.0)
    got = ledger.totals
    assert (got["detection"], got["teardown"], got["worker_init"], got["restore"]) == (1.0, 0.5, 3.0, 1.0)
    assert got["productive"] == 3.0 and sorted(ledger.by_step) == [1, 2, 3] and not ledger.debt
    assert_adds_up(ledger, T0 + 9.0)


def test_a_failed_recovery_is_not_counted_twice_and_a_preemption_is_drain():
    ledger = WallLedger(T0)
    ledger.step(step(1, 1.0), T0 + 1.0)
    first = Interruption("restart", "a", 2, 2, detect_s=1.0, teardown_s=1.0, init_s=1.0).restart_record()
    ledger.event(first | {"interrupted": "rank 0 lost", "total_s": 2.5})
    again = Interruption("restart", "b", 2, 2, detect_s=4.0, teardown_s=1.0, init_s=1.0, restore_s=1.0)
    ledger.event(again.restart_record())  # its detection runs from step 1's record: 3.5 s of it counted
    ledger.step(step(2, 1.0), T0 + 11.0)
    assert ledger.totals["detection"] == pytest.approx(1.0 + 0.5)
    assert_adds_up(ledger, T0 + 11.0)
    ledger.event({"event": "checkpoint", "step": 2, "blocked_s": 0.5})
    ledger.event({"event": "preemption", "node": "n", "saved_step": 2, "lost_steps": 0})
    moved = Interruption("preempt", "node n preempted", 2, 2, dp_after=1, save_s=2.0, init_s=1.0, restore_s=0.5)
    ledger.event(moved.resize_record())
    ledger.step(step(3, 1.0), T0 + 17.0)
    assert ledger.totals["checkpoint"] == 0.5
    assert ledger.totals["preemption_drain"] == pytest.approx(1.5 + 1.5)  # its save_s less the blocking; the rest
    assert_adds_up(ledger, T0 + 17.0)


def test_the_end_goes_to_the_final_save_or_to_start_up():
    ledger = WallLedger(T0)
    ledger.close(T0 + 4.0, "failed")  # failed before any step
    assert ledger.totals["startup"] == 4.0
    ledger = WallLedger(T0)
    ledger.step(step(1, 1.0), T0 + 2.0)
    ledger.event({"event": "checkpoint", "step": 1, "blocked_s": 0.5})
    ledger.close(T0 + 5.0)
    assert ledger.totals["checkpoint"] == 3.0  # the final save and its upload
    assert_adds_up(ledger, T0 + 5.0)


def test_step_pieces_use_the_split_when_there_is_one():
    plain = step_pieces(step(1, 2.0, data_wait_s=0.4, bubble=0.5))
    assert plain == {"productive": 0.8, "data_wait": 0.4, "bubble": 0.8, "exposed_comm": 0.0, "host_overhead": 0.0}
    split = {"compute_s": 1.0, "data_wait_s": 0.2, "bubble_s": 0.3, "comm_dp_s": 0.1, "comm_tp_s": 0.1}
    pieces = step_pieces(step(1, 2.0, split={**split, "comm_pp_s": 0.1, "host_s": 0.2}))
    assert pieces["exposed_comm"] == pytest.approx(0.3) and sum(pieces.values()) == pytest.approx(2.0)


def test_an_earlier_process_steps_beyond_the_resumed_checkpoint_are_redone():
    entry = {
        "wall_s": 10.0,
        "seconds": dict.fromkeys(CAUSES, 0.0) | {"productive": 6.0, "startup": 4.0},
        "tail": [[5, {"productive": 1.0}], [6, {"productive": 1.0, "host_overhead": 0.0}]],
    }
    out = settled(entry, resumed=5)
    assert out["seconds"]["productive"] == 5.0 and out["seconds"]["redone"] == 1.0 and out["tail"] == []
    assert sum(out["seconds"].values()) == pytest.approx(10.0)


class MemoryStore:
    """A checkpoint store in memory: what the wall clock reads and writes of one."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def join(self, *parts: str) -> str:
        return "/".join(parts)

    def read_bytes(self, path: str) -> bytes:
        if path not in self.files:
            raise FileNotFoundError(path)
        return self.files[path]

    def write_bytes(self, path: str, data: bytes) -> None:
        self.files[path] = data


def process(store: MemoryStore, since: float) -> Wallclock:
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(enabled=True))
    clock, summary = SimpleNamespace(since=since), SimpleNamespace(startup={})
    wall = Wallclock(cfg, clock, summary, Path("unused"))
    wall.on_store(store)
    return wall


def test_a_process_whose_workers_never_started_leaves_the_earlier_tails_to_the_next(monkeypatch):
    """A fails at step 37 (checkpoint at 30); B dies before its workers start; C resumes from
    30: A's steps 31-37 are redone once, not kept as well as trained again."""
    now = [T0]
    monkeypatch.setattr(wallclock, "time", SimpleNamespace(time=lambda: now[0]))
    store = MemoryStore()
    a = process(store, T0)
    for n in range(1, 38):
        now[0] = T0 + n
        a.before_step(step(n, 1.0))  # 1 s of compute in each 1 s interval
        if n == 30:
            a.on_event({"event": "checkpoint", "step": 30, "blocked_s": 0.0})
    a.before_close({"wall_s": 40.0, "status": "failed"}, [])
    b = process(store, T0 + 50.0)  # its placement timed out: no after_workers_start
    b.before_close({"wall_s": 5.0, "status": "failed"}, [])
    c = process(store, T0 + 60.0)
    c.on_event({"event": "resume", "step": 30})
    c.after_workers_start([], {})
    for n in range(31, 64):
        now[0] = T0 + 30.0 + n
        c.before_step(step(n, 1.0))
    seconds, _ = c.seconds()
    assert seconds["productive"] == pytest.approx(63.0) and seconds["redone"] == pytest.approx(7.0)
    assert len(c.earlier) == 2


def test_a_failed_run_end_is_detection_even_after_an_asynchronous_save_was_reported():
    ledger = WallLedger(T0)
    ledger.step(step(10, 1.0), T0 + 10.0)
    ledger.save_blocked(10, 0.0)
    ledger.step(step(11, 1.0), T0 + 11.0)
    ledger.event({"event": "checkpoint", "step": 10, "blocked_s": 0.0})  # committed: reported with step 11's results
    ledger.close(T0 + 311.0, "failed")  # step 12 hung 300 s
    assert ledger.totals["detection"] == pytest.approx(300.0) and ledger.totals["checkpoint"] == 0.0
    assert_adds_up(ledger, T0 + 311.0)


def test_the_trackers_get_each_cause_as_a_scalar():
    from rayhybrid.tracking.base import step_scalars

    record = {"step": 3, "loss": 2.0, "goodput": dict.fromkeys(CAUSES, 1.5)}
    scalars = step_scalars(record)
    assert {f"goodput/{c}" for c in CAUSES} <= set(scalars) and scalars["goodput/redone"] == 1.5


# -- real runs ------------------------------------------------------------------------------------

COMMON = ["train.global_batch_size=8", "train.micro_batch_size=2", "data.seq_len=32", "eval.every=0"]


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def adds_up(summary: dict) -> dict:
    """The summary's goodput: every cause, none negative, adding up to its wall time within 1%
    (a run of one process: the summary's wall_s). Returns the seconds (other recovery tests use it)."""
    good = summary["goodput"]
    seconds = good["seconds"]
    assert set(seconds) == set(CAUSES) and min(seconds.values()) >= 0
    assert sum(seconds.values()) == pytest.approx(good["wall_s"], rel=0.01)
    if good["processes"] == 1:
        assert good["wall_s"] == pytest.approx(summary["wall_s"], rel=0.01)
    return seconds


def check_goodput(run_dir: Path, summary: dict) -> dict:
    """`adds_up`; every step record has running totals that never go down, but for kept seconds
    moving to redone; the goodput event, the chart. Returns the seconds."""
    seconds = adds_up(summary)
    good = summary["goodput"]
    kept = sum(seconds[c] for c in KEPT)
    assert good["effective_time"] == pytest.approx(kept / good["wall_s"], abs=1e-3)
    steps = [r for r in records(run_dir) if "loss" in r]
    assert steps and all(set(r["goodput"]) == set(CAUSES) for r in steps)
    for before, after in itertools.pairwise(steps):
        a, b = before["goodput"], after["goodput"]
        for cause in set(CAUSES) - set(KEPT):
            assert b[cause] >= a[cause] - 1e-3, cause
        assert sum(b[c] for c in (*KEPT, "redone")) >= sum(a[c] for c in (*KEPT, "redone")) - 1e-3
        assert sum(b.values()) >= sum(a.values())
    (event,) = [r for r in records(run_dir) if r.get("event") == "goodput"]
    assert event["seconds"] == seconds and event["effective_time"] == good["effective_time"]
    assert (run_dir / "goodput.png").stat().st_size > 1000
    return seconds


@pytest.mark.slow
def test_a_run_then_its_resumed_second_process(tmp_path, local_ray):
    """A run of 4 steps, checkpointed at 2 and 4, then a second process with the same
    checkpoint.dir in a new run dir, to step 6: the first adds up to its own wall time and to the
    test's clock around it (less the shutdown after summary.json); the second counts both."""
    import rayhybrid

    ckpt = tmp_path / "ckpt"
    overrides = [*COMMON, "checkpoint.every=2", f"checkpoint.dir={ckpt}"]
    begun = time.time()
    first = rayhybrid.train([*overrides, "train.steps=4"], run_dir=tmp_path / "a")
    measured = time.time() - begun
    seconds = check_goodput(tmp_path / "a", first)
    assert first["goodput"]["processes"] == 1
    assert first["goodput"]["wall_s"] == pytest.approx(first["wall_s"], abs=1e-3)
    assert first["goodput"]["wall_s"] <= measured and measured - first["goodput"]["wall_s"] < 0.01 * measured + 5.0
    assert seconds["startup"] > 0 and seconds["productive"] > 0 and seconds["checkpoint"] > 0
    assert seconds["redone"] == 0 and seconds["detection"] == 0
    stored = json.loads((ckpt / "goodput.json").read_text())["processes"]
    assert len(stored) == 1 and stored[0]["wall_s"] == pytest.approx(first["goodput"]["wall_s"], abs=1e-3)

    second = rayhybrid.train([*overrides, "train.steps=6"], run_dir=tmp_path / "b")
    assert second["resumed_step"] == 4
    both = check_goodput(tmp_path / "b", second)
    assert second["goodput"]["processes"] == 2
    assert second["goodput"]["wall_s"] == pytest.approx(first["wall_s"] + second["wall_s"], abs=0.01)
    for cause in CAUSES:
        assert both[cause] >= seconds[cause] - 1e-3, cause
    assert both["startup"] > seconds["startup"]  # the second process's start-up too
    assert len(json.loads((ckpt / "goodput.json").read_text())["processes"]) == 2


@pytest.mark.slow
def test_a_rank_killed_mid_run_is_detected_torn_down_restarted_restored_and_redone(tmp_path, local_ray):
    """dp2, a checkpoint every 3 steps, no peer healing: rank 1 SIGKILLed after step 5; the run
    restores step 3 and trains steps 4 and 5 (at least) again. Every phase of the recovery has its
    seconds, and the causes still add up to the wall time."""
    from tests.test_recovery import in_background, signal_rank, when_step

    run_dir = tmp_path / "run"
    overrides = ["+topology=dp2", *COMMON, "checkpoint.every=3", "fault.heal=false", "train.steps=8"]
    thread, result = in_background(overrides, run_dir)
    when_step(run_dir, 5)
    signal_rank(run_dir, 1, signal.SIGKILL)
    thread.join(timeout=300)
    summary = result.get("summary")
    assert summary is not None, result.get("error")
    assert summary["status"] == "completed" and summary["restarts"] == 1
    seconds = check_goodput(run_dir, summary)
    for cause in ("detection", "teardown", "worker_init", "restore", "redone", "productive", "startup"):
        assert seconds[cause] > 0, cause
    (recovery,) = summary["recoveries"]
    assert recovery["steps_redone"] >= 2
