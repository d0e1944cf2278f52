"""Fault injection (`fault.inject`, `fault.inject_rate`): the driver's plan of which fault fires
when and on which rank, its validation, and `trigger`, which runs in the victim rank's process.
See `plan.py`."""

from rayhybrid.faults.plan import (
    FORM,
    KINDS,
    PHASES,
    RANDOM_KINDS,
    FaultPlan,
    InjectedFault,
    Injection,
    max_world_size,
    parse,
    trigger,
    validate_faults,
)

__all__ = [
    "FORM",
    "KINDS",
    "PHASES",
    "RANDOM_KINDS",
    "FaultPlan",
    "InjectedFault",
    "Injection",
    "max_world_size",
    "parse",
    "trigger",
    "validate_faults",
]
