"""The driver's run state, one typed value, and the states of its state machine.

    Starting ──> Training ──(every step)──> Training ──(last step)──> Finished
                  │    ▲  └─(checkpoint, more replicas placed)─> Resizing ─┐
                  │    └──────────────────────────────────────────────────┘
                  ├─(a call failed)─> Recovering ──> Training, Starting (the start failed) or Failed
                  └─(SIGTERM)─> a final checkpoint ──> Stopped (exit code 130)

Every state carries the `RunState` (what outlives one state, as values) and only the data its
own transition needs. The worker group is not part of it: it is a live object, held by the
controller (built by a start, kept through resizes and recoveries), and the one home of which
replica slots are in use, hence of dp. A handler of the controller takes a state and returns the
next one; it never sets attributes on a shared object, so a state's inputs and outputs are in
its signature and it can be tested with a `RunState` and a fake worker group
(tests/test_driver_states.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from rayhybrid.driver.policies import Failure
from rayhybrid.driver.records import Interruption
from rayhybrid.errors import RunFailed, WorkerError


@dataclass(frozen=True)
class RunState:
    """What outlives one state of the run, as values (the worker group, a live object, is the
    controller's). Replaced, never changed: `run.but(step=5)`."""

    step: int = 0
    """The last step trained."""
    restarts: int = 0
    failures: tuple[Failure, ...] = ()
    """Every failure so far, for the failure policy (does one repeat?)."""
    committed: int | None = None
    """The newest checkpoint this run committed (and whose report it had)."""
    first_restore: int | None = None
    """The step the run's first restore found (0: it started from scratch)."""
    uploading: bool = False
    """An asynchronous save was started whose outcome the driver has not had yet."""
    checked_nodes: frozenset[str] = frozenset()
    """Nodes that passed the storage check (rayhybrid/storage/visibility.py)."""
    evacuated: frozenset[str] = frozenset()
    """Nodes the run moved off after a preemption notice."""
    train_started: float | None = None
    """perf_counter() when the workers last started training (for train_s)."""
    generation: int | None = None
    """The run's generation: the workers' current one, bumped by every start, recovery and
    resize (`CheckpointLedger.advance`); None before the first start."""

    def but(self, **changes) -> RunState:
        return dataclasses.replace(self, **changes)


class State:
    terminal: ClassVar[bool] = False
    run: RunState


@dataclass(frozen=True)
class Starting(State):
    run: RunState
    pending: Interruption | None = None
    """A start that failed before: recorded after the first step."""


@dataclass(frozen=True)
class Training(State):
    run: RunState
    pending: Interruption | None = None
    """A restart or resize, until its first step is done."""


@dataclass(frozen=True)
class Recovering(State):
    run: RunState
    error: WorkerError
    interruption: Interruption
    injected: bool
    """The failing call carried a `fault.inject` fault."""


@dataclass(frozen=True)
class Resizing(State):
    run: RunState
    slots: tuple[int, ...]
    """The replica slots to train on next, in data-parallel order (the scaling decision)."""
    interruption: Interruption


@dataclass(frozen=True)
class Finished(State):
    run: RunState
    terminal: ClassVar[bool] = True


@dataclass(frozen=True)
class Stopped(State):
    """SIGTERM (`ray job stop`, a reclaimed head node): stopped at a step boundary, after a
    final checkpoint."""

    run: RunState
    reason: str
    terminal: ClassVar[bool] = True


@dataclass(frozen=True)
class Failed(State):
    run: RunState
    error: RunFailed
    terminal: ClassVar[bool] = True
