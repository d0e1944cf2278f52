"""The driver: a small state machine over the worker group. No torch.distributed here.

    summary = Controller(cfg).run()

    Starting ──> Training ──(every step)──> Training ──(last step)──> Finished
                  │    ▲  └─(checkpoint, more replicas placed)─> Resizing ─┐
                  │    └──────────────────────────────────────────────────┘
                  ├─(a call failed)─> Recovering ──> Training, Starting (the start failed) or Failed
                  └─(SIGTERM)─> a final checkpoint ──> Stopped (exit code 130)

Each state's handler is short; the rules live in pure policies (`rayhybrid.driver.policies`): the failure
policy says restart or give up, the scaling policy which replica slots to train on. The records
(`rayhybrid.driver.records`) have one writer, which keeps `metrics.jsonl` and `summary.json` in
`cfg.run_dir`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass
from typing import ClassVar

import ray

from rayhybrid.cluster.connect import connect, resolve_shape
from rayhybrid.cluster.group import WorkerGroup, not_placed_again
from rayhybrid.cluster.placement import check_capacity, draining_nodes
from rayhybrid.config.schema import Config
from rayhybrid.config.topology import Layout
from rayhybrid.config.validate import usable_dps
from rayhybrid.driver.observe import Observer
from rayhybrid.driver.policies import Failure, FailurePolicy, ScalingPolicy
from rayhybrid.driver.records import Interruption, RunLog, RunSummary
from rayhybrid.errors import ConfigError, RayHybridError, RunFailed, WorkerError
from rayhybrid.faults import FaultPlan, Injection
from rayhybrid.storage import checkpoints as checkpoint_store
from rayhybrid.storage.store import Store, redact_url
from rayhybrid.storage.visibility import check_storage
from rayhybrid.tracking import Trackers

__all__ = ["Controller", "RunFailed"]

log = logging.getLogger("rayhybrid")


class State:
    terminal: ClassVar[bool] = False


@dataclass(frozen=True)
class Starting(State):
    pending: Interruption | None = None  # a start that failed before: recorded after the first step


@dataclass(frozen=True)
class Training(State):
    step: int  # the last step completed
    pending: Interruption | None = None  # a restart or resize, until its first step is done


@dataclass(frozen=True)
class Recovering(State):
    error: WorkerError
    interruption: Interruption
    injected: bool  # the failing call carried a `fault.inject` fault


@dataclass(frozen=True)
class Resizing(State):
    slots: list[int]
    interruption: Interruption


@dataclass(frozen=True)
class Finished(State):
    terminal: ClassVar[bool] = True


@dataclass(frozen=True)
class Stopped(State):
    """SIGTERM (`ray job stop`, a reclaimed head node): stopped at a step boundary, after a
    final checkpoint."""

    reason: str
    terminal: ClassVar[bool] = True


@dataclass(frozen=True)
class Failed(State):
    error: RunFailed
    terminal: ClassVar[bool] = True


class Controller:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.elastic = cfg.elastic.enabled
        usable = usable_dps(cfg) if self.elastic else [cfg.topology.dp]
        min_dp = min(d for d in usable if d >= cfg.elastic.min_dp) if self.elastic else cfg.topology.dp
        self.scaling = ScalingPolicy(usable, min_dp, self.elastic)
        self.failures = FailurePolicy(cfg.fault.max_restarts)
        self.faults = FaultPlan(cfg.fault)
        self.failed_before: list[Failure] = []
        self.group: WorkerGroup | None = None
        self.shape = None
        self.handlers = {
            Starting: self.on_starting,
            Training: self.on_training,
            Recovering: self.on_recovering,
            Resizing: self.on_resizing,
        }

    def run(self) -> dict:
        cfg = self.cfg
        self.log = RunLog(cfg)
        self.default_dir = not cfg.checkpoint.dir
        self.checkpoint_url = cfg.checkpoint.dir or str(self.log.dir / "checkpoints")
        self.store: Store | None = None
        self.storage_seen: set[str] = set()  # nodes that passed the storage check
        self.saving = False  # a save was started whose outcome the driver has not had yet
        self.committed_step: int | None = None  # the newest checkpoint committed in this run
        self.started_at: int | None = None  # the step of the run's first restore (0: from scratch)
        self.evacuated: set[str] = set()  # nodes the run moved off after a preemption notice
        self.next_drain_poll = 0.0
        self.summary = RunSummary(
            topology={**dataclasses.asdict(cfg.topology), **Layout.of(cfg).summary()},
            model=dataclasses.asdict(cfg.model),
            data={"name": cfg.data.name, "seq_len": cfg.data.seq_len},
            global_batch_size=cfg.train.global_batch_size,
            micro_batch_size=cfg.train.micro_batch_size,
            run_dir=str(self.log.dir),
            checkpoint_dir=redact_url(self.checkpoint_url),
        )
        self.observer = Observer(cfg, self.log.dir)
        started_ray = False
        self.stop_requested: str | None = None
        previous = None
        try:
            self.store = open_store(self.checkpoint_url, cfg.checkpoint.storage_options)
            self.summary.checkpoint_dir = self.store.display
            # Before Ray starts: a tracker that cannot start is a config error, found fast. A
            # resumed run continues the tracker runs the checkpoint store names.
            self.log.trackers = Trackers.open(cfg, self.log.dir, self.store)
            started_ray = connect(cfg)
            previous = _on_sigterm(self._request_stop)  # after ray.init, which installs its own
            state: State = Starting()
            while not state.terminal:
                state = self.handlers[type(state)](state)
            if isinstance(state, Failed):
                raise state.error
            if isinstance(state, Stopped):
                self.summary.status, self.summary.error = "interrupted", state.reason
            else:
                self.summary.status = "completed"
        except KeyboardInterrupt:
            self.summary.status, self.summary.error = "interrupted", "interrupted by the user"
            raise
        except RayHybridError as err:
            self.summary.status, self.summary.error = "failed", str(err)
            raise
        finally:
            _on_sigterm(previous)
            self._close(started_ray)
        s = self.summary
        if s.status == "interrupted":
            log.warning("stopped: %s; summary in %s", s.error, self.log.dir / "summary.json")
            return s.to_dict()
        floor = s.workers.get("loss_floor")
        log.info(
            "done: %d steps in %.1fs, loss %s -> %s%s%s%s; summary in %s",
            s.steps,
            s.wall_s,
            _fmt(s.initial_loss),
            _fmt(s.final_loss),
            f" (floor {floor:.4f})" if floor is not None else "",
            f", val_loss {s.final_val_loss:.4f} (best {s.best_val_loss:.4f} at step {s.best_val_step})"
            if s.final_val_loss is not None
            else "",
            f", {s.restarts} restart(s)" if s.restarts else "",
            self.log.dir / "summary.json",
        )
        return self.summary.to_dict()

    # -- states ------------------------------------------------------------------------------

    def on_starting(self, state: Starting) -> Training | Recovering:
        """Place the replicas, start the workers on them and restore the latest checkpoint. A
        start that fails leaves nothing behind."""
        if self.shape is None:
            check_same_model(checkpoint_store.latest(self.store), self.cfg)
            self.shape = resolve_shape(self.cfg)
            check_capacity(self.shape, self.scaling.min_dp)
            self._announce()
        group, intr = WorkerGroup(self.cfg, self.shape, self.scaling.slots), state.pending
        mark = time.perf_counter()
        slots = self.scaling.on_start(group.reserve(self.scaling.min_dp))
        placed = time.perf_counter()
        try:
            self._check_storage(group, slots)
            group.rebuild(slots)
        except WorkerError as err:
            group.shutdown(graceful=False)
            good = checkpoint_store.latest(self.store)
            return self._failed(err, good.step + 1 if good else 1, None)
        except BaseException:
            group.shutdown(graceful=False)
            raise
        self.group = group
        if intr is not None:  # a start again, after the one before failed
            intr.place_s, intr.init_s = placed - mark, time.perf_counter() - placed
            intr.dp_before, intr.dp_after = intr.dp_before or group.dp, group.dp
        step = self._restore(intr)
        if self.summary.startup_s is None:
            self.summary.startup_s = round(time.perf_counter() - self.log.started, 3)
            w = self.summary.workers
            log.info(
                "started %d workers in %.1fs; %s parameters; run dir %s%s",
                len(group.workers),
                self.summary.startup_s,
                f"{w['params']:,}",
                self.log.dir,
                f"; data loss floor {w['loss_floor']:.4f}" if w["loss_floor"] is not None else "",
            )
        self.train_started = time.perf_counter()
        return Training(step, intr)

    def on_training(self, state: Training) -> Training | Recovering | Resizing | Finished:
        """One step; a checkpoint when one is due, and then perhaps a resize."""
        step, group = state.step, self.group
        if step >= self.cfg.train.steps:
            return self._finish(step)
        if self.stop_requested:
            return self._stop(step)
        inject = self._inject(step + 1, "step")
        try:
            (metrics,) = group.train(1, timeout_s=self.cfg.fault.step_timeout_s, inject=inject)
        except WorkerError as err:
            return self._failed(err, step + 1, inject)
        finished = metrics.pop("checkpoints", [])
        metrics = self.observer.step(metrics)
        if state.pending is not None:
            state.pending.close(metrics["step_time_s"])
            self.log.interruption(state.pending, self.summary)
        self.log.step(metrics)
        self._saved(finished)
        step, last_step_at = metrics["step"], time.perf_counter()
        notice = self._preemption_notice() if step < self.cfg.train.steps else {}
        if notice:
            return self._evacuate(step, notice, last_step_at)
        if not self.cfg.checkpoint.due(step, self.cfg.train.steps):
            return Training(step)
        inject = self._inject(step, "save")
        try:
            self._save(step, inject)
        except WorkerError as err:
            return self._failed(err, step + 1, inject)
        if step >= self.cfg.train.steps:
            return Training(step)
        slots = self.scaling.on_checkpoint(group.active, group.placed_slots())
        if slots is None:
            return Training(step)
        # A resize restarts from this checkpoint: its upload must be done.
        try:
            self._wait_for_saves()
        except WorkerError as err:
            return self._failed(err, step + 1, None)
        if self.committed_step != step:
            return Training(step)  # it failed (reported): go on, a later checkpoint may resize
        cause = f"{len(slots) - len(group.active)} more replica(s) placed"
        save_s = time.perf_counter() - last_step_at
        return Resizing(slots, Interruption("grow", cause, step, group.dp, save_s=save_s, since=last_step_at))

    def on_resizing(self, state: Resizing) -> Training | Recovering:
        """Grow onto the slots given, restarting from the checkpoint just written."""
        intr, group = state.interruption, self.group
        log.warning(
            "resize dp %d -> %d at step %d: %s; restarting from the checkpoint just written",
            group.dp,
            len(state.slots),
            intr.step,
            intr.cause,
        )
        mark = time.perf_counter()
        try:
            self._check_storage(group, state.slots)
            group.rebuild(state.slots)
        except WorkerError as err:
            return self._failed(err, intr.step + 1, None)
        intr.init_s, intr.dp_after = time.perf_counter() - mark, group.dp
        return Training(self._restore(intr), intr)

    def on_recovering(self, state: Recovering) -> Training | Starting | Failed:
        """Keep the workers that survived, decide (restart or give up), replace what is gone
        (an elastic run shrinks when replicas cannot be placed again), restore."""
        intr, group = state.interruption, self.group
        mark = time.perf_counter()
        drained = group.drain() if group is not None else None
        external = state.injected or bool(drained and drained.nodes_lost)
        failure = Failure(intr.step, str(state.error), external)
        decision = self.failures.decide(failure, self.failed_before, self.summary.restarts)
        self.failed_before.append(failure)
        if not decision.restart:
            return Failed(RunFailed(f"{decision.reason}; {self._last_good()}"))
        self.summary.restarts += 1
        intr.restart = self.summary.restarts
        log.warning(
            "restart %d/%d: replacing the failed workers and restarting from %s",
            intr.restart,
            self.cfg.fault.max_restarts,
            self._last_good(short=True),
        )
        if group is None:  # the start failed: start again
            return Starting(intr)
        intr.teardown_s = time.perf_counter() - mark
        mark = time.perf_counter()
        # Replicas that lost workers on a node being drained go elsewhere (nothing new starts there).
        draining = set(draining_nodes())
        moving = [slot for slot in drained.broken if set(group.nodes_of([slot])) & draining]
        if moving:
            group.replace(moving)
            self.evacuated |= draining
        wait_s = self.cfg.elastic.reschedule_timeout_s if self.elastic else self.cfg.cluster.placement_timeout_s
        lost = group.wait_placed(drained.broken, wait_s)
        slots = self.scaling.on_loss(group.active, lost)
        if not slots:
            return Failed(RunFailed(f"{self._why_not_placed(lost, wait_s)}; {self._last_good()}"))
        intr.place_s = time.perf_counter() - mark
        mark = time.perf_counter()
        try:
            self._check_storage(group, slots)
            group.rebuild(slots)
        except WorkerError as err:
            return self._failed(err, intr.step, None)
        intr.init_s, intr.dp_after = time.perf_counter() - mark, group.dp
        intr.replaced_ranks = sorted(drained.dead)
        return Training(self._restore(intr), intr)

    # -- pieces ------------------------------------------------------------------------------

    def _check_storage(self, group: WorkerGroup, slots: list[int]) -> None:
        """The storage check (cluster/storage_check.py) on the nodes of `slots` not checked yet.
        A POSIX path is what the driver's own node sees by definition; stores are checked
        everywhere (the workers' credentials are not the driver's)."""
        if self.cfg.checkpoint.every == 0 and self.default_dir:
            return  # no checkpoint is written, and none can be there to resume
        nodes = [n for n in group.nodes_of(slots) if n not in self.storage_seen]
        if self.store.local:
            here = ray.get_runtime_context().get_node_id()
            nodes = [n for n in nodes if n != here]
        if nodes:
            check_storage(self.store, nodes, group.env, default=self.default_dir)
            self.storage_seen.update(nodes)

    def _save(self, step: int, inject: Injection | None) -> None:
        """Save the checkpoint of `step`: written by the time this returns, or uploading (async);
        records any earlier upload that finished meanwhile."""
        ck = self.cfg.checkpoint
        saved = self.group.save(self.store.url, ck.keep, self.cfg.fault.step_timeout_s, inject)
        self._saved(saved.pop("finished", []))
        if saved["async"]:
            self.saving = True
            log.info(
                "checkpoint step %d: training blocked %.2fs; uploading to %s",
                step,
                saved["blocked_s"],
                redact_url(saved["path"]),
            )
        else:
            self._saved([saved])

    def _wait_for_saves(self) -> dict | None:
        """Wait for the upload in flight (if any); its record, once recorded."""
        if not self.saving:
            return None
        done = self.group.finished_saves(self.group.start_timeout_s)
        self._saved(done)
        return done[-1] if done else None

    def _saved(self, records: list[dict]) -> None:
        """Saves that finished: committed ones are checkpoints; failed ones leave the one before
        as the latest (the next save tries again)."""
        for r in records:
            self.saving = False
            path = redact_url(r["path"])
            if "error" in r:
                log.warning("checkpoint step %d failed: %s; %s", r["step"], r["error"], self._last_good())
                self.log.event({"event": "checkpoint_failed", "step": r["step"], "path": path, "error": r["error"]})
                self.summary.checkpoints["failed"] += 1
                continue
            blocked, upload = round(r["blocked_s"], 3), round(r["upload_s"], 3)
            log.info(
                "checkpoint step %d committed: %s (training blocked %.2fs, %s %.2fs)",
                r["step"],
                path,
                blocked,
                "upload" if r["async"] else "of it writing",
                upload,
            )
            self.log.event(
                {"event": "checkpoint", "step": r["step"], "path": path, "blocked_s": blocked, "upload_s": upload}
                | {"async": r["async"]}
            )
            self.summary.last_checkpoint, self.committed_step = path, r["step"]
            c = self.summary.checkpoints
            c["saved"] += 1
            c["blocked_s"] = round(c["blocked_s"] + blocked, 3)
            c["upload_s"] = round(c["upload_s"] + upload, 3)

    def _unreported_commit(self, ckpt: checkpoint_store.Checkpoint | None) -> None:
        """Record a checkpoint that this run committed but whose report the driver never had:
        an asynchronous save's commit is reported with the next step's results, which a failure
        can take with it. Restoring it is right (it is committed); recording it keeps
        metrics.jsonl and the summary true to what was saved. Its timings are not known."""
        step = ckpt.step if ckpt is not None else 0
        if self.started_at is None:  # the run's first restore: what it found, not what it saved
            self.started_at = step
            return
        if step <= max(self.committed_step or 0, self.started_at):
            return
        path = redact_url(str(ckpt.path))
        log.info("checkpoint step %d committed: %s (its report was lost with the failure)", step, path)
        self.log.event(
            {"event": "checkpoint", "step": step, "path": path, "blocked_s": None, "upload_s": None}
            | {"async": self.cfg.checkpoint.async_save}
        )
        self.summary.last_checkpoint, self.committed_step = path, step
        self.summary.checkpoints["saved"] += 1

    def _preemption_notice(self) -> dict[str, float]:
        """Nodes of the replicas in use that Ray is draining (a spot node's preemption notice,
        an autoscaler scaling in): node id -> seconds left to the deadline (inf: none given).
        Asks the GCS at most once every DRAIN_POLL_S."""
        now = time.monotonic()
        if now < self.next_drain_poll:
            return {}
        self.next_drain_poll = now + DRAIN_POLL_S
        draining = draining_nodes()
        if not draining:
            return {}
        ours = set(self.group.nodes_of(self.group.active)) - self.evacuated
        return {n: (d / 1000 - time.time() if d else math.inf) for n, d in draining.items() if n in ours}

    def _evacuate(self, step: int, notice: dict[str, float], since: float) -> Resizing | Recovering | Failed:
        """A preemption notice: checkpoint this step, then move the replicas off the draining
        nodes before their deadline (elastic: go on with the others; fixed: wait for room
        elsewhere, up to cluster.placement_timeout_s). No step is trained twice. If the node
        goes first, the save or the next step fails and recovery takes over."""
        group, ck = self.group, self.cfg.checkpoint
        node, left = min(notice.items(), key=lambda kv: kv[1])
        log.warning(
            "node %s is being drained (preemption; %s): checkpointing step %d and moving off it",
            node[:8],
            f"{left:.0f}s to its deadline" if math.isfinite(left) else "no deadline",
            step,
        )
        try:
            self._wait_for_saves()
            if ck.every > 0 and self.committed_step != step:
                self._save(step, None)
                self._wait_for_saves()
        except WorkerError as err:
            return self._failed(err, step + 1, None)
        self.evacuated |= set(notice)
        saved = self.committed_step or 0
        record = {
            "event": "preemption",
            "node": node,
            "deadline_s": round(left, 3) if math.isfinite(left) else None,
            "saved_step": saved,
            "lost_steps": step - saved,
        }
        self.log.event(record)
        self.summary.preemptions.append({k: v for k, v in record.items() if k != "event"})
        bad = [slot for slot in group.active if set(group.nodes_of([slot])) & set(notice)]
        group.replace(bad)
        slots = self.scaling.on_loss(group.active, set(bad)) if self.elastic else []
        mark = time.perf_counter()
        if not slots:  # a fixed-size run, or too few replicas left: wait for room elsewhere
            wait_s = self.cfg.cluster.placement_timeout_s
            lost = group.wait_placed(bad, wait_s)
            if lost:
                return Failed(RunFailed(f"{self._why_not_placed(lost, wait_s)}; {self._last_good()}"))
            slots = list(group.active)
        cause = f"node {node[:8]} preempted"
        intr = Interruption("preempt", cause, step, group.dp, save_s=mark - since, since=since)
        intr.place_s = time.perf_counter() - mark
        return Resizing(slots, intr)

    def _request_stop(self, signum, frame) -> None:
        """The SIGTERM handler: stop at the next step boundary (a handler must not interrupt a
        Ray call half-way)."""
        name = signal.Signals(signum).name
        if self.stop_requested is None:
            log.warning("%s: saving a checkpoint and stopping after the step in progress", name)
        self.stop_requested = name

    def _stop(self, step: int) -> Stopped | Recovering:
        """Save the steps trained since the last checkpoint (unless checkpoint.every=0), wait
        for the upload, and stop."""
        try:
            self._wait_for_saves()
            if step > 0 and self.cfg.checkpoint.every > 0 and self.committed_step != step:
                self._save(step, None)
                self._wait_for_saves()
        except WorkerError as err:
            return self._failed(err, step + 1, None)
        self.summary.train_s = round(time.perf_counter() - self.train_started, 3)
        kept = f"checkpoint {self.summary.last_checkpoint}" if self.committed_step == step else self._last_good()
        return Stopped(f"stopped by {self.stop_requested} after step {step}; {kept}")

    def _finish(self, step: int) -> Finished | Recovering | Failed:
        """The last step is trained: the final checkpoint's upload must be committed before the
        run counts as done. If it failed, the state is still in memory: save it once more."""
        for attempt in range(2):
            try:
                done = self._wait_for_saves()
            except WorkerError as err:
                return self._failed(err, step, None)
            if done is None or "error" not in done:
                break
            if attempt == 0:
                try:
                    self._save(step, None)
                except WorkerError as err:
                    return self._failed(err, step, None)
            else:
                return Failed(
                    RunFailed(
                        f"the final checkpoint (step {step}) could not be written: {done['error']}; {self._last_good()}"
                    )
                )
        self.summary.train_s = round(time.perf_counter() - self.train_started, 3)
        return Finished()

    def _failed(self, err: WorkerError, step: int, inject: Injection | None) -> Recovering:
        """A call failed while training `step`: what the recovery starts from."""
        log.warning("step %d failed: %s", step, err)
        since = self.log.history[-1]["time"] if self.log.history else None
        detect = max(0.0, time.time() - since) if since else 0.0
        dp = self.group.dp if self.group is not None else 0
        good = checkpoint_store.latest(self.store)
        intr = Interruption("restart", str(err), step, dp, resume_step=good.step if good else 0, detect_s=detect)
        return Recovering(err, intr, injected=inject is not None)

    def _restore(self, intr: Interruption | None) -> int:
        """Load the latest checkpoint into the group (if any) and describe the group in the
        summary; returns the step restored."""
        group, ckpt, step = self.group, checkpoint_store.latest(self.store), 0
        self._unreported_commit(ckpt)
        if ckpt is not None:
            mark = time.perf_counter()
            step = group.load(str(ckpt.path), ckpt.meta)
            if intr is not None:
                intr.restore_s += time.perf_counter() - mark
            written, now = ckpt.meta["topology"], group.cfg.topology
            log.info(
                "resuming from %s (step %d, %d samples consumed%s)",
                ckpt.path,
                step,
                ckpt.meta["consumed_samples"],
                ""
                if all(written[k] == getattr(now, k) for k in ("dp", "pp", "tp"))
                else f"; written under dp{written['dp']}_pp{written['pp']}_tp{written['tp']}, resharded",
            )
            self.log.event({"event": "resume", "step": step, "checkpoint": str(ckpt.path)})
            if self.summary.resumed_from is None:
                self.summary.resumed_from = str(ckpt.path)
            self.summary.resumed_step = step
        if intr is not None:
            intr.resume_step = step
        self.log.rewind(step)  # steps after it are trained again (a failure before any checkpoint: all)
        placement = group.placement()
        self.log.write_json("workers.json", [{**p, "pid": info.pid} for p, info in zip(placement, group.infos)])
        first = group.descriptions[0]
        self.summary.topology.update(Layout.of(group.cfg).summary())
        self.summary.workers = {
            "placement": placement,
            "device_name": first["device_name"],
            "backend": first["backend"],
            "device": first["device"],
            "params": first["model_params"],
            "loss_floor": first["loss_floor"],
        }
        self.observer.started(placement, first["device_name"])
        return step

    def _inject(self, step: int, phase: str) -> Injection | None:
        """The `fault.inject` fault due now, recorded before it fires."""
        injection = self.faults.due(step, phase, Layout.of(self.group.cfg).world_size)
        if injection is not None:
            record = injection.record()
            self.log.event(record)
            self.summary.faults_injected.append(record)
            log.warning("fault.inject: %s on rank %d at step %d (%s)", injection.kind, injection.rank, step, phase)
        return injection

    def _last_good(self, short: bool = False) -> str:
        good = checkpoint_store.latest(self.store)
        if short:
            return str(good.path) if good else "the beginning"
        return f"last good checkpoint: {good.path} (step {good.step})" if good else "no checkpoint yet"

    def _why_not_placed(self, lost: set[int], wait_s: float) -> str:
        if not self.elastic:
            return not_placed_again(len(lost), wait_s)
        left = len(self.group.active) - len(lost)
        return (
            f"{left} replica(s) left after losing {len(lost)}, below elastic.min_dp={self.scaling.min_dp}; "
            "add nodes or lower elastic.min_dp"
        )

    def _announce(self) -> None:
        cfg, t, layout = self.cfg, self.cfg.topology, Layout.of(self.cfg)
        usable = self.scaling.usable
        if self.elastic:
            low, high = cfg.elastic.dp_range(t.dp)
            skipped = [d for d in range(low, high + 1) if d not in usable]
            tr = cfg.train
            log.info(
                "elastic: %d to %d replicas of pp %d x tp %d; usable dp %s%s",
                self.scaling.min_dp,
                usable[-1],
                t.pp,
                t.tp,
                ", ".join(map(str, usable)),
                f" (dp {', '.join(map(str, skipped))} cannot split global batch {tr.global_batch_size} into "
                f"micro-batches of {tr.micro_batch_size}; the run uses the largest usable dp it can place)"
                if skipped
                else "",
            )
        log.info(
            "rayhybrid: %s ranks = dp %s x pp %d x tp %d (%s, %s, %s micro-batches of %d) on %s",
            "elastic" if self.elastic else layout.world_size,
            f"{self.scaling.min_dp}..{usable[-1]}" if self.elastic else t.dp,
            t.pp,
            t.tp,
            t.schedule if t.pp > 1 else "no pipeline",
            "FSDP2" if t.dp_shard else "replicated dp",
            "G/(dp x mb)" if self.elastic else layout.num_microbatches,
            cfg.train.micro_batch_size,
            "GPU" if self.shape.use_gpu else "CPU",
        )

    def _close(self, started_ray: bool) -> None:
        s = self.summary
        s.finish(self.log.history)
        if self.cfg.checkpoint.keep_best and self.store is not None:
            try:
                best = checkpoint_store.best(self.store)
            except OSError as err:  # the store is unreachable: the summary goes without it
                log.warning("could not look up the best checkpoint: %s", err)
                best = None
            if best is not None:
                s.best_checkpoint = redact_url(best.path)
                log.info(
                    "best checkpoint: %s (step %d, val_loss %.4f)", s.best_checkpoint, best.step, best.meta["val_loss"]
                )
        s.wall_s = round(time.perf_counter() - self.log.started, 3)
        figures = s.to_dict()
        before = set(figures)
        self.observer.close(figures, self.log.history)  # adds FLOP/s, MFU, bubble, memory, plots
        s.figures = {k: v for k, v in figures.items() if k not in before}
        self.log.close(s)
        if self.group is not None:
            self.group.shutdown(graceful=s.status == "completed")
        if started_ray:
            ray.shutdown()


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


DRAIN_POLL_S = 1.0


def _on_sigterm(handler):
    """Install `handler` for SIGTERM; returns the one before. Only the main thread may (a run
    in another thread, e.g. a test's, keeps the default)."""
    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)


def open_store(url: str, options: dict) -> Store:
    try:
        return Store.open(url, options)
    except ValueError as err:
        raise ConfigError(
            "checkpoint.dir", f"{redact_url(url)}: {err}; install the store's fsspec package (e.g. s3fs, gcsfs)"
        ) from None


IGNORED_MODEL_FIELDS = ("flavor", "init_from")
"""Settings that do not change what a checkpoint holds: a run resumed from its own checkpoint
may drop init_from (the checkpoint has the weights now) or come from another preset name."""


def check_same_model(ckpt: checkpoint_store.Checkpoint | None, cfg: Config) -> None:
    """A checkpoint.dir whose latest checkpoint holds another model cannot be resumed: one line
    naming the settings that differ (exit 2), not DCP's error about missing keys from a worker."""
    recorded = (ckpt.meta if ckpt is not None else {}).get("model")
    if not recorded:
        return  # no checkpoint, or one written before checkpoints recorded the model
    now = dataclasses.asdict(cfg.model)
    differ = [
        f"model.{k}={recorded[k]!r} there, {now[k]!r} here"
        for k in now
        if k in recorded and k not in IGNORED_MODEL_FIELDS and recorded[k] != now[k]
    ]
    if differ:
        raise ConfigError(
            "checkpoint.dir",
            f"{redact_url(ckpt.path)} holds another model ({'; '.join(differ)}); "
            "use the same model settings to resume, or a new checkpoint.dir",
        )
