"""Fault injection (`fault.inject`, `fault.inject_rate`): the kinds, where each fires and what
it does (`kinds.py`), and the driver's plan of which fault fires when and on which rank, its
validation, and `trigger`, which runs in the victim rank's process (`injection.py`). Two test
modes are imported where they are used: `fault.nccl_like`, gloo's collectives failing as NCCL's
do (`async_collectives.py`), and the pause points at which a test kills a rank (`pause.py`)."""

from rayhybrid.faults.injection import (
    FORM,
    FaultPlan,
    InjectedFault,
    Injection,
    max_world_size,
    parse,
    trigger,
    validate_faults,
)
from rayhybrid.faults.kinds import FIRES, KINDS, PHASES, RANDOM_KINDS, Kind, fires_at

__all__ = [
    "FIRES",
    "FORM",
    "KINDS",
    "PHASES",
    "RANDOM_KINDS",
    "FaultPlan",
    "InjectedFault",
    "Injection",
    "Kind",
    "fires_at",
    "max_world_size",
    "parse",
    "trigger",
    "validate_faults",
]
