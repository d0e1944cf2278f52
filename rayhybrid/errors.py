"""Typed, picklable errors whose messages say how to fix the problem.

`ConfigError` means the user asked for something that cannot work; the CLI prints its one-line
message and exits with code 2. Everything else is a runtime failure (exit code 1).
"""

from __future__ import annotations

CONFIG_EXIT_CODE = 2

TESTED_TORCH = "torch>=2.11,<2.14"
"""The torch versions rayhybrid is tested with, for the lines that say which torch to use: the
range pyproject.toml declares (tests/test_torch_range.py keeps the two, and README, agreed)."""


class RayHybridError(Exception):
    """Base class; `str(err)` is a single line meant for the user."""


class ConfigError(RayHybridError):
    """A setting is invalid. `setting` names it (e.g. ``topology.tp``); the message says the fix."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting
        self.message = message

    def __reduce__(self):
        return (type(self), (self.setting, self.message))


class PlacementError(ConfigError):
    """The cluster can never place the requested ranks (its nodes are too few or too small)."""


class PlacementTimeout(RayHybridError):
    """The cluster could not place the ranks in time (busy, or short of resources for now): a
    runtime condition, not a config error."""


class RunFailed(RayHybridError):
    """The run cannot go on (restarts exhausted, a failure that repeats, replicas that cannot be
    placed again); the message names the cause and the last good checkpoint."""


class WorkerError(RayHybridError):
    """A worker failed; carries the rank and the remote error's one-line summary."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank}: {message}")
        self.rank = rank
        self.message = message

    def __reduce__(self):
        return (type(self), (self.rank, self.message))


class RankFailed(RayHybridError):
    """Raised inside a worker whose call failed, after it left the process group; the message
    is the original error's one-line summary, `at` the wall-clock time it happened (the
    driver names the rank that failed first: its peers fail after it, of broken connections)."""

    def __init__(self, message: str, at: float = 0.0) -> None:
        super().__init__(message)
        self.message = message
        self.at = at

    def __reduce__(self):
        return (type(self), (self.message, self.at))
