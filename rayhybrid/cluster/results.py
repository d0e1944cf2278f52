"""What the worker group returns to the driver: one optimizer step's figures (`StepMetrics`),
rank 0's from the trainer merged with every rank's. The driver's records (metrics.jsonl) store it."""

from __future__ import annotations

from typing import TypedDict


class StepMetrics(TypedDict, total=False):
    """One optimizer step, as `metrics.jsonl` stores it: rank 0's figures from the trainer,
    merged with every rank's by the worker group, completed by the observer and the log."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    step_time_s: float
    tokens_per_s: float
    consumed_samples: int
    num_microbatches: int
    dp: int
    pp: int
    tp: int
    samples: list[list[int]]
    """[first sample, count] read by each data-parallel replica, in dp order."""
    data_wait_s: float
    """The longest any rank waited for its samples in this step (in step_time_s)."""
    data_read: dict[str, list[dict]]
    """data.trace: rank -> what it read (written to data_trace/, not to metrics.jsonl)."""
    bubble: float | None
    """The pipeline's idle share of the step, over ranks."""
    peak_mb: dict[str, float]
    """metrics.memory: "rank<r>/stage<s>/<phase>" -> MB."""
    activation_mb: dict[str, float]
    val_loss: float
    """The held-out loss after this step (eval.every; absent on other steps)."""
    eval_s: float
    """Seconds the evaluation took (not in step_time_s)."""
    tflops: float
    mfu: float | None
    time: float
    """Wall clock when the driver had the step."""


def merge_steps(results: list[list[dict]], dp: int, replica_size: int) -> list[StepMetrics]:
    """Every rank's results of one call (`results[rank][i]` for step i) -> one record per step:
    rank 0's figures, with what only all ranks together know."""
    merged = []
    for i, metrics in enumerate(results[0]):
        metrics = dict(metrics)
        # The sample ranges each replica's first stage read: [[start, count], ...] in dp order.
        metrics["samples"] = [results[d * replica_size][i].pop("samples_read") for d in range(dp)]
        metrics.pop("samples_read", None)
        for name in ("peak_mb", "activation_mb"):  # metrics.memory: every rank's, "rank<r>/stage<s>/<phase>"
            if name in metrics:
                metrics[name] = {
                    f"rank{rank}/{key}": mb for rank, steps in enumerate(results) for key, mb in steps[i][name].items()
                }
        # The longest any rank waited for its samples: the step waited that long.
        metrics["data_wait_s"] = max(steps[i].get("data_wait_s", 0.0) for steps in results)
        if "data_read" in metrics:  # data.trace: what each rank read, by rank
            metrics["data_read"] = {
                str(rank): steps[i]["data_read"] for rank, steps in enumerate(results) if "data_read" in steps[i]
            }
        if "cpu_s" in metrics:  # the busiest rank's CPU time (ranks sharing cores wait for them)
            metrics["cpu_s"] = max(steps[i].get("cpu_s", 0.0) for steps in results)
        bubbles = [steps[i]["bubble"] for steps in results if steps[i].get("bubble") is not None]
        metrics["bubble"] = sum(bubbles) / len(bubbles) if bubbles else None  # the pipeline's idle share
        if "trace" in metrics:  # metrics.trace_steps: every rank's spans
            metrics["trace"] = [event for steps in results for event in steps[i].get("trace", [])]
        merged.append(metrics)
    return merged
