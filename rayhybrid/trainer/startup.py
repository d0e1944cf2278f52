"""Where a run's start-up time goes: seconds per phase, from the command's start to the end of
its first completed step (summary.json's `startup`, docs/observability.md).

    clock = PhaseClock(since=command_started())   # the driver's; a worker's starts with its process
    clock.mark("ray")                             # "ray" ends now: the time since the last mark is its
    clock.seconds                                 # {"launch": 1.2, "ray": 3.4, ...}

Every moment belongs to the phase of the next mark, so the phases add up to the time from
`since` to the last mark. A worker process marks its own phases on the process-wide clock
(`begin`, `mark`: the trainer's code marks without being handed a clock) and reports them with
its description (`reading`); the driver lays them into its own clock (`critical_path`).
No torch and no Ray here: the driver, the workers and the trainer all use it.
"""

from __future__ import annotations

import os
import time

PHASES = (
    "launch",
    "ray",
    "placement",
    "processes",
    "imports",
    "device_init",
    "data",
    "model_build",
    "parallelize",
    "restore",
    "first_batch",
    "first_step",
)
"""The phases in the order they happen (docs/observability.md says what each holds)."""
WORKER_PHASES = ("imports", "device_init", "data", "model_build", "parallelize", "restore")
"""The phases a worker measures itself, after its process is up (`processes`), in this order."""


class PhaseClock:
    """Seconds per phase; `mark(phase)` ends `phase` now. Wall-clock time (`time.time`), so that
    the driver can place a worker's marks among its own."""

    def __init__(self, since: float | None = None) -> None:
        self.since = time.time() if since is None else since
        self.last = self.since
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str, now: float | None = None) -> None:
        """`phase` ends at `now` (default: now): the time since the last mark counts to it."""
        now = time.time() if now is None else now
        self.seconds[phase] = self.seconds.get(phase, 0.0) + max(0.0, now - self.last)
        self.last = max(self.last, now)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def ordered(self) -> dict[str, float]:
        """The phases in PHASES order, every one present (0 for one that did not happen), rounded."""
        return {phase: round(self.seconds.get(phase, 0.0), 3) for phase in PHASES}


_CLOCK: PhaseClock | None = None
"""This process's clock (a worker's), between `begin` and the `reading` that ends it."""


def begin(since: float | None = None) -> None:
    """Start this process's clock (a worker: when its process is up, or when a join begins)."""
    global _CLOCK
    _CLOCK = PhaseClock(since)


def mark(phase: str) -> None:
    """End `phase` now on this process's clock; nothing when none is running (a trainer built
    outside a worker, e.g. by a test)."""
    if _CLOCK is not None:
        _CLOCK.mark(phase)


def reading() -> dict | None:
    """This process's clock as a worker reports it (`since`, `seconds` per phase), and the clock
    stopped; None when none was running."""
    global _CLOCK
    clock, _CLOCK = _CLOCK, None
    return None if clock is None else {"since": clock.since, "seconds": dict(clock.seconds)}


def critical_path(readings: list[dict], start: float, end: float) -> dict[str, float]:
    """The workers' phases between `start` (the driver asked for their processes) and `end` (every
    worker answered that its trainer is built), as seconds per phase that add up to `end - start`.
    Each phase ends when the last rank ended it (the ranks wait for the slowest one at the
    rendezvous, so that is when the group could go on): `processes` ends when the last worker
    process was up, `imports` when the last rank had imported the trainer, and so on. Time after
    the last rank's last mark (the answers reaching the driver) counts to `parallelize`."""
    ends = {}
    for reading in readings:
        at = reading["since"]
        ends["processes"] = max(ends.get("processes", start), at)
        for phase in WORKER_PHASES:
            at += reading["seconds"].get(phase, 0.0)
            ends[phase] = max(ends.get(phase, start), at)
    out, last = {}, start
    for phase in ("processes", *WORKER_PHASES):
        at = min(max(ends.get(phase, start), last), end)  # in order, within the driver's window
        out[phase] = at - last
        last = at
    out["parallelize"] += end - last
    return out


def command_started() -> float | None:
    """When this process started (wall clock), from /proc on Linux; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - max(0.0, age)
