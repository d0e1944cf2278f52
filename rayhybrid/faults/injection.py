"""Fault injection (`fault.inject`, `fault.inject_rate`): rehearse failures before a long job.

The driver owns one `FaultPlan` per run and asks it, at the start of every step and before every
checkpoint save, whether a fault is due and on which rank; the victim rank's worker then calls
`trigger` where the kind fires (rayhybrid/faults/kinds.py says where and what), which kills,
stops or fails its own process. Everything here is pure (no Ray, no torch) except `trigger`,
which signals the calling process.

    fault.inject=[kill@5,hang@9:3,raise@12,kill_save@6]    # planned faults
    fault.inject_rate=0.01 fault.inject_seed=7             # random faults, ~1 step in 100
"""

from __future__ import annotations

import logging
import os
import random
import re
import signal
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from rayhybrid.config.schema import with_dp
from rayhybrid.config.topology import Layout
from rayhybrid.errors import ConfigError
from rayhybrid.faults.kinds import KINDS, PHASES, random_kinds

if TYPE_CHECKING:
    from collections.abc import Iterable

    from rayhybrid.config.schema import Config, FaultConfig

log = logging.getLogger(__name__)

FORM = "KIND@STEP or KIND@STEP:RANK, e.g. kill@5 or hang@9:3"
_PATTERN = re.compile(r"(?P<kind>\w+)@(?P<step>-?\d+)(?::(?P<rank>\d+))?")


@dataclass(frozen=True)
class Injection:
    """One fault: `kind` fires in `step` (its evaluation or its save, as KINDS says) on `rank`."""

    kind: str
    """A key of KINDS."""
    step: int
    """The 1-based optimizer step it belongs to."""
    rank: int | None = None
    """The victim; None: drawn when it fires."""

    @property
    def phase(self) -> str:
        """The driver's call that carries it: the checkpoint save's ("save") or the step's ("step")."""
        return KINDS[self.kind].phase

    def record(self) -> dict:
        """The metrics.jsonl event for this fault."""
        return {"event": "fault_injected", "step": self.step, "kind": self.kind, "rank": self.rank, "phase": self.phase}

    def __str__(self) -> str:
        suffix = "" if self.rank is None else f":{self.rank}"
        return f"{self.kind}@{self.step}{suffix}"


class InjectedFault(RuntimeError):
    """Raised by a rank that `fault.inject` (or `fault.inject_rate`) told to fail with `raise`."""

    def __init__(self, kind: str, step: int) -> None:
        super().__init__(f"injected fault (fault.inject {kind}@{step})")
        self.kind = kind
        self.step = step

    def __reduce__(self):
        return (type(self), (self.kind, self.step))


def parse(text: str) -> Injection:
    """`"hang@9:3"` -> `Injection("hang", 9, 3)`; raises `ConfigError("fault.inject", ...)`.

    The step is only parsed here; `validate_faults` checks it against the run."""
    match = _PATTERN.fullmatch(str(text).strip())
    if match is None:
        raise ConfigError("fault.inject", f"cannot parse {text!r}; write {FORM}")
    kind = match["kind"]
    if kind not in KINDS:
        raise ConfigError("fault.inject", f"{text!r} has unknown kind {kind!r}; choose one of: {', '.join(KINDS)}")
    rank = match["rank"]
    return Injection(kind, int(match["step"]), None if rank is None else int(rank))


def _entries(value: str | Iterable[str]) -> tuple[str, ...]:
    """A list setting as a tuple; a lone string (`fault.inject="kill@5"` from Python) is one entry."""
    return (value,) if isinstance(value, str) else tuple(value)


def max_world_size(cfg: Config) -> int:
    """The most ranks the run can ever have: dp x pp x tp at an elastic run's largest dp."""
    dp = cfg.elastic.dp_range(cfg.topology.dp)[1] if cfg.elastic.enabled else cfg.topology.dp
    return Layout.of(with_dp(cfg, dp)).world_size


def validate_faults(cfg: Config) -> None:
    """Static checks of the fault.inject* settings; raises `ConfigError` naming the setting and the fix."""
    _validate_random(cfg)
    seen: dict[tuple[int, str], str] = {}
    for text in _entries(cfg.fault.inject):
        injection = parse(text)
        _validate_injection(cfg, injection, text)
        key = (injection.step, injection.phase)
        if key in seen:
            raise ConfigError(
                "fault.inject",
                f"{seen[key]!r} and {text!r} both fire in the {injection.phase} phase of step {injection.step}; "
                "keep one of them (at most one fault per step and phase)",
            )
        seen[key] = text


def _validate_random(cfg: Config) -> None:
    rate = cfg.fault.inject_rate
    if not 0 <= rate <= 1:
        raise ConfigError(
            "fault.inject_rate",
            f"must be in [0, 1], got {rate}; e.g. fault.inject_rate=0.01 (a fault every ~100 steps)",
        )
    kinds, allowed = _entries(cfg.fault.inject_kinds), random_kinds()
    for kind in kinds:
        if kind not in allowed:
            raise ConfigError("fault.inject_kinds", f"unknown kind {kind!r}; choose from: {', '.join(allowed)}")
    if rate > 0 and not kinds:
        raise ConfigError(
            "fault.inject_kinds", f"is empty but fault.inject_rate={rate}; list kinds, e.g. [{', '.join(allowed[:3])}]"
        )
    saves = [kind for kind in kinds if KINDS[kind].fires == "save"]
    if rate > 0 and saves and cfg.checkpoint.every == 0:
        raise ConfigError(
            "fault.inject_kinds", f"{saves[0]} needs checkpoint saves but checkpoint.every=0; set checkpoint.every>0"
        )


def _validate_injection(cfg: Config, injection: Injection, text: str) -> None:
    steps, every = cfg.train.steps, cfg.checkpoint.every
    if not 1 <= injection.step <= steps:
        raise ConfigError(
            "fault.inject", f"{text!r}: step {injection.step} is out of range; use a step in 1..{steps} (train.steps)"
        )
    fires = KINDS[injection.kind].fires
    if fires == "save" and not cfg.checkpoint.due(injection.step, steps):
        fix = (
            "set checkpoint.every>0 (checkpoint.every=0 never saves)"
            if every == 0
            else f"use a multiple of checkpoint.every={every} or the last step {steps}"
        )
        raise ConfigError("fault.inject", f"{text!r}: step {injection.step} is not a checkpoint step; {fix}")
    if fires == "eval" and not cfg.eval.due(injection.step, steps):
        raise ConfigError(
            "fault.inject",
            f"{text!r}: no evaluation after step {injection.step}; use a multiple of eval.every={cfg.eval.every} "
            f"(eval.every>0) or the last step {steps}",
        )
    world = max_world_size(cfg)
    if injection.rank is not None and injection.rank >= world:
        ranks = f"{world} rank" if world == 1 else f"{world} ranks"
        raise ConfigError(
            "fault.inject",
            f"{text!r}: rank {injection.rank} does not exist, the run has at most {ranks} (dp x pp x tp); "
            f"use a rank below {world} or leave it out to draw one",
        )


class FaultPlan:
    """Which fault fires when; the driver owns one per run. Each planned fault and each random
    draw fires at most once per run, so a step trained again after a recovery does not fail again.

    The driver asks `due(step, "step", world_size)` before each step and `due(step, "save",
    world_size)` before each checkpoint save; a returned `Injection` names the rank that must call
    `trigger(injection.kind, injection.step)`.
    """

    def __init__(self, fault_cfg: FaultConfig, seed_offset: int = 0) -> None:
        """`seed_offset` shifts the random faults and drawn ranks (e.g. per trial of a sweep)."""
        self._planned = {(i.step, i.phase): i for i in map(parse, _entries(fault_cfg.inject))}
        self._rate = float(fault_cfg.inject_rate)
        kinds = tuple(dict.fromkeys(_entries(fault_cfg.inject_kinds)))
        phase_of = {name: kind.phase for name, kind in KINDS.items()}
        self._kinds = {phase: tuple(k for k in kinds if phase_of.get(k, "step") == phase) for phase in PHASES}
        self._seed = (int(fault_cfg.inject_seed), int(seed_offset))
        self._done: set[tuple[int, str]] = set()

    def due(self, step: int, phase: str, world_size: int) -> Injection | None:
        """The fault to fire now, with a concrete rank (< world_size; a configured RANK >= world_size
        after a shrink becomes RANK % world_size), or None. Marks it fired.

        Random faults: the draw for (step, phase) is made once, deterministically from
        (inject_seed, seed_offset, step, phase), so the same config gives the same faults on every run."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        if world_size < 1:
            raise ValueError(f"world_size must be positive, got {world_size}")
        key = (step, phase)
        if key in self._done:
            return None
        self._done.add(key)
        rng = self._rng(step, phase)
        planned = self._planned.get(key)
        if planned is not None:
            rank = rng.randrange(world_size) if planned.rank is None else planned.rank % world_size
            return replace(planned, rank=rank)
        kinds = self._kinds[phase]
        if not kinds or rng.random() >= self._rate:
            return None
        return Injection(rng.choice(kinds), step, rng.randrange(world_size))

    def _rng(self, step: int, phase: str) -> random.Random:
        # A str seed goes through SHA-512 (not hash()), so draws do not depend on PYTHONHASHSEED.
        seed, offset = self._seed
        return random.Random(f"rayhybrid.fault:{seed}:{offset}:{step}:{phase}")


_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
"""A kind's effect -> the signal the victim sends itself."""


def trigger(kind: str, step: int) -> None:
    """Worker side, in the victim rank's process, where KINDS says `kind` fires: its effect, a
    SIGKILL (kill, kill_save, kill_eval), a SIGSTOP (hang, for fault.step_timeout_s to find) or
    `InjectedFault` (raise)."""
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; one of: {', '.join(KINDS)}")
    log.warning("injecting fault %s@%d in pid %d (fault.inject)", kind, step, os.getpid())
    effect = KINDS[kind].effect
    if effect == "raise":
        raise InjectedFault(kind, step)
    os.kill(os.getpid(), _SIGNALS[effect])
