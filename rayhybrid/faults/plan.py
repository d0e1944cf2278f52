"""Built-in fault injection (`fault.inject`, `fault.inject_rate`): rehearse failures before a long job.

The driver owns one `FaultPlan` per run and asks it, at the start of every step and before every
checkpoint save, whether a fault is due and on which rank; the victim rank's worker then calls
`trigger`, which kills, stops or fails its own process. Everything here is pure (no Ray, no
torch) except `trigger`, which signals the calling process.

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

if TYPE_CHECKING:
    from collections.abc import Iterable

    from rayhybrid.config.schema import Config, FaultConfig

log = logging.getLogger(__name__)

KINDS = ("kill", "hang", "raise", "kill_save", "kill_eval")
"""kill: SIGKILL at the start of the step; hang: SIGSTOP there; raise: `InjectedFault` there;
kill_save: SIGKILL during the checkpoint save after the step, once the rank's own data is
written (mid-upload when saves are asynchronous); kill_eval: SIGKILL at the start of the
held-out evaluation after the step (planned only, at a step eval.every evaluates)."""
RANDOM_KINDS = ("kill", "hang", "raise", "kill_save")
PHASES = ("step", "save")
FORM = "KIND@STEP or KIND@STEP:RANK, e.g. kill@5 or hang@9:3"
_PATTERN = re.compile(r"(?P<kind>\w+)@(?P<step>-?\d+)(?::(?P<rank>\d+))?")


@dataclass(frozen=True)
class Injection:
    """One fault: `kind` fires in `step` (its save, for kill_save) on `rank`."""

    kind: str
    """One of KINDS."""
    step: int
    """The 1-based optimizer step it belongs to."""
    rank: int | None = None
    """The victim; None: drawn when it fires."""

    @property
    def phase(self) -> str:
        """Where it fires: in the checkpoint save after the step ("save", kill_save) or at its start ("step")."""
        return "save" if self.kind == "kill_save" else "step"

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
    kinds = _entries(cfg.fault.inject_kinds)
    for kind in kinds:
        if kind not in RANDOM_KINDS:
            raise ConfigError("fault.inject_kinds", f"unknown kind {kind!r}; choose from: {', '.join(RANDOM_KINDS)}")
    if rate > 0 and not kinds:
        raise ConfigError(
            "fault.inject_kinds", f"is empty but fault.inject_rate={rate}; list kinds, e.g. [{', '.join(KINDS[:3])}]"
        )
    if rate > 0 and "kill_save" in kinds and cfg.checkpoint.every == 0:
        raise ConfigError(
            "fault.inject_kinds", "kill_save needs checkpoint saves but checkpoint.every=0; set checkpoint.every>0"
        )


def _validate_injection(cfg: Config, injection: Injection, text: str) -> None:
    steps, every = cfg.train.steps, cfg.checkpoint.every
    if not 1 <= injection.step <= steps:
        raise ConfigError(
            "fault.inject", f"{text!r}: step {injection.step} is out of range; use a step in 1..{steps} (train.steps)"
        )
    if injection.kind == "kill_save" and not cfg.checkpoint.due(injection.step, steps):
        fix = (
            "set checkpoint.every>0 (checkpoint.every=0 never saves)"
            if every == 0
            else f"use a multiple of checkpoint.every={every} or the last step {steps}"
        )
        raise ConfigError("fault.inject", f"{text!r}: step {injection.step} is not a checkpoint step; {fix}")
    if injection.kind == "kill_eval" and not cfg.eval.due(injection.step, steps):
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
        self._kinds = {
            "step": tuple(k for k in kinds if k != "kill_save"),
            "save": tuple(k for k in kinds if k == "kill_save"),
        }
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


def trigger(kind: str, step: int) -> None:
    """Worker side, in the victim rank's process: kill and kill_save SIGKILL it, hang SIGSTOPs it
    (a hang for fault.step_timeout_s to find), raise raises `InjectedFault`."""
    log.warning("injecting fault %s@%d in pid %d (fault.inject)", kind, step, os.getpid())
    if kind in ("kill", "kill_save", "kill_eval"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "raise":
        raise InjectedFault(kind, step)
    else:
        raise ValueError(f"unknown fault kind {kind!r}; one of: {', '.join(KINDS)}")
