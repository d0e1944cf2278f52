"""The driver's states one at a time, without Ray: a `RunState` goes in, with a fake worker group
as the controller's, and the next state comes out (docs/design.md, "The driver's state
machine"). Each handler's inputs and outputs are in its signature; the controller itself is left
as it was (a start sets its group; nothing else does)."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

from rayhybrid.cluster.drain import Drained
from rayhybrid.cluster.group import WorkerGroup
from rayhybrid.config.topology import Topology
from rayhybrid.driver.controller import Controller
from rayhybrid.driver.launcher import Launcher
from rayhybrid.driver.ledger import CheckpointLedger
from rayhybrid.driver.policies import Failure
from rayhybrid.driver.records import Interruption
from rayhybrid.driver.runlog import RunLog
from rayhybrid.driver.state import Failed, Finished, Recovering, RunState, Training
from rayhybrid.errors import WorkerError
from rayhybrid.preflight import load_config
from rayhybrid.storage import checkpoints
from rayhybrid.storage.store import Store
from rayhybrid.trainer.results import HealResult, HeldState, RestoreResult, SaveResult, StepResult


class FakeGroup:
    """What the controller asks of a worker group, answered from lists the test sets. It trains
    on `slots` (dp is their number) until `rebuild` gives it others, as the real group does;
    `layout_dp` x `world` is the layout that healing reads."""

    def __init__(self, slots: tuple[int, ...] = (0,), layout_dp: int = 1, world: int = 1) -> None:
        self.calls: list[tuple] = []
        self.active = list(slots)
        self.fail_train: WorkerError | None = None
        self.saves: list[SaveResult] = []  # what group.save returns, in order
        self.finished: list[list[SaveResult]] = []  # what group.finished_saves returns, in order
        self.drained = Drained(frozenset(), frozenset(), frozenset())
        self.not_placed: set[int] = set()
        self.world = world
        self.env: dict = {}
        self.start_timeout_s = 1.0
        self.layout = types.SimpleNamespace(topology=Topology(layout_dp, 1, world // layout_dp))
        self.kept: list[HeldState | None] = [None] * world  # what each rank kept across a failure
        self.records: dict[int, dict] = {}  # the results a rank kept of its step (`recorded`)
        self.astray: dict[int, int] = {}  # rank -> the step it holds after a heal, if not the planned one
        self.cfg = None

    @property
    def slots(self) -> tuple[int, ...]:
        return tuple(self.active)

    @property
    def dp(self) -> int:
        return len(self.active)

    @property
    def workers(self) -> list:
        """Fake actors: `held` and `heal` answer from `kept` (the group's own `held`, `heal` and
        `trace` below call them): a rank holds the step it kept, or its sender's, and reports
        that step's record."""

        def worker(rank):
            def heal(src, receivers):
                self.calls.append(("heal", rank, src, receivers))
                moved = 100 if src is not None else 100 * len(receivers)  # a receiver: what it got
                step = self.astray.get(rank, self.kept[rank if src is None else src].step)
                record = self.records.get(rank)
                if record is None:  # what a rank that received its state reports: the samples it read
                    record = {
                        "step": step,
                        "consumed_samples": 8 * step,
                        "samples_read": [8 * step - 8 + 4 * (rank // 2), 4],
                    }
                return HealResult(step, StepResult(record), moved, 0.01)

            def trace(step, ranges):
                self.calls.append(("trace", rank, step, ranges))
                return [{"step": step, "sample": i} for start, count in ranges for i in range(start, start + count)]

            return types.SimpleNamespace(
                held=types.SimpleNamespace(remote=lambda: self.kept[rank]),
                heal=types.SimpleNamespace(remote=heal),
                trace=types.SimpleNamespace(remote=trace),
            )

        return [worker(rank) for rank in range(self.world)]

    # The worker group's own heal calls, on the fake actors; their answers come back as they are.
    held, heal, trace = WorkerGroup.held, WorkerGroup.heal, WorkerGroup.trace
    remote_calls = types.SimpleNamespace(get=lambda refs, timeout_s=None, what="call": list(refs))

    def train(self, steps, timeout_s=None, inject=None):
        self.calls.append(("train", inject))
        if self.fail_train is not None:
            raise self.fail_train
        step = 1 + sum(1 for c in self.calls if c[0] == "train") + getattr(self, "offset", 0) - 1
        metrics = {"step": step, "loss": 1.0 / step, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0}
        metrics |= {"step_time_s": 0.1, "consumed_samples": 8 * step}
        return [StepResult(metrics, tuple(self.finished.pop(0) if self.finished else []))]

    def save(self, root, keep, timeout_s=None, inject=None):
        self.calls.append(("save", root))
        return self.saves.pop(0)

    def finished_saves(self, timeout_s=None):
        self.calls.append(("finished_saves",))
        return self.finished.pop(0) if self.finished else []

    def nodes_of(self, slots):
        return []

    def placed_slots(self):
        return []

    def drain(self):
        self.calls.append(("drain",))
        return self.drained

    def wait_placed(self, slots, timeout_s):
        return {s for s in slots if s in self.not_placed}

    def rebuild(self, slots, generation=None):
        self.calls.append(("rebuild", list(slots)))
        self.active = list(slots)

    def reconfigure(self, cfg):
        self.calls.append(("reconfigure",))

    def load(self, path, meta):
        self.calls.append(("load", path))
        return RestoreResult(meta["step"], meta["consumed_samples"], 0.01)

    def placement(self):
        return [{"rank": r, "dp": 0, "pp": 0, "tp": 0, "node": "n", "gpu": None} for r in range(self.world)]

    @property
    def infos(self):
        return [types.SimpleNamespace(pid=100 + r) for r in range(self.world)]

    @property
    def descriptions(self):
        first = {"device_name": "cpu", "backend": "gloo", "device": "cpu", "model_params": 10, "loss_floor": None}
        return [first]


class NoDrains:
    """A drain watch that never sees a preemption notice."""

    def notice(self, group, evacuated):
        return {}

    def draining(self):
        return set()


def controller(tmp_path, *overrides: str, group: FakeGroup | None = None) -> Controller:
    """A controller whose run has opened (no checkpoint found), training on `group`."""
    cfg = dataclasses.replace(load_config(["train.steps=10", *overrides]), run_dir=str(tmp_path))
    ctrl = Controller(cfg)
    ctrl.log = RunLog(cfg)
    ctrl.ledger = CheckpointLedger(cfg, Store.open(str(tmp_path / "checkpoints")), ctrl.log)
    ctrl.drains = NoDrains()
    ctrl.launcher = Launcher(cfg, ctrl.scaling, ctrl.ledger, ctrl.drains, ctrl.log, None)
    ctrl.group = group
    return ctrl


def events(tmp_path) -> list[dict]:
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "event" in r]


def test_a_step_returns_the_next_state_and_leaves_the_controller_as_it_was(tmp_path):
    group = FakeGroup()
    ctrl = controller(tmp_path, "checkpoint.every=0", group=group)
    before = dict(vars(ctrl))
    state = ctrl.on_training(Training(RunState(step=0)))
    assert isinstance(state, Training) and state.run.step == 1 and ctrl.group is group
    assert dict(vars(ctrl)) == before  # nothing set on the controller
    assert not {f.name for f in dataclasses.fields(RunState)} & {"group", "slots"}  # values only: dp is the group's
    assert [m["step"] for m in ctrl.log.history] == [1]


def test_a_due_checkpoint_uploads_then_commits_through_the_ledger(tmp_path):
    group = FakeGroup()
    ctrl = controller(tmp_path, "checkpoint.every=1", group=group)
    group.saves = [SaveResult(1, str(tmp_path / "c/step_00000001"), True, 0.0, blocked_s=0.01)]
    run = ctrl.on_training(Training(RunState())).run
    assert run.uploading and run.committed is None  # saving: not committed yet
    # The upload's report comes back with the next step's results.
    group.finished = [[SaveResult(1, str(tmp_path / "c/step_00000001"), True, 0.0, blocked_s=0.01, upload_s=0.5)]]
    group.saves = [SaveResult(2, str(tmp_path / "c/step_00000002"), True, 0.0, blocked_s=0.01)]
    run = ctrl.on_training(Training(run)).run
    assert run.committed == 1 and run.uploading  # step 1 committed, step 2 uploading
    assert [(e["event"], e["step"]) for e in events(tmp_path)] == [("checkpoint", 1)]
    assert ctrl.log.summary.checkpoints["saved"] == 1 and ctrl.log.summary.last_checkpoint.endswith("step_00000001")


def test_a_failed_step_goes_to_recovering_with_what_failed(tmp_path):
    group = FakeGroup(slots=(0, 1))
    ctrl = controller(tmp_path, group=group)
    group.fail_train = WorkerError(0, "boom")
    state = ctrl.on_training(Training(RunState(step=4)))
    assert isinstance(state, Recovering)
    assert (state.interruption.step, state.interruption.dp_before, state.interruption.kind) == (5, 2, "restart")
    assert state.run.step == 4 and not state.injected


def test_recovery_replaces_the_dead_ranks_and_restores_the_latest_checkpoint(tmp_path):
    group = FakeGroup(slots=(0, 1), world=2)
    ctrl = controller(tmp_path, "+topology=dp2", group=group)
    group.drained = Drained(frozenset({1}), frozenset({1}), frozenset())
    store = ctrl.ledger.store
    path = checkpoints.begin(store, 4)
    store.write_bytes(f"{path}/.metadata", b"dcp")
    checkpoints.commit(store, path, {"step": 4, "consumed_samples": 32, "topology": {"dp": 2, "pp": 1, "tp": 1}})
    intr = Interruption("restart", "rank 1: boom", 5, 2)
    state = ctrl.on_recovering(
        Recovering(RunState(step=4, first_restore=0, committed=4), WorkerError(1, "x"), intr, False)
    )
    assert isinstance(state, Training)
    run = state.run
    assert (run.restarts, ctrl.group.slots, run.step, len(run.failures)) == (1, (0, 1), 4, 1)
    assert ctrl.group is group  # rebuilt in place, not replaced
    assert state.pending.replaced_ranks == [1] and state.pending.restart == 1 and state.pending.resume_step == 4
    assert ("rebuild", [0, 1]) in group.calls and (
        "load",
        str(tmp_path / "checkpoints" / "step_00000004"),
    ) in group.calls
    assert [e["event"] for e in events(tmp_path)] == ["resume"]
    assert (state.pending.healed, state.pending.steps_redone) == ("checkpoint", 0)


def recovering_dp2_tp2(
    tmp_path, kept: list, step: int = 6, records: dict | None = None, astray: dict | None = None, saved: bool = True
) -> tuple[Controller, FakeGroup, Training]:
    """dp2_tp2 at step `step`, rank 3 lost, a checkpoint of step 4 (unless not `saved`); each
    rank kept `kept`, with `records` (FakeGroup.records) and `astray` (FakeGroup.astray)."""
    group = FakeGroup(slots=(0, 1), layout_dp=2, world=4)
    ctrl = controller(tmp_path, "+topology=dp2_tp2", group=group)
    group.drained = Drained(frozenset({3}), frozenset({1}), frozenset())
    group.kept, group.records, group.astray = kept, records or {}, astray or {}
    store = ctrl.ledger.store
    if saved:
        path = checkpoints.begin(store, 4)
        store.write_bytes(f"{path}/.metadata", b"dcp")
        meta = {"step": 4, "consumed_samples": 32, "topology": {"dp": 2, "pp": 1, "tp": 2}}
        checkpoints.commit(store, path, meta)
    committed = 4 if saved else None
    run = RunState(step=step, first_restore=0, committed=committed, uploading=True)
    intr = Interruption("restart", "rank 3: boom", step + 1, 2)
    return ctrl, group, ctrl.on_recovering(Recovering(run, WorkerError(3, "x"), intr, False))


def test_recovery_heals_from_the_peer_with_the_same_shard_and_redoes_no_step(tmp_path):
    """Rank 3 (dp 1, tp 1) lost its state; rank 1 (dp 0, tp 1) holds the same shard: it sends,
    every other rank keeps its own; nothing is loaded and the run goes on at step 6."""
    kept = HeldState(6, 100, False)
    _, group, state = recovering_dp2_tp2(tmp_path, [kept, kept, kept, None])
    assert isinstance(state, Training) and state.run.step == 6 and not state.run.uploading
    heals = sorted(c for c in group.calls if c[0] == "heal")
    assert heals == [("heal", 0, None, []), ("heal", 1, None, [3]), ("heal", 2, None, []), ("heal", 3, 1, [])]
    assert not [c for c in group.calls if c[0] == "load"]
    intr = state.pending
    assert (intr.healed, intr.steps_redone, intr.resume_step, intr.bytes_sent) == ("peer", 0, 6, 100)
    assert [e["event"] for e in events(tmp_path)] == ["heal"]


def test_a_step_only_some_survivors_took_is_healed_forward_and_recorded(tmp_path):
    """Ranks 0 and 1 passed step 7's commit vote and stepped before rank 3 died; rank 2 did
    not. The run heals to step 7 (rank 2 from rank 0, rank 3 from rank 1) and records step 7,
    whose results the driver never had, through the one merge of every step: the figures of a
    rank that took it, the samples and the data trace of every rank (those that received their
    state report what they read), the longest data wait and CPU time of any rank."""
    record = {"step": 7, "loss": 0.5, "lr": 1e-3, "grad_norm": 0.1, "step_time_s": 0.1, "tokens_per_s": 1.0}
    record |= {"consumed_samples": 56, "dp": 2, "pp": 1, "tp": 2}
    rows = [{"step": 7, "sample": 48, "dataset": "d", "epoch": 0, "start": 0}]
    ahead = HeldState(7, 100, True)
    records = {
        0: record | {"samples_read": [48, 4], "data_wait_s": 0.2, "cpu_s": 0.3, "data_read": rows},
        1: record | {"samples_read": [48, 4], "data_wait_s": 0.5, "cpu_s": 0.1, "data_read": rows},
    }
    ctrl, group, state = recovering_dp2_tp2(tmp_path, [ahead, ahead, HeldState(6, 100, True), None], records=records)
    assert state.run.step == 7
    receivers = {c[1]: c[2] for c in group.calls if c[0] == "heal" and c[2] is not None}
    assert receivers == {2: 0, 3: 1}
    assert state.pending.bytes_sent == 200  # what ranks 0 and 1 sent; rank 2 kept a step, but received
    (step,) = ctrl.log.history
    assert (step["step"], step["loss"], step["samples"]) == (7, 0.5, [[48, 4], [52, 4]])
    assert (step["data_wait_s"], step["cpu_s"]) == (0.5, 0.3)  # the longest of any rank, not one rank's
    traced = {p.name for p in (tmp_path / "data_trace").iterdir()}
    assert traced == {"rank0.jsonl", "rank1.jsonl"}  # data.trace rows of the step, by rank
    assert state.pending.steps_redone == 0


def test_a_step_healed_forward_in_a_shrink_has_every_replica_it_was_trained_by(tmp_path):
    """dp3 trained step 7 (12 samples, 4 a replica); replica 1 was lost and the run shrank to
    dp2 (the new replica 1 is the old replica 2). The record of step 7 has the three ranges the
    step read, the lost replica's from the others' (the data invariant), and with data.trace
    its rows come from rank 0."""
    record = {"step": 7, "loss": 0.5, "lr": 1e-3, "grad_norm": 0.1, "step_time_s": 0.1, "tokens_per_s": 1.0}
    record |= {"consumed_samples": 84, "dp": 3, "pp": 1, "tp": 2}

    def rows(start):
        return [{"step": 7, "sample": i} for i in range(start, start + 4)]

    records = {
        r: record | {"samples_read": [72 if r < 2 else 80, 4], "data_read": rows(72 if r < 2 else 80)} for r in range(4)
    }
    ahead = HeldState(7, 100, True)
    ctrl, group, state = recovering_dp2_tp2(tmp_path, [ahead, ahead, ahead, None], records=records)
    assert state.run.step == 7
    (step,) = ctrl.log.history
    assert step["samples"] == [[72, 4], [76, 4], [80, 4]] and step["dp"] == 3
    assert [c for c in group.calls if c[0] == "trace"] == [("trace", 0, 7, [[76, 4]])]
    traced = [
        json.loads(line)["sample"] for p in (tmp_path / "data_trace").iterdir() for line in p.read_text().splitlines()
    ]
    assert sorted(traced) == sorted([*range(72, 84), *range(72, 76), *range(80, 84)])  # each rank's own, and the lost


def test_a_heal_whose_ranks_hold_another_step_than_planned_restores_the_checkpoint(tmp_path, caplog):
    """Rank 3 was to receive step 6 from rank 1 but reports step 5 after the heal: the run does
    not go on with mixed states; it restores the checkpoint, with a log line saying why."""
    kept = HeldState(6, 100, False)
    _, group, state = recovering_dp2_tp2(tmp_path, [kept, kept, kept, None], astray={3: 5})
    assert [c for c in group.calls if c[0] == "heal"]  # it healed, then looked
    assert ("load", str(tmp_path / "checkpoints" / "step_00000004")) in group.calls
    assert (state.run.step, state.pending.healed, state.pending.steps_redone) == (4, "checkpoint", 2)
    assert "rank(s) [3] hold step(s) [5]: restoring the checkpoint instead" in caplog.text
    assert ("reconfigure",) not in group.calls  # the checkpoint is loaded over every rank


def test_a_heal_astray_without_a_checkpoint_starts_every_rank_afresh(tmp_path, caplog):
    """The same, with no checkpoint to load over every rank: the ranks are built afresh (the
    group joins again) and the run starts over from step 0 rather than go on with mixed states."""
    kept = HeldState(6, 100, False)
    _, group, state = recovering_dp2_tp2(tmp_path, [kept, kept, kept, None], astray={3: 5}, saved=False)
    assert ("reconfigure",) in group.calls and not [c for c in group.calls if c[0] == "load"]
    assert (state.run.step, state.pending.healed, state.pending.steps_redone) == (0, "checkpoint", 6)
    assert "rank(s) [3] hold step(s) [5]: starting every rank afresh (no checkpoint) instead" in caplog.text


def test_a_step_taken_that_no_rank_kept_the_results_of_is_never_left_out(tmp_path, caplog):
    """Ranks 0 and 1 stepped to 7, but neither kept that step's results: healing forward would
    leave step 7 out of metrics.jsonl, so the run restores the checkpoint (and records the
    steps it trains again) and says why."""
    ahead = HeldState(7, 100, False)
    _, group, state = recovering_dp2_tp2(tmp_path, [ahead, ahead, HeldState(6, 1, True), None])
    assert not [c for c in group.calls if c[0] == "heal"]
    assert state.run.step == 4 and state.pending.healed == "checkpoint"
    assert "no rank that took it kept its results" in caplog.text


@pytest.mark.parametrize(
    ("kept", "why"),
    [
        ([HeldState(6, 1, False), HeldState(6, 1, False), HeldState(6, 1, False), None], "heal off"),
        ([HeldState(6, 1, False), None, HeldState(6, 1, False), None], "both copies of shard tp1 lost"),
        ([None, None, None, None], "nothing kept"),
    ],
)
def test_recovery_falls_back_to_the_checkpoint_without_a_live_copy(tmp_path, kept, why):
    if why == "heal off":
        ctrl = controller(tmp_path, "fault.heal=false")
        assert ctrl.launcher.healing.policy.choose({(0, 0): [6, None]}) is None
        return
    ctrl, group, state = recovering_dp2_tp2(tmp_path, kept)
    assert not [c for c in group.calls if c[0] == "heal"]
    assert ("load", str(tmp_path / "checkpoints" / "step_00000004")) in group.calls
    assert state.run.step == 4
    assert (state.pending.healed, state.pending.steps_redone) == ("checkpoint", 2)


def test_recovery_gives_up_on_a_failure_that_repeats(tmp_path):
    group = FakeGroup()
    ctrl = controller(tmp_path, group=group)
    earlier = Failure(5, "rank 0: boom", False)
    intr = Interruption("restart", "rank 0: boom", 5, 1)
    run = RunState(step=4, restarts=1, failures=(earlier,))
    state = ctrl.on_recovering(Recovering(run, WorkerError(0, "boom"), intr, False))
    assert isinstance(state, Failed) and "failed twice" in str(state.error)
    assert state.run.restarts == 1 and len(state.run.failures) == 2
    assert not [c for c in group.calls if c[0] == "rebuild"]


@pytest.mark.parametrize("elastic", [True, False])
def test_a_replica_not_placed_again_shrinks_an_elastic_run_and_fails_a_fixed_one(tmp_path, elastic):
    extra = ["elastic.enabled=true", "elastic.min_dp=1", "elastic.max_dp=2", "elastic.reschedule_timeout_s=1"]
    group = FakeGroup(slots=(0, 1), world=1)
    ctrl = controller(tmp_path, "+topology=dp2", *(extra if elastic else []), group=group)
    group.drained = Drained(frozenset({1}), frozenset({1}), frozenset({"node-b"}))
    group.not_placed = {1}
    intr = Interruption("restart", "node lost", 3, 2)
    state = ctrl.on_recovering(Recovering(RunState(step=2), WorkerError(1, "x"), intr, False))
    if elastic:
        assert isinstance(state, Training) and ctrl.group.slots == (0,) and state.pending.dp_after == 1
        assert ("rebuild", [0]) in group.calls
    else:
        assert isinstance(state, Failed) and "could not be placed again" in str(state.error)


def test_the_last_step_waits_for_the_upload_and_saves_again_once_if_it_failed(tmp_path):
    group = FakeGroup()
    ctrl = controller(tmp_path, "checkpoint.every=5", group=group)
    done = SaveResult(10, str(tmp_path / "c/step_00000010"), True, 0.0, blocked_s=0.0, upload_s=0.1)
    failed = dataclasses.replace(done, upload_s=None, error="disk full")
    group.finished = [[failed], [done]]
    group.saves = [dataclasses.replace(done, upload_s=None)]
    run = RunState(step=10, uploading=True)
    state = ctrl.on_training(Training(run))
    assert isinstance(state, Finished) and state.run.committed == 10
    assert [e["event"] for e in events(tmp_path)] == ["checkpoint_failed", "checkpoint"]
    # Twice failed: the run fails, naming the error.
    group.finished = [[failed], [failed]]
    group.saves = [dataclasses.replace(done, upload_s=None)]
    state = ctrl.on_training(Training(run))
    assert isinstance(state, Failed) and "could not be written: disk full" in str(state.error)


def test_a_stop_whose_save_fails_keeps_the_commit_it_recorded_before(tmp_path):
    """SIGTERM with step 5's upload in flight after step 7: the wait records step 5 as
    committed, then step 7's save fails. Recovery starts from a run state that knows step 5
    is committed (it is not recorded a second time when it is restored)."""
    group = FakeGroup()
    ctrl = controller(tmp_path, "checkpoint.every=5", group=group)
    ctrl.sigterm.received = "SIGTERM"
    done = SaveResult(5, str(tmp_path / "c/step_00000005"), True, 0.0, blocked_s=0.0, upload_s=0.1)
    group.finished = [[done]]

    def failing_save(*args, **kwargs):
        raise WorkerError(0, "node gone")

    group.save = failing_save
    state = ctrl.on_training(Training(RunState(step=7, uploading=True, first_restore=0)))
    assert isinstance(state, Recovering) and state.interruption.step == 8
    assert state.run.committed == 5 and not state.run.uploading
    assert ctrl.ledger.restored(state.run, checkpoints.Checkpoint(done.path, {"step": 5})).committed == 5
    assert [(e["event"], e["step"]) for e in events(tmp_path)] == [("checkpoint", 5)]  # once


def test_a_first_start_whose_restore_fails_stops_its_group(tmp_path, monkeypatch):
    """The state holding the new group is never returned when the restore raises: the start
    itself stops the group (nothing is left holding placement groups and devices)."""
    from rayhybrid.driver import launcher as launcher_module
    from rayhybrid.driver.state import Starting

    ctrl = controller(tmp_path)
    stopped = []

    class Group(FakeGroup):
        def __init__(self, *args):
            super().__init__()

        def reserve(self, needed):
            return [0]

        def placement(self):
            raise OSError("disk full")  # writing workers.json, say

        def shutdown(self, graceful=True):
            stopped.append(graceful)

    monkeypatch.setattr(launcher_module, "WorkerGroup", Group)
    with pytest.raises(OSError, match="disk full"):
        ctrl.on_starting(Starting(RunState()))
    assert stopped == [False] and ctrl.group is None


def test_a_start_whose_workers_do_not_join_leaves_no_group_and_recovers(tmp_path, monkeypatch):
    """The workers of a new group fail to join: the start stops that group and the controller
    holds none (dp 0), so the recovery starts again rather than rebuild a group that is gone;
    a start that succeeds then gives the controller its group."""
    from rayhybrid.driver import launcher as launcher_module
    from rayhybrid.driver.state import Starting

    ctrl = controller(tmp_path)
    built: list[FakeGroup] = []

    class Group(FakeGroup):
        def __init__(self, *args):
            super().__init__(slots=())
            self.stopped: list[bool] = []
            built.append(self)

        def reserve(self, needed):
            return [0]

        def rebuild(self, slots, generation=None):
            super().rebuild(slots)
            if len(built) == 1:
                raise WorkerError(0, "could not join")

        def shutdown(self, graceful=True):
            self.stopped.append(graceful)

    monkeypatch.setattr(launcher_module, "WorkerGroup", Group)
    state = ctrl.on_starting(Starting(RunState()))
    assert isinstance(state, Recovering) and ctrl.group is None and built[0].stopped == [False]
    assert (state.interruption.step, state.interruption.dp_before) == (1, 0)
    state = ctrl.on_recovering(state)
    assert isinstance(state, Starting) and state.pending.restart == 1
    state = ctrl.on_starting(state)
    assert isinstance(state, Training) and ctrl.group is built[1] and not built[1].stopped
    assert (state.pending.dp_before, state.pending.dp_after) == (1, 1)


def test_a_final_checkpoint_that_a_heal_abandoned_is_saved_again(tmp_path):
    """A rank died in the final save; the run healed to the last step, but that save was
    abandoned with the failure: the run saves it again before it counts as finished. A run
    that resumed at its last step saves nothing (its checkpoint is the one it resumed from)."""
    group = FakeGroup()
    ctrl = controller(tmp_path, "checkpoint.every=4", group=group)
    path = str(tmp_path / "checkpoints" / "step_00000010")
    group.saves = [SaveResult(10, path, True, 0.0, blocked_s=0.01)]
    group.finished = [[SaveResult(10, path, True, 0.0, blocked_s=0.01, upload_s=0.1)]]
    state = ctrl.on_training(Training(RunState(step=10, committed=8, first_restore=0)))
    assert isinstance(state, Finished) and state.run.committed == 10
    assert [c[0] for c in group.calls] == ["save", "finished_saves"]
    resumed = ctrl.group = FakeGroup()
    state = ctrl.on_training(Training(RunState(step=10, first_restore=10)))
    assert isinstance(state, Finished) and not resumed.calls


def test_a_rank_that_received_its_state_reports_the_samples_it_read_and_their_trace():
    """The record a rank gives of the step it holds after a heal, without that step's results
    (`trainer.heal.step_record`), has what its own `train_step` reported of its data: its
    replica's samples and, with data.trace, where each came from. A rank with the results
    reports them as they are."""
    from distributed import heal_records, run_configs

    cfg = load_config(["+topology=dp2_pp2", "data.trace=true", "train.global_batch_size=4", "train.micro_batch_size=1"])
    for rank, r in enumerate(run_configs(heal_records, {"dp2_pp2": cfg}, 2)):
        trained, received = r["trained"], r["received"]
        assert received["step"] == trained["step"] == 2 and received["consumed_samples"] == 8
        assert received["samples_read"] == trained["samples_read"] == [4 + 2 * (rank // 2), 2], rank
        assert received["data_read"] == trained["data_read"] and len(received["data_read"]) == 2
        assert "loss" not in received and r["kept"] == trained
