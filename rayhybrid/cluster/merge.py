"""One step's results from every rank merged into the group's (`merge_steps`): rank 0's
figures from the trainer, with what only all ranks together know. The results themselves are
declared in rayhybrid/trainer/results.py; the driver's records (metrics.jsonl) store the merged
`StepResult.metrics`."""

from __future__ import annotations

from rayhybrid.trainer.results import SPLIT_PARTS, StepMetrics, StepResult


def merge_steps(results: list[list[StepResult] | None], dp: int, replica_size: int) -> list[StepResult]:
    """Every rank's results of one call (`results[rank][i]` for step i) -> one result per step:
    the figures of the first rank that has them (rank 0 after a call), with what only all ranks
    together know, and the saves that same rank saw end. The one merge of every step, a step
    healed forward included: there a rank that received its state reports only what it read
    (`trainer.heal.step_record`), its saves with it, and a rank with no record is None."""
    ranks = [(rank, steps) for rank, steps in enumerate(results) if steps is not None]
    merged = []
    for i in range(len(ranks[0][1])):
        step = [(rank, steps[i].metrics) for rank, steps in ranks]
        figures = next((steps[i] for _, steps in ranks if "loss" in steps[i].metrics), ranks[0][1][i])
        merged.append(StepResult(_merge(step, dp, replica_size, len(results)), figures.saves))
    return merged


def _merge(step: list[tuple[int, dict]], dp: int, replica_size: int, world: int) -> StepMetrics:
    """One step's per-rank results [(rank, metrics)] -> its record (`world`: the ranks' count)."""
    metrics = dict(next((m for _, m in step if "loss" in m), step[0][1]))
    metrics["samples"] = _samples(step, metrics, dp, replica_size)
    metrics.pop("samples_read", None)
    # metrics.memory: every rank's, "rank<r>/stage<s>/<phase>" (reserved_mb: CUDA's allocator only)
    for name in ("peak_mb", "activation_mb", "reserved_mb"):
        if name in metrics:
            metrics[name] = {f"rank{rank}/{key}": mb for rank, m in step for key, mb in m.get(name, {}).items()}
    # The longest any rank waited for its samples: the step waited that long.
    metrics["data_wait_s"] = max((m["data_wait_s"] for _, m in step if "data_wait_s" in m), default=0.0)
    if any("data_read" in m for _, m in step):  # data.trace: what each rank read, by rank
        metrics["data_read"] = {str(rank): m["data_read"] for rank, m in step if "data_read" in m}
    if "cpu_s" in metrics:  # the busiest rank's CPU time (ranks sharing cores wait for them)
        metrics["cpu_s"] = max(m["cpu_s"] for _, m in step if "cpu_s" in m)
    bubbles = [m["bubble"] for _, m in step if m.get("bubble") is not None]
    metrics["bubble"] = sum(bubbles) / len(bubbles) if bubbles else None  # the pipeline's idle share
    splits = [m["split"] for _, m in step if "split" in m]
    if splits and "step_time_s" in metrics:  # the MFU split: see `split_mean`
        metrics["split"] = split_mean(splits, metrics["step_time_s"])
        metrics["compute_s"] = metrics["split"]["compute_s"]
        by_rank = {rank: m.get("compute_s") for rank, m in step}
        metrics["compute_s_by_rank"] = [by_rank.get(rank) for rank in range(world)]
    if "trace" in metrics:  # metrics.trace_steps: every rank's spans
        metrics["trace"] = [event for _, m in step for event in m.get("trace", [])]
    return metrics


def _samples(step: list[tuple[int, dict]], metrics: dict, dp: int, replica_size: int) -> list[list[int]]:
    """The sample ranges each replica read: [[start, count], ...] in dp order (every rank that
    reads, of a first or last stage, reads its replica's). A step healed forward after a shrink
    was trained by more replicas than the group has now, some with no rank left: their ranges
    follow from the others' (sample i is a function of the data, the seed and i; the replicas'
    ranges tile the step's samples in dp order, docs/design.md, invariant 4)."""
    read = {rank // replica_size: m["samples_read"] for rank, m in reversed(step) if m.get("samples_read")}
    trained_dp = metrics.get("dp", dp)
    if trained_dp == dp and len(read) == dp:
        return [read[d] for d in range(dp)]
    (count,) = {c for _, c in read.values()}
    first = metrics["consumed_samples"] - trained_dp * count
    return [[first + d * count, count] for d in range(trained_dp)]


def split_mean(splits: list[dict[str, float]], step_time_s: float) -> dict[str, float]:
    """The ranks' splits of one step -> their mean, scaled so that its parts add up to the
    record's `step_time_s` (rank 0's; the ranks' own step times differ by their last wait)."""
    mean = {name: sum(s.get(name, 0.0) for s in splits) / len(splits) for name in SPLIT_PARTS}
    total = sum(mean.values())
    if total <= 0:
        return dict.fromkeys(SPLIT_PARTS, 0.0)
    return {name: s * step_time_s / total for name, s in mean.items()}
