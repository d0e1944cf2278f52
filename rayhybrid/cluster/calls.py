"""The worker group's remote calls: the one call in flight on every rank, how it ended, and
which rank to blame when it failed.

`Calls` is the only code that waits on the workers' calls; the group (`group.py`) and its
drain (`drain.py`) ask it through its methods what the last call left behind.
"""

from __future__ import annotations

import math
import time

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from rayhybrid.errors import ConfigError, RankFailed, WorkerError

# After a failure, how long the workers still running get to notice it and leave the process
# group (they normally take well under a second: the failed rank's closed connections wake
# them; a killed stopped process takes Ray about 5s to end).
DRAIN_TIMEOUT_S = 30.0

PING_TIMEOUT_S = 2.0
"""How long a worker blocked in a collective gets to answer a ping before it counts as hung. The
ping runs in the worker's control thread, which answers in milliseconds while the main thread
is blocked in a collective or computing; a stopped or wedged process never does."""

FAILURE_GRACE_S = 1.0
"""Once a rank's call has failed, how long to wait for the other ranks' outcomes before naming
the first failure (its peers fail within a fraction of a second, when it leaves the group)."""


class Calls:
    """The refs of the group's last call on every rank (in rank order), kept after it fails so
    the drain can tell the ranks that finished from the ones still busy, and whether it failed
    by making no progress (`hung`)."""

    def __init__(self) -> None:
        self._inflight: list = []
        self._hung = False
        self._probes: dict[int, tuple] = {}

    @property
    def hung(self) -> bool:
        """Whether the last call failed by making no progress."""
        return self._hung

    @property
    def probes(self) -> dict[int, tuple]:
        """rank -> (ping ref, when sent) of the pings sent ahead of a hung call's timeout."""
        return self._probes

    def get(self, refs: list, timeout_s: float | None = None, what: str = "call", probe=None) -> list:
        """`ray.get` that fails fast, naming the rank that failed first (`first_failure`), or the
        first rank still busy when no rank has finished for `timeout_s`. `probe(ranks)` (rank ->
        ping ref): pinged ahead of that timeout (`_wait`), so the drain knows at once which
        busy ranks do not answer."""
        self._inflight, self._hung, self._probes = refs, False, {}
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = self._wait(pending, timeout_s, probe, rank_of)
            if not ready:
                self._hung = True
                raise WorkerError(
                    rank_of[pending[0]],
                    f"{what} made no progress for {timeout_s:g}s (fault.step_timeout_s); the worker is hung",
                )
            for ref in ready:
                try:
                    ray.get(ref)
                except RayTaskError as err:
                    if isinstance(err.cause, ConfigError):  # settings no restart can fix: exit 2
                        raise ConfigError(err.cause.setting, err.cause.message) from None
                    raise first_failure(_failures(refs)) from None
                except RayActorError:
                    raise first_failure(_failures(refs)) from None
        return ray.get(refs)

    def _wait(self, pending: list, timeout_s: float | None, probe, rank_of: dict) -> tuple[list, list]:
        """`ray.wait` for one more of `pending` within `timeout_s`; with `probe`, the ranks still
        busy are pinged PING_TIMEOUT_S (at most half the timeout) before it ends, so that a hung
        call's stopped ranks are known by the timeout, not a ping's wait after it."""
        if probe is None or timeout_s is None:
            return ray.wait(pending, num_returns=1, timeout=timeout_s)
        ahead = min(PING_TIMEOUT_S, timeout_s / 2)
        ready, rest = ray.wait(pending, num_returns=1, timeout=timeout_s - ahead)
        if ready:
            return ready, rest
        sent = time.perf_counter()
        self._probes = {rank: (ref, sent) for rank, ref in probe([rank_of[r] for r in rest]).items()}
        return ray.wait(rest, num_returns=1, timeout=ahead)

    def busy(self) -> list[int]:
        """The ranks whose part of the last call has not ended."""
        return [rank for rank, ref in enumerate(self._inflight) if not finished(ref)]

    def unsettled(self) -> bool:
        """Whether the last call left something to recover from: a rank still busy in it, or
        one whose part failed."""
        return bool(self._inflight) and (bool(self.busy()) or bool(self.errors()))

    def errors(self) -> dict[int, str]:
        """After a failed call: the one-line error of each rank whose call failed, once they
        have all ended (a failed rank's peers fail after it; waits at most DRAIN_TIMEOUT_S)."""
        refs = self._inflight
        ray.wait(refs, num_returns=len(refs), timeout=DRAIN_TIMEOUT_S)
        out = {}
        for rank, ref in enumerate(refs):
            if finished(ref):
                try:
                    ray.get(ref)
                except RayTaskError as err:
                    out[rank] = summary(err)
                except RayActorError as err:
                    out[rank] = f"worker died: {summary(err)}"
        return out

    def settle(self, extra: list = ()) -> None:
        """Forget the last call, collecting its outcome and that of `extra` refs (all have
        ended or their actor is gone), so Ray does not report the expected errors as unhandled."""
        refs, self._inflight = [*self._inflight, *extra, *(ref for ref, _ in self._probes.values())], []
        self._probes = {}
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=5)
        for ref in done:
            try:
                ray.get(ref)
            except RayError:
                pass

    def forget(self) -> None:
        """Drop the last call without waiting on it (its workers are stopped)."""
        self._inflight, self._probes = [], {}


def _failures(refs: list) -> list[tuple[int, str, float | None]]:
    """(rank, one-line error, when it happened; None for a worker that died) of every call in
    `refs` (in rank order) that failed, waiting up to FAILURE_GRACE_S for those still running."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=FAILURE_GRACE_S)
    out = []
    for rank, ref in enumerate(refs):
        if ref not in done:
            continue
        try:
            ray.get(ref)
        except RayTaskError as err:
            out.append((rank, summary(err), getattr(err.cause, "at", None) or math.inf))
        except RayActorError as err:
            out.append((rank, f"worker died: {summary(err)}", None))
    return out


def first_failure(failures: list[tuple[int, str, float | None]]) -> WorkerError:
    """The failure to report, of (rank, error, time) in rank order: a worker that died (its
    peers' errors are consequences: broken connections), else the error that happened first
    (an out-of-memory error, not the peer's "Connection closed by peer" after it), else the
    lowest rank."""
    died = [f for f in failures if f[2] is None]
    rank, message, _ = died[0] if died else min(failures, key=lambda f: (f[2], f[0]))
    return WorkerError(rank, message)


def finished(ref) -> bool:
    return bool(ray.wait([ref], timeout=0)[0])


def summary(err: Exception) -> str:
    """The remote error's last line (its type and message), not the whole traceback."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, RankFailed):
        return str(cause)
    if isinstance(cause, Exception) and not isinstance(cause, RayError):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    if isinstance(err, RayActorError):
        # Ray's text runs to a paragraph of possible causes; keep what happened.
        text = " ".join(str(err).split())
        first = text.split(". ")[0].rstrip(".")
        exit_type = text.split("Worker exit type: ")[1].split()[0] if "Worker exit type: " in text else ""
        return f"{first} ({exit_type})" if exit_type else first
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(err).__name__
