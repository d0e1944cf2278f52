"""The fault kinds of `fault.inject`, in one table: where each fires and what it does.

Everything else reads this table: validation (the kinds it accepts, the steps each needs),
the driver's plan (which of its calls carries a kind), the worker's firing points
(`fires_at(kind, "save")`), `trigger` and the docs' list (tests/test_fault_inject.py holds
docs/design.md to it). A new kind that fires at one of `FIRES` is one entry here and one line
in docs/design.md; a new firing point also needs its hook in rayhybrid/cluster/worker.py.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRES = ("step", "eval", "save")
"""Where in the victim rank a fault fires: at the start of a step, at the start of the held-out
evaluation after it, or during the checkpoint save after it (once the rank's own data is written)."""

EFFECTS = ("kill", "stop", "raise")
"""What the victim does to itself: SIGKILL, SIGSTOP (a hang for fault.step_timeout_s to find),
or raise `InjectedFault`."""

PHASES = ("step", "save")
"""The driver's calls a fault rides on: a step's call (train, then evaluate) or a save's."""


@dataclass(frozen=True)
class Kind:
    """One fault kind: where it fires, what it does, whether `fault.inject_rate` may draw it."""

    fires: str
    """One of FIRES."""
    effect: str
    """One of EFFECTS."""
    random: bool
    """Drawn by fault.inject_rate from fault.inject_kinds (else planned only, in fault.inject)."""
    doc: str
    """What it does, for docs/design.md's list (tests hold the list to this table)."""

    @property
    def phase(self) -> str:
        """The driver's call that carries it: "save" for a save's faults, else "step"."""
        return "save" if self.fires == "save" else "step"


KINDS: dict[str, Kind] = {
    "kill": Kind("step", "kill", True, "the rank kills itself (SIGKILL) at the start of step STEP"),
    "hang": Kind(
        "step", "stop", True, "it stops itself (SIGSTOP) there; the driver finds it by `fault.step_timeout_s`"
    ),
    "raise": Kind("step", "raise", True, "it raises `InjectedFault` there"),
    "kill_save": Kind(
        "save",
        "kill",
        True,
        "it kills itself during the checkpoint save after step STEP, which must be a checkpoint step, "
        "once its own data is written (mid-upload when saves are asynchronous)",
    ),
    "kill_eval": Kind(
        "eval",
        "kill",
        False,
        "it kills itself at the start of the held-out evaluation after step STEP, which must be an "
        "evaluation step (`eval.every`); planned only",
    ),
}
"""fault.inject's KIND -> where it fires and what it does."""


def random_kinds() -> tuple[str, ...]:
    """The kinds fault.inject_kinds may list (fault.inject_rate draws from them)."""
    return tuple(name for name, kind in KINDS.items() if kind.random)


RANDOM_KINDS = random_kinds()
"""random_kinds() of the built-in table."""

assert all(k.fires in FIRES and k.effect in EFFECTS for k in KINDS.values())  # the table's own invariant


def fires_at(kind: str | None, point: str) -> bool:
    """Whether fault kind `kind` (None: no fault; an unknown kind fires nowhere) fires at
    `point`, one of FIRES."""
    if point not in FIRES:
        raise ValueError(f"point must be one of {FIRES}, got {point!r}")
    return kind in KINDS and KINDS[kind].fires == point


def doc_lines() -> list[str]:
    """docs/design.md's list of the kinds, one Markdown bullet each."""
    return [f"- `{name}`: {kind.doc};" for name, kind in KINDS.items()]
