"""A rank's side of the run's generation (storage/generation.py): before rank 0 commits a
checkpoint it reads the generation the driver published in the checkpoint root, and a rank of
an older one (stopped rather than dead, e.g. on a node cut off the network, and replaced while
it was stopped) refuses: it logs one line and, in a worker, exits its process. Readers reject
such a commit anyway (`Generations.accepts`); the check keeps the store clean and ends the
zombie. Its cost: one small read per commit."""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass

from rayhybrid.storage import generation as generations
from rayhybrid.storage.generation import Fenced
from rayhybrid.storage.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fence:
    generation: int = 0
    """The run's generation this rank joined (0: a trainer run without the driver)."""
    exits: bool = False
    """Exit the process when fenced off (a worker's rank; never a test's or a tool's process)."""

    def check(self, store: Store, what: str) -> None:
        """Raise `Fenced` (or exit) when the driver published a newer generation than this rank's."""
        newer = generations.stale(store, self.generation)
        if newer is None:
            return
        message = (
            f"fenced off: this rank joined the run's generation {self.generation}, but the driver has moved "
            f"the run to generation {newer} ({generations.RECORD} in {store.display}); not committing {what} "
            "(this rank was replaced while it was stopped or cut off)"
        )
        log.error(message)
        if self.exits:
            print(f"rayhybrid: {message}; exiting", file=sys.stderr, flush=True)
            # At once, as a kill from outside would: nothing of this process may run on (its
            # upload thread, its main thread in a call of the generation gone).
            os.kill(os.getpid(), signal.SIGKILL)
        raise Fenced(message)
