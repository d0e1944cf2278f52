"""The driver's checkpoint bookkeeping, in one place: the store, saving (and waiting for an
upload), the one way a step becomes committed, restoring the latest checkpoint, and the
storage check of the nodes a run uses.

Every method takes the `RunState` (and, where it calls the workers, the worker group) and
returns the next one (with `committed`, `uploading`, `checked_nodes` or `first_restore`
changed); what it records goes to the run log. A step counts
as committed when its commit marker exists (docs/design.md, invariant 6); `_commit` is where the
driver learns it, from a save's report or, when that report was lost with a failure, from the
checkpoint it restores.
"""

from __future__ import annotations

import logging
import time

import ray

from rayhybrid.config.schema import Config
from rayhybrid.data.packing import prepared_sources
from rayhybrid.driver.records import Interruption, steps_redone
from rayhybrid.driver.runlog import RunLog
from rayhybrid.driver.state import RunState
from rayhybrid.errors import WorkerError
from rayhybrid.faults import Injection
from rayhybrid.storage import checkpoints, generation
from rayhybrid.storage.store import Store, redact_url
from rayhybrid.storage.visibility import check_datasets, check_storage
from rayhybrid.trainer.results import SaveResult

log = logging.getLogger("rayhybrid")


class CheckpointLedger:
    def __init__(self, cfg: Config, store: Store, runlog: RunLog) -> None:
        self.cfg, self.store, self.log = cfg, store, runlog
        self.default_dir = not cfg.checkpoint.dir
        """checkpoint.dir was not given: checkpoints go to the run directory."""

    def latest(self) -> checkpoints.Checkpoint | None:
        return checkpoints.latest(self.store)

    def last_good(self, short: bool = False) -> str:
        good = self.latest()
        if short:
            return str(good.path) if good else "the beginning"
        return f"last good checkpoint: {good.path} (step {good.step})" if good else "no checkpoint yet"

    def check_storage(self, run: RunState, group, slots) -> RunState:
        """The storage check on the nodes of `slots` not checked yet. A POSIX path is what the
        driver's own node sees by definition; stores are checked everywhere (the workers'
        credentials are not the driver's)."""
        nodes = [n for n in group.nodes_of(list(slots)) if n not in run.checked_nodes]
        check_datasets(prepared_sources(self.cfg.data), nodes, group.env)  # a prepared dataset on a local path
        if not self.cfg.checkpoint.enabled and self.default_dir:
            return run.but(checked_nodes=run.checked_nodes | set(nodes))  # no checkpoint is written or read
        if nodes and self.store.local:
            here = ray.get_runtime_context().get_node_id()
            nodes = [n for n in nodes if n != here]
        if not nodes:
            return run
        check_storage(self.store, nodes, group.env, default=self.default_dir)
        return run.but(checked_nodes=run.checked_nodes | set(nodes))

    def advance(self, run: RunState) -> RunState:
        """The run's next generation, for a start, a recovery or a resize: published in the
        checkpoint root before its ranks join, so that a rank of an older one (stopped, not
        dead) can commit nothing that is read (storage/generation.py, trainer/fence.py)."""
        if not self.cfg.checkpoint.enabled:  # no rank writes a checkpoint: nothing to fence
            return run.but(generation=0 if run.generation is None else run.generation + 1)
        record = checkpoints.next_generation(self.store, run.generation)
        generation.publish(self.store, record)
        log.debug("generation %d published in %s", record.current, self.store.display)
        return run.but(generation=record.current)

    def save(self, run: RunState, group, step: int, inject: Injection | None) -> RunState:
        """Save the checkpoint of `step`: written by the time this returns, or uploading (async);
        records any earlier upload that finished meanwhile. Raises WorkerError."""
        ck = self.cfg.checkpoint
        saved = group.save(self.store.url, ck.keep, self.cfg.fault.step_timeout_s, inject)
        run = self.saved(run, list(saved.finished))
        if not saved.asynchronous:
            return self.saved(run, [saved])
        self.log.save_blocked(step, saved.blocked_s)  # known now; its record comes with the commit
        log.info(
            "checkpoint step %d: training blocked %.2fs; uploading to %s",
            step,
            saved.blocked_s,
            redact_url(saved.path),
        )
        return run.but(uploading=True)

    def wait(self, run: RunState, group) -> tuple[RunState, SaveResult | None]:
        """Wait for the upload in flight (if any); the run state and that upload's record."""
        if not run.uploading:
            return run, None
        done = group.finished_saves(group.start_timeout_s)
        return self.saved(run, done), (done[-1] if done else None)

    def save_now(self, run: RunState, group) -> tuple[RunState, WorkerError | None]:
        """The step the run is at, committed before it returns (unless checkpoint.every=0):
        for a preemption notice or a stop. A failure comes back with the run state as far as
        it got (a commit recorded before it stays recorded)."""
        try:
            run, _ = self.wait(run, group)
            if self.cfg.checkpoint.enabled and run.step > 0 and run.committed != run.step:
                run = self.save(run, group, run.step, None)
                run, _ = self.wait(run, group)
        except WorkerError as err:
            return run, err
        return run, None

    def saved(self, run: RunState, results: list[SaveResult]) -> RunState:
        """Saves that finished: committed ones are checkpoints; failed ones leave the one before
        as the latest (the next save tries again)."""
        for r in results:
            run = run.but(uploading=False)
            if r.error is not None:
                path = redact_url(r.path)
                log.warning("checkpoint step %d failed: %s; %s", r.step, r.error, self.last_good())
                self.log.event({"event": "checkpoint_failed", "step": r.step, "path": path, "error": r.error})
                continue
            blocked, upload = round(r.blocked_s, 3), round(r.upload_s, 3)
            how = f"training blocked {blocked:.2f}s, {'upload' if r.asynchronous else 'of it writing'} {upload:.2f}s"
            run = self._commit(run, r.step, r.path, blocked, upload, r.asynchronous, how)
        return run

    def _commit(self, run, step, path, blocked, upload, is_async, how) -> RunState:
        """The one way the driver records step `step` as committed."""
        path = redact_url(str(path))
        log.info("checkpoint step %d committed: %s (%s)", step, path, how)
        self.log.event(
            {"event": "checkpoint", "step": step, "path": path, "blocked_s": blocked, "upload_s": upload}
            | {"async": is_async}
        )
        return run.but(committed=step)

    def restored(self, run: RunState, ckpt: checkpoints.Checkpoint | None) -> RunState:
        """Record a checkpoint that this run committed but whose report the driver never had:
        an asynchronous save's commit is reported with the next step's results, which a failure
        can take with it. Restoring it is right (it is committed); recording it keeps
        metrics.jsonl and the summary true to what was saved. Its timings are not known."""
        step = ckpt.step if ckpt is not None else 0
        if run.first_restore is None:  # the run's first restore: what it found, not what it saved
            return run.but(first_restore=step)
        if step <= max(run.committed or 0, run.first_restore):
            return run
        how = "its report was lost with the failure"
        return self._commit(run, step, ckpt.path, None, None, self.cfg.checkpoint.async_save, how)

    def restore(
        self, run: RunState, group, intr: Interruption | None, ckpt: checkpoints.Checkpoint | None
    ) -> tuple[RunState, Interruption | None]:
        """Load `ckpt`, the latest checkpoint (if any), into the group; the run state at the
        step restored, and the interruption with its restore time."""
        step = 0
        run = self.restored(run, ckpt)
        if ckpt is not None:
            mark = time.perf_counter()
            step = group.load(str(ckpt.path), ckpt.meta).step
            if intr is not None:
                intr = intr.but(restore_s=intr.restore_s + time.perf_counter() - mark)
            written, now = ckpt.meta["topology"], group.dp
            log.info(
                "resuming from %s (step %d, %d samples consumed%s)",
                ckpt.path,
                step,
                ckpt.meta["consumed_samples"],
                ""
                if (written["dp"], written["pp"], written["tp"]) == (now, self.cfg.topology.pp, self.cfg.topology.tp)
                else f"; written under dp{written['dp']}_pp{written['pp']}_tp{written['tp']}, resharded",
            )
            self.log.event({"event": "resume", "step": step, "checkpoint": str(ckpt.path)})
        if intr is not None:
            intr = intr.but(resume_step=step, healed="checkpoint", steps_redone=steps_redone(run.step, step))
        self.log.rewind(step)  # steps after it are trained again (a failure before any checkpoint: all)
        return run.but(step=step), intr

    def best(self) -> str | None:
        """checkpoint.keep_best: the kept checkpoint with the lowest val_loss, for the summary."""
        if not self.cfg.checkpoint.keep_best:
            return None
        try:
            best = checkpoints.best(self.store)
        except OSError as err:  # the store is unreachable: the summary goes without it
            log.warning("could not look up the best checkpoint: %s", err)
            return None
        if best is None:
            return None
        path = redact_url(best.path)
        log.info("best checkpoint: %s (step %d, val_loss %.4f)", path, best.step, best.meta["val_loss"])
        return path
