"""Test-only pause points: a rank stops at a named point of a given step and says so, so that a
test can SIGKILL it there from outside (tests/test_vote.py). Off unless the environment variable
RAYHYBRID_TEST_PAUSE_DIR names a folder when the process starts (`ARMED`); then each point costs
a file read.

The test writes `<dir>/pause.json`, {"rank": R, "step": S, "point": P}; rank R, on reaching
point P in step S, writes `<dir>/paused.json` ({"pid", "rank", "step", "point"} and what the
point adds) and sleeps until it is killed. It fires once: not while `paused.json` is there.
Armed, each rank also leaves the digest of its state after every step (`record`), from which the
pause points know the step and rank.

Points: "vote" (before the commit vote's all-reduce, `heal.commit_vote`), "optimizer" (after the
vote, before the first optimizer step) and "grad_all_reduce" (with `fault.nccl_like`: a step's
first all-reduce of more than one value, which on a replicated layout is the gradient
all-reduce in the backward; rayhybrid/faults/async_collectives.py).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

ENV = "RAYHYBRID_TEST_PAUSE_DIR"
_DIR = os.environ.get(ENV)
ARMED = bool(_DIR)
"""Whether this process has pause points at all (read once, at import)."""
_done: dict[str, int] = {}
"""The last step this process recorded, and its rank."""


def record(kind: str, *, step: int, rank: int, **info) -> None:
    """Leave `info` for the test in `<dir>/<kind>-<step>-<rank>-<pid>.json` (the digest of a
    rank's state after each step, to compare replicas bit for bit); nothing when not armed."""
    if not ARMED:
        return
    _done.update(step=step, rank=rank)
    path = Path(_DIR) / f"{kind}-{step}-{rank}-{os.getpid()}.json"
    path.write_text(json.dumps({"step": step, "rank": rank, **info}))


def at(point: str, **info) -> None:
    """Pause here for good if the test asked this rank to pause at `point` in this step."""
    if not ARMED or not _done:
        return
    folder = Path(_DIR)
    try:
        request = json.loads((folder / "pause.json").read_text())
    except (OSError, ValueError):
        return
    here = {"rank": _done["rank"], "step": _done["step"] + 1, "point": point}
    if any(request.get(key) != value for key, value in here.items()) or (folder / "paused.json").exists():
        return
    tmp = folder / f"paused.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"pid": os.getpid(), **here, **info}))
    os.replace(tmp, folder / "paused.json")  # whole or absent for the reader
    while True:  # until the test's SIGKILL
        time.sleep(1.0)
