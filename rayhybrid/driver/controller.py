"""The driver: a small state machine over the worker group. No torch.distributed here.

    summary = Controller(cfg).run()

The states and the run state they carry are in `rayhybrid.driver.state`. Each handler takes a
state and returns the next; the rules live in pure policies (`rayhybrid.driver.policies`): the
failure policy says restart or give up, the scaling policy which replica slots to train on,
the heal policy whether a recovery heals from the survivors' state or restores a checkpoint.
What stays on the Controller are its collaborators, built once when the run opens: the
policies, the fault plan, the run log (`rayhybrid.driver.runlog`, the one writer of the run's
files, with its reporters attached), the checkpoint ledger (`rayhybrid.driver.ledger`),
the drain watch, the launcher (`rayhybrid.driver.launcher`: it builds, rebuilds and restores
the worker group) and the SIGTERM watch. The one collaborator a run replaces is the worker
group: a start builds it (a start that failed leaves none), resizes and recoveries rebuild it,
and it is the one home of the replica slots in use, hence of dp.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import ray

from rayhybrid.cluster.connect import connect
from rayhybrid.cluster.group import WorkerGroup
from rayhybrid.config.schema import Config, with_dp
from rayhybrid.config.topology import Layout
from rayhybrid.data.identity import data_identity
from rayhybrid.driver.compatibility import check_fits
from rayhybrid.driver.launcher import Launcher
from rayhybrid.driver.ledger import CheckpointLedger
from rayhybrid.driver.observe import Observer
from rayhybrid.driver.policies import Failure, FailurePolicy, ScalingPolicy
from rayhybrid.driver.preemption import DrainWatch
from rayhybrid.driver.records import Interruption
from rayhybrid.driver.reporting import Tracked
from rayhybrid.driver.runlog import RunLog
from rayhybrid.driver.state import Failed, Finished, Recovering, Resizing, RunState, Starting, State, Stopped, Training
from rayhybrid.errors import RayHybridError, RunFailed, WorkerError
from rayhybrid.faults import FaultPlan, Injection
from rayhybrid.storage.store import open_store, redact_url
from rayhybrid.tracking import Trackers

__all__ = ["Controller", "RunFailed"]

log = logging.getLogger("rayhybrid")


class Controller:
    def __init__(self, cfg: Config, started: float | None = None) -> None:
        self.cfg = cfg
        self.started = started  # when the command started (wall clock): the start-up's phases begin there
        self.scaling = ScalingPolicy.of(cfg)
        self.failures = FailurePolicy(cfg.fault.max_restarts)
        self.faults = FaultPlan(cfg.fault)
        self.drains: DrainWatch | None = None
        self.log: RunLog | None = None
        self.ledger: CheckpointLedger | None = None
        self.launcher: Launcher | None = None
        self.sigterm = Sigterm()
        self.group: WorkerGroup | None = None
        """The worker group in use: built by a start, rebuilt by resizes and recoveries; None
        before a start succeeds and after one that failed."""
        self.handlers = {
            Starting: self.on_starting,
            Training: self.on_training,
            Recovering: self.on_recovering,
            Resizing: self.on_resizing,
        }

    def run(self) -> dict:
        self.log = RunLog(self.cfg, self.started)
        self.log.attach(Observer(self.cfg, self.log.dir))
        self.log.checkpoints_in(redact_url(self._checkpoint_url()))
        state: State = Starting(RunState())
        status, error, started_ray = "failed", None, False
        try:
            started_ray = self.open()
            self.sigterm.install()  # after ray.init, which installs its own
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
            self.sigterm.uninstall()
            summary = self._close(state, started_ray, status, error)
        return _report(summary, self.log.dir / "summary.json")

    def open(self) -> bool:
        """The store and its ledger, the trackers (before Ray starts: a tracker that cannot
        start is a config error, found fast; a resumed run continues the tracker runs the
        store names), then Ray. Returns whether this run started Ray."""
        cfg = self.cfg
        store = open_store(self._checkpoint_url(), cfg.checkpoint.storage_options, setting="checkpoint.dir")
        self.log.checkpoints_in(store.display, store)
        self.ledger = CheckpointLedger(cfg, store, self.log)
        self.drains = DrainWatch(cfg, self.scaling, self.ledger)
        found = self.ledger.latest()  # listed once: the trackers, the model check and the first start use it
        self.launcher = Launcher(cfg, self.scaling, self.ledger, self.drains, self.log, found)
        self.log.attach(Tracked(Trackers.open(cfg, self.log.dir, store, checkpoint_found=found is not None)))
        self.log.phase("launch")
        started_ray, _ = connect(cfg), self.log.phase("ray")
        return started_ray

    def _checkpoint_url(self) -> str:
        return self.cfg.checkpoint.dir or str(self.log.dir / "checkpoints")

    def prepare(self) -> None:
        """Before the first start: the checkpoint to resume fits this run (its model, global batch
        and data), and the cluster can ever hold the run."""
        found = self.launcher.found
        check_fits(found, self.cfg, data_identity(self.cfg.data) if found else None)
        self.launcher.prepare()

    # -- states ------------------------------------------------------------------------------

    def on_starting(self, state: Starting) -> Training | Recovering:
        """Place the replicas, start the workers on them and restore the latest checkpoint. A
        start that fails leaves nothing behind, and the controller no group."""
        start = self.launcher.start(state.run, state.pending)
        if start.group is None:
            good = self.ledger.latest()
            return self._failed(start.run, start.error, good.step + 1 if good else 1, None)
        self.group = start.group
        return Training(start.run.but(train_started=time.perf_counter()), start.pending)

    def on_training(self, state: Training) -> State:
        """One step; a checkpoint when one is due, and then perhaps a resize."""
        run = state.run
        if run.step >= self.cfg.train.steps:
            return self._finish(run, state.pending)
        if self.sigterm.received:
            return self._stop(run)
        inject = self.log.injected(self.faults.due(run.step + 1, "step", _world(self.cfg, self.dp)))
        try:
            (result,) = self.group.train(1, timeout_s=self.cfg.fault.step_timeout_s, inject=inject)
        except WorkerError as err:
            return self._failed(run, err, run.step + 1, inject)
        self.log.started_up(len(self.group.workers), result.metrics.get("data_wait_s") or 0.0)  # the first step
        if state.pending is not None:
            self.log.interruption(state.pending.close(result.metrics["step_time_s"]))
        metrics = self.log.step(result.metrics)
        run = self.ledger.saved(run.but(step=metrics["step"]), list(result.saves))
        return self._after_step(run, time.perf_counter())

    def on_resizing(self, state: Resizing) -> Training | Recovering:
        """Grow onto the slots given, restarting from the checkpoint just written."""
        run, intr = state.run, state.interruption
        self.log.resizing(self.dp, len(state.slots), intr)
        mark = time.perf_counter()
        run, err = self.launcher.rebuild(run, self.group, state.slots)
        if err is not None:
            return self._failed(run, err, intr.step + 1, None)
        return self._resume(run, intr.but(init_s=time.perf_counter() - mark, dp_after=self.dp), heal=False)

    def on_recovering(self, state: Recovering) -> Training | Starting | Recovering | Failed:
        """Keep the workers that survived, decide (restart or give up), replace what is gone
        (an elastic run shrinks when replicas cannot be placed again), restore."""
        run, intr = state.run, state.interruption
        mark = time.perf_counter()
        drained = self.group.drain() if self.group is not None else None
        failure = Failure(intr.step, str(state.error), state.injected or bool(drained and drained.nodes_lost))
        decision = self.failures.decide(failure, run.failures, run.restarts)
        run = run.but(failures=(*run.failures, failure))
        if not decision.restart:
            return Failed(run, RunFailed(f"{decision.reason}; {self.ledger.last_good()}"))
        run = run.but(restarts=run.restarts + 1)
        intr = intr.but(restart=run.restarts)
        log.warning("restart %d/%d: replacing the failed workers", intr.restart, self.cfg.fault.max_restarts)
        if self.group is None:  # the start failed: start again
            return Starting(run, intr)
        found_s = drained.found_s if drained else 0.0  # finding what failed is detection
        intr = intr.but(detect_s=intr.detect_s + found_s, teardown_s=time.perf_counter() - mark - found_s)
        return self._replace(run, intr, drained)

    # -- pieces ------------------------------------------------------------------------------

    def _after_step(self, run: RunState, last_step_at: float) -> State:
        """After step `run.step`: move off a draining node, or save when a checkpoint is due."""
        step = run.step
        notice = self.drains.notice(self.group, run.evacuated) if step < self.cfg.train.steps else {}
        if notice:  # checkpoint this step, then move off the draining nodes
            self.drains.announce(notice, step)
            run, err = self.ledger.save_now(run, self.group)
            if err is not None:
                return self._failed(run, err, step + 1, None)
            return self.drains.evacuate(run, self.group, notice, last_step_at)
        if not self.cfg.checkpoint.due(step, self.cfg.train.steps):
            return Training(run)
        inject = self.log.injected(self.faults.due(step, "save", _world(self.cfg, self.dp)))
        try:
            run = self.ledger.save(run, self.group, step, inject)
        except WorkerError as err:
            return self._failed(run, err, step + 1, inject)
        return Training(run) if step >= self.cfg.train.steps else self._grow(run, last_step_at)

    def _grow(self, run: RunState, last_step_at: float) -> Training | Resizing | Recovering:
        """At a checkpoint boundary: grow when more replicas are placed than in use. A resize
        restarts from this checkpoint, so its upload must be done."""
        slots = self.scaling.on_checkpoint(list(self.group.slots), self.group.placed_slots())
        if slots is None:
            return Training(run)
        try:
            run, _ = self.ledger.wait(run, self.group)
        except WorkerError as err:
            return self._failed(run, err, run.step + 1, None)
        if run.committed != run.step:
            return Training(run)  # it failed (reported): go on, a later checkpoint may resize
        cause = f"{len(slots) - self.dp} more replica(s) placed"
        save_s = time.perf_counter() - last_step_at
        return Resizing(
            run, tuple(slots), Interruption("grow", cause, run.step, self.dp, save_s=save_s, since=last_step_at)
        )

    def _replace(self, run: RunState, intr: Interruption, drained) -> Training | Recovering | Failed:
        """After the teardown: wait for the broken replicas to be placed, rebuild on the slots kept, restore."""
        mark = time.perf_counter()
        run, slots, why = self.launcher.replace(run, self.group, drained)
        if not slots:
            return Failed(run, RunFailed(f"{why}; {self.ledger.last_good()}"))
        intr, mark = intr.but(place_s=time.perf_counter() - mark), time.perf_counter()
        run, err = self.launcher.rebuild(run, self.group, slots)
        if err is not None:  # a rank lost while the group joins again
            return self._failed(run, err, intr.step, None, recovery=intr)
        intr = intr.but(init_s=time.perf_counter() - mark, dp_after=self.dp, replaced_ranks=sorted(drained.dead))
        return self._resume(run, intr, heal=True)

    def _stop(self, run: RunState) -> Stopped | Recovering:
        """Save the steps trained since the last checkpoint (unless checkpoint.every=0), wait for its upload, stop."""
        run, err = self.ledger.save_now(run, self.group)
        if err is not None:
            return self._failed(run, err, run.step + 1, None)
        kept = (
            f"checkpoint {self.log.summary.last_checkpoint}" if run.committed == run.step else self.ledger.last_good()
        )
        return Stopped(run, f"stopped by {self.sigterm.received} after step {run.step}; {kept}")

    def _finish(self, run: RunState, pending: Interruption | None) -> Finished | Recovering | Failed:
        """The last step is trained: commit its checkpoint (saved again from memory if its save
        failed or a heal abandoned it), and record a recovery that no step followed."""
        if pending is not None:
            self.log.interruption(pending.close(0.0))
        try:
            run, done = self.ledger.wait(run, self.group)
            lost = done is None and self.cfg.checkpoint.enabled and run.step not in (run.committed, run.first_restore)
            if lost or done is not None and done.error is not None:
                run = self.ledger.save(run, self.group, run.step, None)
                run, done = self.ledger.wait(run, self.group)
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
        intr = Interruption("restart", str(err), step, self.dp, resume_step=good.step if good else 0, detect_s=detect)
        return Recovering(run, err, intr, injected=inject is not None)

    def _resume(self, run: RunState, intr: Interruption, heal: bool) -> Training | Recovering:
        """Heal or restore the rebuilt group; a failure meanwhile is recovered from in turn."""
        try:
            return Training(*self.launcher.restore(run, self.group, intr, heal))
        except WorkerError as err:
            return self._failed(run, err, run.step + 1, None, recovery=intr)

    @property
    def dp(self) -> int:
        """Data-parallel replicas in use: the group's (0 without one)."""
        return self.group.dp if self.group is not None else 0

    def _close(self, state: State, started_ray: bool, status: str, error: str | None) -> dict:
        """summary.json from the run log and the final run state; the workers and Ray stopped."""
        run = state.run
        ended = isinstance(state, (Finished, Stopped)) and run.train_started is not None
        train_s = round(time.perf_counter() - run.train_started, 3) if ended else None
        best = self.ledger.best() if self.ledger is not None else None
        summary = self.log.close(status, error, restarts=run.restarts, train_s=train_s, best_checkpoint=best)
        if self.group is not None:
            self.group.shutdown(graceful=status == "completed")
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


def _world(cfg: Config, dp: int) -> int:
    return Layout.of(with_dp(cfg, dp)).world_size


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


class Sigterm:
    """SIGTERM (`ray job stop`, a reclaimed head node) asks the run to stop at the next step
    boundary: a handler must not interrupt a Ray call half-way, so it only notes the signal
    (`received`), which the controller reads before each step."""

    def __init__(self) -> None:
        self.received: str | None = None
        self.previous = None

    def install(self) -> None:
        """Handle SIGTERM from now on. Only the main thread may (a run in another thread, e.g.
        a test's, keeps the default)."""
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._handle)

    def uninstall(self) -> None:
        """The handler before `install` again."""
        if self.previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.previous)
        self.previous = None

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            log.warning("%s: saving a checkpoint and stopping after the step in progress", name)
        self.received = name
