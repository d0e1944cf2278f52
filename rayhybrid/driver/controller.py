"""The driver: a small state machine over the worker group. No torch.distributed here.

    summary = Controller(cfg).run()

The states and the run state they carry are in `rayhybrid.driver.state`. Each handler takes a
state and returns the next; the rules live in pure policies (`rayhybrid.driver.policies`): the
failure policy says restart or give up, the scaling policy which replica slots to train on,
the heal policy whether a recovery heals from the survivors' state or restores a checkpoint.
What stays on the Controller are its collaborators, built once when the run opens: the
policies, the fault plan, the run log (`rayhybrid.driver.runlog`, the one writer of the run's
files), the checkpoint ledger (`rayhybrid.driver.checkpoints`), the healing
(`rayhybrid.driver.healing`) and the drain watch. The one attribute a run changes is
`stop_requested`, which the SIGTERM handler sets.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import ray

from rayhybrid.cluster.connect import connect, resolve_shape
from rayhybrid.cluster.group import WorkerGroup
from rayhybrid.cluster.placement import check_capacity
from rayhybrid.config.schema import Config, with_dp
from rayhybrid.config.topology import Layout
from rayhybrid.driver.checkpoints import CheckpointLedger, check_same_model, open_store
from rayhybrid.driver.healing import Healing
from rayhybrid.driver.observe import Observer
from rayhybrid.driver.policies import Failure, FailurePolicy, ScalingPolicy
from rayhybrid.driver.preemption import DrainWatch, slots_on, why_not_placed
from rayhybrid.driver.records import Interruption
from rayhybrid.driver.runlog import RunLog, announce
from rayhybrid.driver.state import Failed, Finished, Recovering, Resizing, RunState, Starting, State, Stopped, Training
from rayhybrid.errors import RayHybridError, RunFailed, WorkerError
from rayhybrid.faults import FaultPlan, Injection
from rayhybrid.storage.store import redact_url
from rayhybrid.tracking import Trackers

__all__ = ["Controller", "RunFailed"]

log = logging.getLogger("rayhybrid")


class Controller:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.scaling = ScalingPolicy.of(cfg)
        self.failures = FailurePolicy(cfg.fault.max_restarts)
        self.faults = FaultPlan(cfg.fault)
        self.drains: DrainWatch | None = None
        self.log: RunLog | None = None
        self.ledger: CheckpointLedger | None = None
        self.healing: Healing | None = None
        self.shape = None
        self.found = None  # the latest checkpoint when the run opened: what its first start restores
        self.stop_requested: str | None = None  # set by the SIGTERM handler
        self.handlers = {
            Starting: self.on_starting,
            Training: self.on_training,
            Recovering: self.on_recovering,
            Resizing: self.on_resizing,
        }

    def run(self) -> dict:
        self.log = RunLog(self.cfg)
        self.log.observer = Observer(self.cfg, self.log.dir)
        self.log.summary.checkpoint_dir = redact_url(self._checkpoint_url())
        state: State = Starting(RunState())
        status, error, started_ray, previous = "failed", None, False, None
        try:
            started_ray = self.open()
            previous = _on_sigterm(self._request_stop)  # after ray.init, which installs its own
            self.prepare()
            while not state.terminal:
                state = self.handlers[type(state)](state)
            if isinstance(state, Failed):
                raise state.error
            status, error = ("interrupted", state.reason) if isinstance(state, Stopped) else ("completed", None)
        except KeyboardInterrupt:
            status, error = "interrupted", "interrupted by the user"
            raise
        except RayHybridError as err:
            error = str(err)
            raise
        finally:
            _on_sigterm(previous)
            summary = self._close(state, started_ray, status, error)
        return _report(summary, self.log.dir / "summary.json")

    def open(self) -> bool:
        """The store and its ledger, the trackers (before Ray starts: a tracker that cannot
        start is a config error, found fast; a resumed run continues the tracker runs the
        store names), then Ray. Returns whether this run started Ray."""
        cfg = self.cfg
        store = open_store(self._checkpoint_url(), cfg.checkpoint.storage_options)
        self.log.summary.checkpoint_dir = store.display
        self.ledger = CheckpointLedger(cfg, store, self.log)
        self.drains = DrainWatch(cfg, self.scaling, self.ledger)
        self.healing = Healing(cfg, self.log)
        self.found = self.ledger.latest()  # listed once: the trackers, the model check and the first start use it
        self.log.trackers = Trackers.open(cfg, self.log.dir, store, checkpoint_found=self.found is not None)
        return connect(cfg)

    def _checkpoint_url(self) -> str:
        return self.cfg.checkpoint.dir or str(self.log.dir / "checkpoints")

    def prepare(self) -> None:
        """Before the first start: the checkpoint to resume holds this model, and the cluster can
        ever hold the run."""
        check_same_model(self.found, self.cfg)
        self.shape = resolve_shape(self.cfg)
        check_capacity(self.shape, self.scaling.min_dp)
        announce(self.cfg, self.scaling, self.shape.use_gpu)

    # -- states ------------------------------------------------------------------------------

    def on_starting(self, state: Starting) -> Training | Recovering:
        """Place the replicas, start the workers on them and restore the latest checkpoint. A
        start that fails leaves nothing behind."""
        run, intr = state.run, state.pending
        group = WorkerGroup(self.cfg, self.shape, self.scaling.slots)
        mark = time.perf_counter()
        slots = tuple(self.scaling.on_start(group.reserve(self.scaling.min_dp)))
        placed = time.perf_counter()
        try:
            run = self.ledger.check_storage(run, group, slots)
            group.rebuild(list(slots))
        except WorkerError as err:
            group.shutdown(graceful=False)
            good = self.ledger.latest()
            return self._failed(run, err, good.step + 1 if good else 1, None)
        except BaseException:
            group.shutdown(graceful=False)
            raise
        run = run.but(group=group, slots=slots)
        if intr is not None:  # a start again, after the one before failed
            init_s = time.perf_counter() - placed
            intr = intr.but(place_s=placed - mark, init_s=init_s, dp_before=intr.dp_before or run.dp, dp_after=run.dp)
        try:
            run, intr = self._restore(run, intr)
        except BaseException:  # the state with this group is not returned: stop it here
            group.shutdown(graceful=False)
            raise
        self.log.started_up(len(group.workers))
        return Training(run.but(train_started=time.perf_counter()), intr)

    def on_training(self, state: Training) -> State:
        """One step; a checkpoint when one is due, and then perhaps a resize."""
        run = state.run
        if run.step >= self.cfg.train.steps:
            return self._finish(run)
        if self.stop_requested:
            return self._stop(run)
        inject = self.log.injected(self.faults.due(run.step + 1, "step", _world(self.cfg, run)))
        try:
            (result,) = run.group.train(1, timeout_s=self.cfg.fault.step_timeout_s, inject=inject)
        except WorkerError as err:
            return self._failed(run, err, run.step + 1, inject)
        if state.pending is not None:
            self.log.interruption(state.pending.close(result.metrics["step_time_s"]))
        metrics = self.log.step(result.metrics)
        run = self.ledger.saved(run.but(step=metrics["step"]), list(result.saves))
        return self._after_step(run, time.perf_counter())

    def on_resizing(self, state: Resizing) -> Training | Recovering:
        """Grow onto the slots given, restarting from the checkpoint just written."""
        run, intr = state.run, state.interruption
        self.log.resizing(run.dp, len(state.slots), intr)
        mark = time.perf_counter()
        try:
            run = self.ledger.check_storage(run, run.group, state.slots).but(slots=state.slots)
            run.group.rebuild(list(state.slots))
        except WorkerError as err:
            return self._failed(run, err, intr.step + 1, None)
        return self._resume(run, intr.but(init_s=time.perf_counter() - mark, dp_after=run.dp), heal=False)

    def on_recovering(self, state: Recovering) -> Training | Starting | Recovering | Failed:
        """Keep the workers that survived, decide (restart or give up), replace what is gone
        (an elastic run shrinks when replicas cannot be placed again), restore."""
        run, intr = state.run, state.interruption
        mark = time.perf_counter()
        drained = run.group.drain() if run.group is not None else None
        failure = Failure(intr.step, str(state.error), state.injected or bool(drained and drained.nodes_lost))
        decision = self.failures.decide(failure, run.failures, run.restarts)
        run = run.but(failures=(*run.failures, failure))
        if not decision.restart:
            return Failed(run, RunFailed(f"{decision.reason}; {self.ledger.last_good()}"))
        run = run.but(restarts=run.restarts + 1)
        intr = intr.but(restart=run.restarts)
        log.warning("restart %d/%d: replacing the failed workers", intr.restart, self.cfg.fault.max_restarts)
        if run.group is None:  # the start failed: start again
            return Starting(run, intr)
        found_s = drained.found_s if drained else 0.0  # finding what failed is detection
        intr = intr.but(detect_s=intr.detect_s + found_s, teardown_s=time.perf_counter() - mark - found_s)
        return self._replace(run, intr, drained)

    # -- pieces ------------------------------------------------------------------------------

    def _after_step(self, run: RunState, last_step_at: float) -> State:
        """After step `run.step`: move off a draining node, or save when a checkpoint is due."""
        step = run.step
        notice = self.drains.notice(run.group, run.slots, run.evacuated) if step < self.cfg.train.steps else {}
        if notice:  # checkpoint this step, then move off the draining nodes
            self.drains.announce(notice, step)
            run, err = self.ledger.save_now(run)
            if err is not None:
                return self._failed(run, err, step + 1, None)
            return self.drains.evacuate(run, notice, last_step_at)
        if not self.cfg.checkpoint.due(step, self.cfg.train.steps):
            return Training(run)
        inject = self.log.injected(self.faults.due(step, "save", _world(self.cfg, run)))
        try:
            run = self.ledger.save(run, step, inject)
        except WorkerError as err:
            return self._failed(run, err, step + 1, inject)
        return Training(run) if step >= self.cfg.train.steps else self._grow(run, last_step_at)

    def _grow(self, run: RunState, last_step_at: float) -> Training | Resizing | Recovering:
        """At a checkpoint boundary: grow when more replicas are placed than in use. A resize
        restarts from this checkpoint, so its upload must be done."""
        slots = self.scaling.on_checkpoint(list(run.slots), run.group.placed_slots())
        if slots is None:
            return Training(run)
        try:
            run, _ = self.ledger.wait(run)
        except WorkerError as err:
            return self._failed(run, err, run.step + 1, None)
        if run.committed != run.step:
            return Training(run)  # it failed (reported): go on, a later checkpoint may resize
        cause = f"{len(slots) - run.dp} more replica(s) placed"
        save_s = time.perf_counter() - last_step_at
        return Resizing(
            run, tuple(slots), Interruption("grow", cause, run.step, run.dp, save_s=save_s, since=last_step_at)
        )

    def _replace(self, run: RunState, intr: Interruption, drained) -> Training | Recovering | Failed:
        """After the teardown: wait for the broken replicas to be placed again (elsewhere, if
        their node is draining), rebuild on the slots the scaling policy keeps, restore."""
        group, mark = run.group, time.perf_counter()
        draining = self.drains.draining()
        moving = slots_on(group, drained.broken, draining)
        if moving:  # replicas that lost workers on a node being drained go elsewhere
            group.replace(moving)
            run = run.but(evacuated=run.evacuated | draining)
        elastic, cluster = self.cfg.elastic, self.cfg.cluster
        wait_s = elastic.reschedule_timeout_s if self.scaling.elastic else cluster.placement_timeout_s
        lost = group.wait_placed(drained.broken, wait_s)
        slots = tuple(self.scaling.on_loss(list(run.slots), lost))
        if not slots:
            return Failed(
                run, RunFailed(f"{why_not_placed(self.scaling, run.dp, lost, wait_s)}; {self.ledger.last_good()}")
            )
        intr, mark = intr.but(place_s=time.perf_counter() - mark), time.perf_counter()
        try:
            run = self.ledger.check_storage(run, group, slots).but(slots=slots)
            group.rebuild(list(slots))
        except WorkerError as err:  # a rank lost while the group joins again
            return self._failed(run, err, intr.step, None, recovery=intr)
        intr = intr.but(init_s=time.perf_counter() - mark, dp_after=run.dp, replaced_ranks=sorted(drained.dead))
        return self._resume(run, intr, heal=True)

    def _request_stop(self, signum, frame) -> None:
        """The SIGTERM handler: stop at the next step boundary (a handler must not interrupt a
        Ray call half-way)."""
        name = signal.Signals(signum).name
        if self.stop_requested is None:
            log.warning("%s: saving a checkpoint and stopping after the step in progress", name)
        self.stop_requested = name

    def _stop(self, run: RunState) -> Stopped | Recovering:
        """Save the steps trained since the last checkpoint (unless checkpoint.every=0), wait
        for the upload, and stop."""
        run, err = self.ledger.save_now(run)
        if err is not None:
            return self._failed(run, err, run.step + 1, None)
        kept = (
            f"checkpoint {self.log.summary.last_checkpoint}" if run.committed == run.step else self.ledger.last_good()
        )
        return Stopped(run, f"stopped by {self.stop_requested} after step {run.step}; {kept}")

    def _finish(self, run: RunState) -> Finished | Recovering | Failed:
        """The last step is trained: its checkpoint must be committed before the run is done. If
        its save failed, or a heal abandoned it, the state is in memory: save it once more."""
        try:
            run, done = self.ledger.wait(run)
            lost = done is None and self.cfg.checkpoint.enabled and run.step not in (run.committed, run.first_restore)
            if lost or done is not None and done.error is not None:
                run = self.ledger.save(run, run.step, None)
                run, done = self.ledger.wait(run)
        except WorkerError as err:
            return self._failed(run, err, run.step, None)
        if done is not None and done.error is not None:
            why = f"the final checkpoint (step {run.step}) could not be written: {done.error}"
            return Failed(run, RunFailed(f"{why}; {self.ledger.last_good()}"))
        return Finished(run)

    def _failed(self, run: RunState, err: WorkerError, step: int, inject: Injection | None, recovery=None):
        """A call failed at `step`, or the `recovery` from an earlier failure did: a Recovering."""
        if recovery is not None:  # the recovery itself failed: not the same failure repeating
            self.log.interrupted(recovery, err)
            err = WorkerError(err.rank, f"in the recovery: {err.message}")
        log.warning("step %d failed: %s", step, err)
        detect = max(0.0, time.time() - self.log.history[-1]["time"]) if self.log.history else 0.0
        good = self.ledger.latest()
        intr = Interruption("restart", str(err), step, run.dp, resume_step=good.step if good else 0, detect_s=detect)
        return Recovering(run, err, intr, injected=inject is not None)

    def _resume(self, run: RunState, intr: Interruption, heal: bool) -> Training | Recovering:
        """Heal or restore the rebuilt group; a failure meanwhile is recovered from in turn."""
        try:
            return Training(*self._restore(run, intr, heal))
        except WorkerError as err:
            return self._failed(run, err, run.step + 1, None, recovery=intr)

    def _restore(self, run: RunState, intr, heal: bool = False) -> tuple[RunState, Interruption | None]:
        """After a failure (`heal`), heal from the survivors' state when the heal policy says
        so, else load the latest checkpoint into the group (if any); describe the workers."""
        latest = self.found if run.first_restore is None else self.ledger.latest()
        healed = self.healing.heal(run, intr, latest) if heal else None
        if healed is not None:
            run, intr, finished = healed
            run = self.ledger.saved(run, finished)
        else:
            run, intr = self.ledger.restore(run, intr, latest)
        group = run.group
        self.log.workers(
            with_dp(self.cfg, run.dp), group.placement(), [i.pid for i in group.infos], group.descriptions[0]
        )
        return run, intr

    def _close(self, state: State, started_ray: bool, status: str, error: str | None) -> dict:
        """summary.json from the run log and the final run state; the workers and Ray stopped."""
        run = state.run
        ended = isinstance(state, (Finished, Stopped)) and run.train_started is not None
        train_s = round(time.perf_counter() - run.train_started, 3) if ended else None
        best = self.ledger.best() if self.ledger is not None else None
        summary = self.log.close(status, error, restarts=run.restarts, train_s=train_s, best_checkpoint=best)
        if run.group is not None:
            run.group.shutdown(graceful=status == "completed")
        if started_ray:
            ray.shutdown()
        return summary


def _report(s: dict, path) -> dict:
    """The run's last line: done, with its losses, or stopped, with why."""
    if s["status"] == "interrupted":
        log.warning("stopped: %s; summary in %s", s.get("error"), path)
        return s
    floor = s.get("loss_floor")
    val = s.get("final_val_loss")
    log.info(
        "done: %d steps in %.1fs, loss %s -> %s%s%s%s; summary in %s",
        s["steps"],
        s["wall_s"],
        _fmt(s["initial_loss"]),
        _fmt(s["final_loss"]),
        f" (floor {floor:.4f})" if floor is not None else "",
        f", val_loss {val:.4f} (best {s['best_val_loss']:.4f} at step {s['best_val_step']})" if val is not None else "",
        f", {s['restarts']} restart(s)" if s["restarts"] else "",
        path,
    )
    return s


def _world(cfg: Config, run: RunState) -> int:
    return Layout.of(with_dp(cfg, run.dp)).world_size


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _on_sigterm(handler):
    """Install `handler` for SIGTERM; returns the one before. Only the main thread may (a run
    in another thread, e.g. a test's, keeps the default)."""
    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)
