"""The Ray Tune side of a search: a `Searcher` that runs a `TunePlan` (microbatch.py) or a
`LayoutPlan` (layout.py)."""

from __future__ import annotations

import logging

from ray.tune.search import Searcher

log = logging.getLogger("rayhybrid")


class PlanSearcher(Searcher):
    """A Ray Tune `Searcher` that runs a `TunePlan` (microbatch.py) or a `LayoutPlan`
    (layout.py) one trial at a time.

    Each suggested config is `base_config` plus the plan's point (`micro_batch_size`,
    `num_microbatches`, `activation_checkpointing`, `purpose`); a trial reports `oom` (0/1),
    `tokens_per_s` and its peaks as `peak_mb/<key>` entries. `suggest` returns None while a
    trial runs (the next point depends on its result) and `Searcher.FINISHED` when the plan is
    done. A trial that crashed fitted nothing: never a crashed search."""

    def __init__(self, plan, base_config: dict | None = None, metric: str = "tokens_per_s") -> None:
        super().__init__(metric=metric, mode="max")
        self.plan = plan
        self.base_config = dict(base_config or {})
        self.running: dict[str, dict] = {}

    def suggest(self, trial_id: str):
        if self.running:
            return None
        point = self.plan.next()
        if point is None:
            return self.FINISHED
        self.running[trial_id] = point
        return {**self.base_config, **point}

    def save(self, checkpoint_path: str) -> None:
        """Nothing to save: a search is short, and one that stopped is run again."""

    def restore(self, checkpoint_path: str) -> None:
        """See `save`."""

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        point = self.running.pop(trial_id, None)
        if point is not None:
            record = self.plan.observe(point, result, error=error)
            log.info("trial %d (%s): %s", len(self.plan.records), record.purpose, record.describe(self.plan.budget_mb))
