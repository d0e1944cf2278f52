"""The run's generation, as the checkpoint store holds it: which checkpoint writers are current,
and which commits a reader accepts. No torch, no Ray.

The driver counts generations: every start, recovery and resize joins the ranks under a new
one, and a resumed run goes on past the generations its store records, so no generation is
used twice. Before the ranks of generation G join, the driver publishes in the checkpoint root::

    generation.json   {"generation": G, "accepted": {"0": 40, "1": 60, "2": null}}

`accepted[g]`: the newest step that generation g had committed when the run moved past it
(null: none). A rank writes only into its own generation's directories (`step_<N>.g<G>`,
storage/checkpoints.py) and checks the record before it commits (`stale`); a reader accepts a
commit of an older generation only up to that step (`Generations.accepts`), so a rank that was
stopped rather than dead (a node cut off the network) and resumes later can publish nothing
that the run or a resume reads. A store without the record (written before generations, or by
a trainer run without the driver) is generation 0, and every commit in it is accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from rayhybrid.storage.store import Store

RECORD = "generation.json"


class Fenced(RuntimeError):
    """A rank of an older generation than the one the driver published tried to commit."""


@dataclass(frozen=True)
class Generations:
    """What `generation.json` holds: the current generation and, for each older one, the newest
    step it committed before the run moved past it (None: none)."""

    current: int = 0
    accepted: dict[int, int | None] = field(default_factory=dict)

    def accepts(self, generation: int, step: int) -> bool:
        """Whether a reader takes the commit of `step` written by `generation`."""
        if generation >= self.current:
            return True
        newest = self.accepted.get(generation)
        return newest is not None and step <= newest

    def after(self, newest: int | None, generation: int | None = None) -> Generations:
        """The record of the next generation (`generation`, or the one after the current), the
        current one closed at `newest`, the newest step it committed."""
        nxt = self.current + 1 if generation is None else generation
        return Generations(nxt, {**self.accepted, self.current: newest})

    def to_json(self) -> bytes:
        accepted = {str(g): step for g, step in sorted(self.accepted.items())}
        return (json.dumps({"generation": self.current, "accepted": accepted}, indent=1) + "\n").encode()


def read(store: Store, root: str | None = None) -> Generations | None:
    """The record in `store`'s root (or in `root`, a directory of the store); None when there is
    none (generation 0: accept everything)."""
    try:
        data = json.loads(store.read_bytes(f"{root}/{RECORD}" if root is not None else store.join(RECORD)))
    except FileNotFoundError:
        return None
    accepted = {int(g): (None if s is None else int(s)) for g, s in (data.get("accepted") or {}).items()}
    return Generations(int(data["generation"]), accepted)


def publish(store: Store, record: Generations) -> None:
    """Write the record (one PUT: whole or absent), before the ranks of its generation join."""
    store.write_bytes(store.join(RECORD), record.to_json())


def stale(store: Store, mine: int) -> int | None:
    """The generation the driver published, when it is newer than `mine` (the rank is fenced
    off); None when `mine` is current (or the store has no record). One small read."""
    store.fresh()
    record = read(store)
    return record.current if record is not None and record.current > mine else None
