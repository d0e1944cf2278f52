"""Live goodput: every second of a run's wall time, from the command's start to summary.json,
given to exactly one cause (docs/observability.md, "Goodput: where the wall time went").

    ledger = WallLedger(since)            # pure: no I/O, no clock of its own
    ledger.event(record)                  # a checkpoint, restart, resize, preemption record
    ledger.save_blocked(step, seconds)    # an asynchronous save blocked training (its record comes later)
    ledger.step(record, now)              # a step record: the interval since the last one is split
                                          # (a step healed forward: counted with its recovery's record)
    ledger.rewind(step)                   # steps after `step` are trained again: theirs -> redone
    ledger.close(now, status)             # the rest, up to summary.json

    Wallclock(cfg, runlog.clock, runlog.summary, runlog.dir, emit=runlog.event)   # the run log attaches it

The ledger keeps a cursor on the wall clock. A step record closes the interval since the cursor:
the pieces known from the records received in it (the step's own split, its evaluation, the
checkpoint blocking, a restart's or resize's phases, the first start's restore) are given to
their causes, and the remainder to host overhead (start-up before the process's first step,
preemption drain in an interval with a preemption notice). A piece that overruns its interval
(its record arrived late, or overlaps another's) carries to the next as a debt, never a
negative, so the causes add up to the wall time at every step. The seconds given to a step
(its kept causes) move to `redone` when that step is trained again.

A resumed run counts its earlier processes: each process keeps its totals in
`<checkpoint.dir>/goodput.json` (updated at each committed checkpoint and at the end), and a new
process folds the earlier ones in, their steps beyond the checkpoint it resumed from as redone.
No torch, no Ray.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rayhybrid.driver.reporting import Reporter
from rayhybrid.storage.store import one_line, write_json

if TYPE_CHECKING:
    from rayhybrid.config.schema import Config
    from rayhybrid.driver.records import RunSummary, StepMetrics
    from rayhybrid.storage.store import Store
    from rayhybrid.trainer.startup import PhaseClock

log = logging.getLogger("rayhybrid")

CAUSES = (
    "productive",
    "startup",
    "data_wait",
    "bubble",
    "exposed_comm",
    "host_overhead",
    "checkpoint",
    "evaluation",
    "detection",
    "teardown",
    "worker_init",
    "restore",
    "redone",
    "waiting_for_nodes",
    "preemption_drain",
)
"""Every cause, in the order the summary and the chart give them."""
KEPT = ("productive", "data_wait", "bubble", "exposed_comm", "host_overhead")
"""The causes of a step's own interval: effective time while the step is kept, redone once not."""
SPLIT = {
    "compute_s": "productive",
    "data_wait_s": "data_wait",
    "bubble_s": "bubble",
    "comm_dp_s": "exposed_comm",
    "comm_tp_s": "exposed_comm",
    "comm_pp_s": "exposed_comm",
    "host_s": "host_overhead",
}
"""A step record's `split` (seconds summing to its step_time_s) -> the causes."""
PHASES = {
    "detect_s": "detection",
    "teardown_s": "teardown",
    "place_s": "waiting_for_nodes",
    "init_s": "worker_init",
    "restore_s": "restore",
}
"""A restart's or resize's timings -> the causes (its save_s: checkpoint or preemption drain)."""
HEALED_FORWARD = "healed_forward"
"""Marks the record of a step healed forward (`driver/healing.py`), which the recovery logs
before its own record: the wall clock takes it out before the record is written."""
STORE_FILE = "goodput.json"
"""At the root of the checkpoint store: each process's totals, for a resumed run."""
PLOT_POINTS = 2000
"""At most about this many points of the running totals are kept for goodput.png."""
STEP_WINDOW = 1000
"""Kept seconds are held per step for at least this many of the latest steps not under a
committed checkpoint (at most twice as many); older ones are folded into one total, so a run
without checkpoints holds a bounded ledger and spends O(1) per step."""


@dataclass
class Piece:
    cause: str
    seconds: float
    step: int | None = None
    """The step whose kept seconds these are (they move to redone if it is trained again)."""


class WallLedger:
    """Seconds by cause from `since` to the cursor; see the module's docstring."""

    def __init__(self, since: float) -> None:
        self.since = self.cursor = since
        self.totals = dict.fromkeys(CAUSES, 0.0)
        self.pending: list[Piece] = []
        """Pieces from the events since the cursor."""
        self.debt: list[Piece] = []
        """Pieces that overran their interval, for the next."""
        self.by_step: dict[int, dict[str, float]] = {}
        """Kept seconds given to each of the latest steps not yet under a committed checkpoint."""
        self.older: dict[str, float] = {}
        """Kept seconds of the steps not under a committed checkpoint before those, folded up to
        `older_upto` (a rewind below it moves them all to redone)."""
        self.older_upto: int | None = None
        self.floor = 0
        """The latest step under a committed checkpoint: its seconds and those before are kept."""
        self.top: int | None = None
        """The latest step recorded (after a rewind: at most the step rewound to)."""
        self.blocked_steps: set[int] = set()
        """Asynchronous saves counted when they blocked, whose records have not come yet."""
        self.stepped = False
        self.starts = 0
        """The workers' starts before the first step (`started`)."""
        self.restart_restored = False
        """A restart record before the first step timed the first start's restore (that start
        followed one that failed before its workers joined): the startup restore is in it."""
        self._new_interval()

    def _new_interval(self) -> None:
        self.covered = 0.0  # seconds since the cursor that interrupted records already gave
        self.blocked = 0.0  # checkpoint blocking given in this interval
        self.saved = self.preempted = self.after_restart = False

    # -- records --------------------------------------------------------------------------------

    def event(self, record: dict) -> None:
        """An event record, received since the cursor."""
        kind, after_restart = record.get("event"), self.after_restart
        self.after_restart = False
        if kind == "checkpoint":
            self.saved = True
            if record.get("step") not in self.blocked_steps:  # an asynchronous save's: counted when it blocked
                self.blocked += self._add("checkpoint", record.get("blocked_s"))
            self.blocked_steps.discard(record.get("step"))
        elif kind == "preemption":
            self.preempted = True
        elif kind == "restart":
            self._phases(record)
            self.after_restart = "interrupted" not in record
            self.restart_restored |= self.after_restart and not self.stepped and self.starts <= 1
        elif kind == "resize" and not after_restart:  # a restart that changed dp: counted once
            self._phases(record)

    def started(self) -> None:
        """The workers started (a start's or a recovery's restore done)."""
        if not self.stepped:
            self.starts += 1

    def save_blocked(self, step: int, seconds: float) -> None:
        """An asynchronous save of `step` blocked training for `seconds` since the cursor."""
        self.blocked += self._add("checkpoint", seconds)
        self.blocked_steps.add(step)

    def _phases(self, record: dict) -> None:
        """A restart's or resize's timings. A recovery measures its detection from the last
        step record, across any recovery that failed before it (an `interrupted` record): that
        part is not counted twice."""
        detect = record.get("detect_s") or 0.0
        self._add("detection", detect - self.covered)
        for key, cause in PHASES.items():
            if key != "detect_s":
                self._add(cause, record.get(key))
        save = (record.get("save_s") or 0.0) - self.blocked  # the checkpoint's blocking is counted
        self._add("preemption_drain" if self.preempted else "checkpoint", save)
        if "interrupted" in record:
            self.covered = max(self.covered, detect + (record.get("total_s") or 0.0))

    def _add(self, cause: str, seconds: float | None) -> float:
        seconds = max(0.0, seconds or 0.0)
        if seconds > 0:
            self.pending.append(Piece(cause, seconds))
        return seconds

    def step(self, record: dict, now: float, startup_restore: float = 0.0) -> None:
        """A step record at `now`: the interval since the cursor given out. `startup_restore`:
        the first start's restore phase, given to `restore` in the process's first interval."""
        step = int(record["step"])
        if self.top is not None and step <= self.top:  # trained again without a rewind: the old ones are redone
            self.rewind(step - 1)
        self.top = step
        if record.get(HEALED_FORWARD):  # trained before the failure, recorded in its recovery
            self.pending += [Piece(c, s, step) for c, s in step_pieces(record).items() if s > 0]
            self.covered += record.get("step_time_s") or 0.0  # inside the recovery's detect_s
            return
        # The step's own time first (surely in the interval), then older debts, then the events'.
        pieces = [Piece(c, s, step) for c, s in step_pieces(record).items() if s > 0]
        if record.get("eval_s"):
            pieces.append(Piece("evaluation", record["eval_s"]))
        if not self.stepped and startup_restore > 0 and not self.restart_restored:
            pieces.append(Piece("restore", startup_restore))
        rest = "startup" if not self.stepped else "preemption_drain" if self.preempted else "host_overhead"
        self._settle(
            now, [*pieces, *self.debt, *self.pending], Piece(rest, 0.0, step if rest == "host_overhead" else None)
        )
        self.stepped = True

    def close(self, now: float, status: str = "completed") -> None:
        """The run ends at `now`: the last interval given out; a debt left over is dropped (its
        seconds overlapped others). The rest after the last step: checkpoint when a save was
        committed in it (the final save and its upload), detection when the run failed."""
        if not self.stepped:
            rest = "startup"
        elif status == "failed":  # a failed run's save reported late is not its end's cause
            rest = "detection"
        else:
            rest = "checkpoint" if self.saved else "host_overhead"
        self._settle(now, [*self.debt, *self.pending], Piece(rest, 0.0))
        self.debt = []

    def _settle(self, now: float, pieces: list[Piece], rest: Piece) -> None:
        left = max(0.0, now - self.cursor)
        self.debt = []
        for piece in pieces:
            take = min(piece.seconds, left)
            self._credit(piece.cause, take, piece.step)
            left -= take
            if piece.seconds - take > 1e-12:
                self.debt.append(Piece(piece.cause, piece.seconds - take, piece.step))
        self._credit(rest.cause, left, rest.step)
        self.cursor = max(self.cursor, now)
        self.pending = []
        self._new_interval()

    def _credit(self, cause: str, seconds: float, step: int | None) -> None:
        if seconds <= 0:
            return
        self.totals[cause] += seconds
        if step is None or cause not in KEPT or step <= self.floor:
            return
        kept = (
            self.older if self.older_upto is not None and step <= self.older_upto else self.by_step.setdefault(step, {})
        )
        kept[cause] = kept.get(cause, 0.0) + seconds
        if len(self.by_step) > 2 * STEP_WINDOW:
            self._fold()

    def _fold(self) -> None:
        """The oldest half of `by_step` into `older`: amortized O(1) per step."""
        oldest = sorted(self.by_step)[:STEP_WINDOW]
        for s in oldest:
            for cause, seconds in self.by_step.pop(s).items():
                self.older[cause] = self.older.get(cause, 0.0) + seconds
        self.older_upto = max(oldest[-1], self.older_upto or 0)

    def rewind(self, step: int) -> None:
        """Steps after `step` will be trained again: the seconds they were given are redone."""
        gone = [self.by_step.pop(s) for s in [s for s in self.by_step if s > step]]
        if self.older_upto is not None and step < self.older_upto:
            gone.append(self.older)
            self.older, self.older_upto = {}, None
        for kept in gone:
            for cause, seconds in kept.items():
                self.totals[cause] -= seconds
                self.totals["redone"] += seconds
        self.top = step if self.top is None else min(self.top, step)
        self.floor = min(self.floor, step)  # a restore from an older checkpoint than the latest
        for piece in self.debt:
            if piece.step is not None and piece.step > step:
                piece.cause, piece.step = "redone", None

    def committed(self, step: int) -> None:
        """Step `step` is under a committed checkpoint: it and those before are never trained again."""
        self.floor = max(self.floor, step)
        for s in [s for s in self.by_step if s <= step]:
            del self.by_step[s]
        if self.older_upto is not None and self.older_upto <= step:
            self.older, self.older_upto = {}, None

    def tail(self) -> list[list]:
        """The kept seconds not under a committed checkpoint, by step (the folded ones under the
        latest step folded), for goodput.json."""
        out = [[self.older_upto, self.older]] if self.older_upto is not None else []
        return [[s, {c: round(v, 6) for c, v in kept.items()}] for s, kept in [*out, *sorted(self.by_step.items())]]

    @property
    def wall_s(self) -> float:
        return self.cursor - self.since


def step_pieces(record: dict) -> dict[str, float]:
    """A step's own time by cause: its `split` when the record has one, else its data wait,
    its bubble share of the rest, and the rest productive."""
    out = dict.fromkeys(KEPT, 0.0)
    split = record.get("split")
    if isinstance(split, dict):
        for key, cause in SPLIT.items():
            out[cause] += max(0.0, split.get(key) or 0.0)
        return out
    total = max(0.0, record.get("step_time_s") or 0.0)
    wait = min(total, max(0.0, record.get("data_wait_s") or 0.0))
    bubble = (total - wait) * min(1.0, max(0.0, record.get("bubble") or 0.0))
    out.update(data_wait=wait, bubble=bubble, productive=total - wait - bubble)
    return out


def effective_time(seconds: dict[str, float], wall_s: float) -> float:
    """The share of the wall time in steps that are kept (the simulator's definition)."""
    return sum(seconds[c] for c in KEPT) / wall_s if wall_s > 0 else 0.0


# -- earlier processes of a resumed run -------------------------------------------------------------


def settled(entry: dict, resumed: int) -> dict:
    """An earlier process's entry as a process resuming from step `resumed` counts it: the
    kept seconds of its steps after `resumed` moved to redone, its tail emptied."""
    seconds = {c: float(entry.get("seconds", {}).get(c, 0.0)) for c in CAUSES}
    for step, kept in entry.get("tail", []):
        if int(step) > resumed:
            for cause, value in kept.items():
                seconds[cause] -= value
                seconds["redone"] += value
    return {**entry, "seconds": {c: round(v, 6) for c, v in seconds.items()}, "tail": []}


def read_processes(store: Store) -> list[dict]:
    """The processes `goodput.json` in `store` holds ([] when there is none or it is unreadable)."""
    try:
        data = json.loads(store.read_bytes(store.join(STORE_FILE)))
    except FileNotFoundError:
        return []
    except Exception as err:  # noqa: BLE001 - the earlier processes are lost, not the run
        log.warning("could not read %s (%s); goodput counts this process only", STORE_FILE, one_line(err))
        return []
    processes = data.get("processes") if isinstance(data, dict) else None
    return [p for p in processes if isinstance(p, dict) and "seconds" in p] if isinstance(processes, list) else []


class Wallclock(Reporter):
    """The run log's reporter of goodput: running totals on each step record (`goodput`), a
    `goodput` event, summary.json's `goodput`, a line and goodput.png at the end, and the
    totals in the checkpoint store for a resumed run."""

    def __init__(self, cfg: Config, clock: PhaseClock, summary: RunSummary, run_dir: Path, emit=None) -> None:
        self.cfg, self.summary, self.dir, self.emit = cfg, summary, run_dir, emit
        self.ledger = WallLedger(clock.since)
        self.store: Store | None = None
        self.id = uuid.uuid4().hex[:12]
        self.found: list[dict] = []
        """The earlier processes' entries, as goodput.json had them."""
        self.earlier: list[dict] | None = None
        """The same once settled against the step this process resumed from."""
        self.resumed: int | None = None
        self.write_failed = False
        self.points: list[tuple[float, tuple[float, ...]]] = []

    # -- hooks ----------------------------------------------------------------------------------

    def on_store(self, store: Store) -> None:
        self.store = store
        self.found = read_processes(store) if self.cfg.checkpoint.enabled else []

    def on_event(self, record: dict) -> None:
        self.ledger.event(record)
        if record.get("event") == "resume" and self.resumed is None:
            self.resumed = int(record["step"])
        elif record.get("event") == "checkpoint":
            self.ledger.committed(int(record["step"]))
            self._save()

    def after_workers_start(self, placement: list[dict], description: dict) -> None:
        self.ledger.started()
        if self.earlier is None:  # the first start: it resumed from `resumed` (none: from the beginning)
            self.earlier = [settled(p, self.resumed or 0) for p in self.found]

    def before_step(self, record: StepMetrics) -> StepMetrics:
        startup = self.summary.startup.get("restore", 0.0) if self.summary.startup else 0.0
        self.ledger.step(record, time.time(), startup)
        seconds, wall = self.seconds()
        self._point(wall, seconds)
        record = {k: v for k, v in record.items() if k != HEALED_FORWARD}
        return {**record, "goodput": {c: round(v, 3) for c, v in seconds.items()}}

    def on_save_blocked(self, step: int, seconds: float) -> None:
        self.ledger.save_blocked(step, seconds)

    def on_rewind(self, step: int) -> None:
        self.ledger.rewind(step)

    def before_close(self, summary: dict, history: list[StepMetrics]) -> None:
        self.ledger.close(self.ledger.since + summary["wall_s"], summary.get("status", "completed"))
        seconds, wall = self.seconds()
        self._point(wall, seconds)
        share = effective_time(seconds, wall)
        rounded = {c: round(v, 3) for c, v in seconds.items()}
        summary["goodput"] = {
            "seconds": rounded,
            "wall_s": round(wall, 3),
            "effective_time": round(share, 4),
            "processes": len(self._earlier()) + 1,
        }
        if self.emit is not None:
            self.emit(
                {"event": "goodput", "seconds": rounded, "wall_s": round(wall, 3), "effective_time": round(share, 4)}
            )
        lost = sorted(((v, c) for c, v in seconds.items() if c not in KEPT and v >= 0.05), reverse=True)
        log.info(
            "goodput: %.1f%% effective; lost: %s",
            100 * share,
            ", ".join(f"{c.replace('_', ' ')} {v:.1f}s" for v, c in lost) or "nothing",
        )
        self._save()
        if history:
            goodput_plot(self.points, self.dir / "goodput.png")

    # -- pieces ---------------------------------------------------------------------------------

    def seconds(self) -> tuple[dict[str, float], float]:
        """The run's seconds by cause and its wall time: this process's, and the earlier ones'."""
        out, wall = dict(self.ledger.totals), self.ledger.wall_s
        for entry in self._earlier():
            wall += float(entry.get("wall_s", 0.0))
            for cause in CAUSES:
                out[cause] += float(entry["seconds"].get(cause, 0.0))
        return out, wall

    def _earlier(self) -> list[dict]:
        """The earlier processes: settled once this process's workers started, else as found
        (their tails kept: the process that resumes settles them against its own step)."""
        return self.earlier if self.earlier is not None else self.found

    def _point(self, wall: float, seconds: dict[str, float]) -> None:
        self.points.append((wall, tuple(seconds[c] for c in CAUSES)))
        if len(self.points) > 2 * PLOT_POINTS:
            self.points = [*self.points[:-1:2], self.points[-1]]

    def _save(self) -> None:
        """goodput.json: the earlier processes (settled) and this one, up to the cursor."""
        if self.store is None or not self.cfg.checkpoint.enabled:
            return
        led = self.ledger
        mine = {
            "id": self.id,
            "started": round(led.since, 3),
            "updated": round(time.time(), 3),
            "wall_s": round(led.wall_s, 6),
            "seconds": {c: round(v, 6) for c, v in led.totals.items()},
            "tail": led.tail(),
        }
        data = {"processes": [*self._earlier(), mine]}
        try:
            write_json(self.store, STORE_FILE, data)
        except Exception as err:  # noqa: BLE001 - the checkpoint store's trouble is for checkpoints to report
            if not self.write_failed:
                self.write_failed = True
                log.warning(
                    "could not write %s (%s); a resumed run will not count this process", STORE_FILE, one_line(err)
                )


def goodput_plot(points: list[tuple[float, tuple[float, ...]]], path: Path) -> Path:
    """The running totals by cause over wall time, stacked (matplotlib's Agg canvas)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = [*KEPT, *(c for c in CAUSES if c not in KEPT)]  # the kept time at the bottom
    shown = [CAUSES.index(c) for c in order if points and points[-1][1][CAUSES.index(c)] > 0]
    xs = [0.0, *(p[0] for p in points)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.stackplot(
        xs,
        [[0.0, *(p[1][i] for p in points)] for i in shown],
        labels=[CAUSES[i].replace("_", " ") for i in shown],
        colors=[plt.get_cmap("tab20")(i) for i in shown],
    )
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("seconds by cause (running total)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
