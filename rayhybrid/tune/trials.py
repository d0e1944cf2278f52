"""One tuning trial, free of Ray: where it runs (`Point`), what it measured (`Record`, built from
a trial's result by `record_of`), and which record wins (`fastest`). Both searches
(microbatch.py's `TunePlan`, layout.py's `LayoutPlan`) and the report share them.

A trial's result carries its peaks as `peak_mb/<rank/stage/phase>` entries (`PEAK_PREFIX`): what
limits a run (`limiting_peaks`), on CUDA the caching allocator's reserved bytes, on CPU the tensor
bytes; a trial whose rank ran out of memory (`out_of_memory`) is a miss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayhybrid.tune.space import TOPOLOGY_FIELDS

PEAK_PREFIX = "peak_mb/"  # result keys "peak_mb/<rank/stage/phase>" carry a trial's peaks


@dataclass(frozen=True)
class Point:
    micro_batch_size: int
    num_microbatches: int
    activation_checkpointing: bool
    layout: tuple | None = None  # (dp, pp, tp, schedule, stages_per_rank, dp_shard): a layout search's
    offload_activations: bool = False  # train.offload_activations (a layout search's, where nothing else fits)

    def as_config(self, purpose: str) -> dict:
        return {
            "micro_batch_size": self.micro_batch_size,
            "num_microbatches": self.num_microbatches,
            "activation_checkpointing": self.activation_checkpointing,
            **(dict(zip(TOPOLOGY_FIELDS, self.layout)) if self.layout else {}),
            **({"offload_activations": True} if self.offload_activations else {}),
            "purpose": purpose,
        }

    def where(self) -> str:
        """The layout, e.g. "dp2 pp4 tp1 1f1b sharded", "dp4 pp1 tp2 hsdp2" (HSDP, shard groups
        of 2) ("" on the base topology)."""
        if not self.layout:
            return ""
        dp, pp, tp, schedule, _, shard = self.layout
        sharding = " sharded" if shard is True else f" hsdp{shard}" if shard else ""
        return f"dp{dp} pp{pp} tp{tp}{' ' + schedule if pp > 1 else ''}{sharding}"

    def label(self) -> str:
        """A short name for plots, e.g. "dp2 pp4 tp1 1f1b mb2x4 AC"."""
        ac = " AC" if self.activation_checkpointing else ""
        ac += " offload" if self.offload_activations else ""
        return f"{self.where()} mb{self.micro_batch_size}x{self.num_microbatches}{ac}".strip()

    @classmethod
    def of(cls, config: dict) -> Point:
        layout = tuple(config[k] for k in TOPOLOGY_FIELDS) if "dp" in config else None
        return cls(
            config["micro_batch_size"],
            config["num_microbatches"],
            config["activation_checkpointing"],
            layout,
            bool(config.get("offload_activations", False)),
        )


@dataclass
class Record:
    """One trial: where it ran, why, and what it measured."""

    point: Point
    purpose: str  # "memory", "throughput" or "layout"
    oom: bool
    peaks_mb: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    error: str = ""
    predicted_peak_mb: float | None = None  # the memory search's line
    planned_mb: float | None = None  # the planner's (rayhybrid/plan/)
    step_time_s: float = 0.0
    cpu_s: float = 0.0  # the busiest rank's CPU seconds per step
    tokens_per_cpu_s: float = 0.0
    allocated_mb: float | None = None  # CUDA: the most the allocator had allocated (peaks_mb: reserved)

    @property
    def peak_mb(self) -> float:
        return max(self.peaks_mb.values(), default=0.0)

    def fits(self, budget_mb: float) -> bool:
        return not self.oom and not self.error and bool(self.peaks_mb) and self.peak_mb <= budget_mb

    def describe(self, budget_mb: float) -> str:
        """One progress line: where the trial ran and what it measured."""
        p = self.point
        where = f"{p.where()}, " if p.layout else ""
        shape = f"{where}micro-batch {p.micro_batch_size} x {p.num_microbatches}{' AC' if p.activation_checkpointing else ''}"
        planned = f" (planned {self.planned_mb:.2f})" if self.planned_mb is not None else ""
        if self.oom:
            return f"{shape}: out of memory{planned}"
        if self.error:
            return f"{shape}: failed: {self.error}"
        verdict = "fits" if self.fits(budget_mb) else "over budget"
        return (
            f"{shape}: peak {self.peak_mb:.2f} MB{planned} of {budget_mb:g}, {verdict}; {self.tokens_per_s:,.0f} tok/s"
            + (f", {self.tokens_per_cpu_s:,.0f} tok/CPU-s" if self.tokens_per_cpu_s else "")
        )

    def speed(self, metric: str = "tokens_per_s") -> float:
        return getattr(self, metric)

    def seconds(self, metric: str = "tokens_per_s") -> float:
        """Step time by the ranking's clock."""
        return self.cpu_s if metric == "tokens_per_cpu_s" else self.step_time_s


def peaks_from_result(result: dict) -> dict[str, float]:
    return {k[len(PEAK_PREFIX) :]: float(v) for k, v in result.items() if k.startswith(PEAK_PREFIX)}


def record_of(point: Point, purpose: str, result: dict | None, error: bool = False, **predictions) -> Record:
    """A trial's `Record` from its result (`oom`, `tokens_per_s`, `peak_mb/<key>` entries,
    `error`, ...); a trial that crashed (`error=True`) fitted nothing."""
    result = result or {}
    return Record(
        point,
        purpose,
        oom=bool(result.get("oom", 0)),
        peaks_mb=peaks_from_result(result),
        tokens_per_s=float(result.get("tokens_per_s") or 0.0),
        error=str(result.get("error") or ("the trial crashed" if error else "")),
        step_time_s=float(result.get("step_time_s") or 0.0),
        cpu_s=float(result.get("cpu_s") or 0.0),
        tokens_per_cpu_s=float(result.get("tokens_per_cpu_s") or 0.0),
        allocated_mb=float(result["allocated_peak_mb"]) if result.get("allocated_peak_mb") else None,
        **predictions,
    )


def fastest(records: list[Record], budget_mb: float, metric: str) -> Record | None:
    """The fastest record (by `metric`) that fitted `budget_mb`."""
    return max((r for r in records if r.fits(budget_mb)), key=lambda r: r.speed(metric), default=None)


HOST_OUT_OF_MEMORY = (
    "cuda error: out of memory",  # cudaHostAlloc: pinned host memory (train.offload_activations)
    "cannot allocate memory",  # ENOMEM from the host's allocator
    "can't allocate memory",  # torch's DefaultCPUAllocator
    "running low on memory",  # Ray's memory monitor killed the worker (the node's OOM killer)
    "oom killer",
)
"""Host allocation failures (train.offload_activations' pinned copies, ...): a miss, not a crash."""


def out_of_memory(message: str) -> bool:
    """Whether a rank's error is running out of memory: torch's `OutOfMemoryError` (the CUDA
    caching allocator's, or the CPU meter's over tune.memory_budget_mb), or the host's
    (`HOST_OUT_OF_MEMORY`: a pinned allocation failing, a worker its node's memory killed)."""
    low = message.lower()
    return "OutOfMemoryError" in message or "CUDA out of memory" in message or any(s in low for s in HOST_OUT_OF_MEMORY)


def peaks_of(steps: list[dict], name: str) -> dict[str, float]:
    """The most of each "rank/stage/phase" figure of `name` over `steps`."""
    peaks: dict[str, float] = {}
    for metrics in steps:
        for key, mb in metrics.get(name, {}).items():
            peaks[key] = max(mb, peaks.get(key, 0.0))
    return peaks


def limiting_peaks(steps: list[dict]) -> dict[str, float]:
    """What limits a run: on CUDA the caching allocator's reserved peaks (the live tensors plus
    its rounding and fragmentation: what must fit the card), on CPU the tensor bytes."""
    return peaks_of(steps, "reserved_mb") or peaks_of(steps, "peak_mb")
