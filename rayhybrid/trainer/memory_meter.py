"""Peak memory of one rank, per pipeline stage and phase of the training step.

    meter = MemoryMeter(device, modules, optimizers, budget_mb=0)
    with meter.step():                       # one optimizer step
        meter.phase(stage, "forward")        # sticky label: holds until the next one
        ...
        meter.phase(stage, "backward")
        ...
        meter.phase(first_stage, "optimizer")
    meter.peaks_mb()                         # {"stage0/forward": 12.3, "stage0/backward": ...}

A phase's peak is the most memory the rank held at any moment while that phase ran (its other
stages' parameters and in-flight activations included: that is what the device must hold).

- **CUDA**: the caching allocator's `max_memory_allocated` (`peaks_mb`), and its
  `max_memory_reserved` (`reserved_mb`: the live tensors plus the allocator's rounding and
  fragmentation, what must fit the card and what a memory search compares), both reset when a
  phase starts. A real out-of-memory error (`torch.OutOfMemoryError`) is raised by torch as usual.
- **CPU** (no allocator statistics to ask): an exact account of tensor storage bytes, kept by
  torch's `MemTracker` (`torch.distributed._tools.mem_tracker`), a dispatch mode that sees every
  tensor an operator creates and a weak-reference callback when its storage is freed. Parameters,
  gradients, optimizer state and buffers are registered up front; activations saved for backward,
  temporaries, pipeline send/receive buffers and the batch are counted as operators make them.
  Views share their base's storage and count once. Bytes are `numel x element size` of each
  storage, with no allocator rounding. With `budget_mb > 0` the meter plays a device of that
  capacity: the operator that takes the rank past it raises `torch.OutOfMemoryError`, the same
  error a GPU raises, so a trial over budget fails the way it would on the device.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

MB = 2**20


class _PhaseTracker(MemTracker):
    """`MemTracker` that also keeps the peak of the current phase and enforces a budget.

    It hooks `_update_peak_stats`, which `MemTracker` calls after every operator (its only
    per-operator callback), instead of tracking storages a second time."""

    def __init__(self, budget_bytes: int) -> None:
        super().__init__()
        self._mod_tracker = _InBackward()
        self.budget_bytes = budget_bytes
        self.label: str | None = None
        self.peaks: dict[str, int] = {}
        self.breakdown: dict[str, dict[str, int]] = {}  # label -> bytes by category at its peak

    def live_bytes(self) -> int:
        return sum(snap[_TOTAL_KEY] for snap in self._curr_mem_snap.values())

    def note(self) -> None:
        live = self.live_bytes()
        if self.label is not None and live > self.peaks.get(self.label, -1):
            self.peaks[self.label] = live
            self.breakdown[self.label] = _by_category(self._curr_mem_snap)
        if self.budget_bytes and live > self.budget_bytes:
            raise torch.OutOfMemoryError(
                f"{live / MB:.2f} MB of tensors would exceed tune.memory_budget_mb={self.budget_bytes / MB:g} "
                f"(the device capacity this CPU run stands for), in {self.label or 'the step'}"
            )

    # MemTracker's per-module statistics are not used here. Their module hooks refuse a module
    # that runs more than once per step (every pipeline stage does) and their backward hooks
    # break the pipeline's shape inference (`autograd.grad` on leaves), so the module tracker
    # is replaced by one that only says whether autograd's engine is running (which labels
    # what backward allocates). Parameters and their gradient hooks are registered in `watch`.
    def _update_peak_stats(self, peak_state) -> None:  # MemTracker calls it after every operator
        self.note()

    def watch(self, modules: list[nn.Module]) -> None:
        """Count the modules' parameters and label their gradients (hooks live while the
        tracker is entered)."""
        for module in modules:
            self._track_module_params_and_buffers(module, install_grad_hooks=True)


class _InBackward:
    """Stands in for MemTracker's `ModTracker`: no module hooks, just `is_bw`."""

    parents: frozenset = frozenset()

    @property
    def is_bw(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *args) -> None:
        pass


def _by_category(snapshot: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for snap in snapshot.values():
        for key, value in snap.items():
            if key != _TOTAL_KEY and value:
                name = getattr(key, "value", str(key))
                out[name] = out.get(name, 0) + value
    return out


class MemoryMeter:
    def __init__(
        self,
        device: torch.device,
        modules: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        budget_mb: float = 0.0,
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.label: str | None = None
        self.peaks: dict[str, int] = {}
        self.reserved: dict[str, int] = {}  # CUDA: the allocator's reserved peak per phase
        self.tracker: _PhaseTracker | None = None
        self.modules = modules
        if not self.cuda:
            self.tracker = _PhaseTracker(int(budget_mb * MB))
            self.tracker.track_external(*modules, *optimizers)

    @contextlib.contextmanager
    def step(self):
        """Measure one training step; peaks start afresh."""
        self.peaks, self.reserved, self.label = {}, {}, None
        if self.tracker is None:
            yield
            self._close_phase()
            return
        self.tracker.peaks, self.tracker.breakdown, self.tracker.label = {}, {}, None
        with self.tracker:
            self.tracker.watch(self.modules)
            yield
        self.peaks = dict(self.tracker.peaks)

    def phase(self, stage: int, name: str) -> None:
        """From now on, memory counts toward stage `stage`'s phase `name`."""
        label = f"stage{stage}/{name}"
        if self.tracker is not None:
            self.tracker.label = label
            self.tracker.note()  # what is held as the phase starts counts too
            return
        self._close_phase()
        self.label = label
        torch.cuda.reset_peak_memory_stats(self.device)

    def _close_phase(self) -> None:
        if self.cuda and self.label is not None:
            peak = torch.cuda.max_memory_allocated(self.device)
            self.peaks[self.label] = max(peak, self.peaks.get(self.label, 0))
            reserved = torch.cuda.max_memory_reserved(self.device)
            self.reserved[self.label] = max(reserved, self.reserved.get(self.label, 0))
        self.label = None

    def peaks_mb(self) -> dict[str, float]:
        return {label: value / MB for label, value in sorted(self.peaks.items())}

    def step_metrics(self) -> dict[str, dict[str, float]]:
        """The step record's memory figures: `peak_mb`, `activation_mb`, and on CUDA `reserved_mb`."""
        out = {"peak_mb": self.peaks_mb(), "activation_mb": self.activation_mb()}
        return out | ({"reserved_mb": self.reserved_mb()} if self.cuda else {})

    def reserved_mb(self) -> dict[str, float]:
        """CUDA only ({} on CPU, where tensors are counted without an allocator): the caching
        allocator's reserved peak of each phase."""
        return {label: value / MB for label, value in sorted(self.reserved.items())}

    def activation_mb(self) -> dict[str, float]:
        """CPU only: the bytes saved for backward (MemTracker's Activation category) at each
        phase's peak."""
        return {label: mb.get("Activation", 0.0) for label, mb in self.breakdown_mb().items()}

    def breakdown_mb(self) -> dict[str, dict[str, float]]:
        """CPU only: bytes by category (Parameter, Gradient, Optstate, Activation, Temp, ...) at
        each phase's peak."""
        if self.tracker is None:
            return {}
        return {
            label: {k: v / MB for k, v in sorted(cats.items())}
            for label, cats in sorted(self.tracker.breakdown.items())
        }
