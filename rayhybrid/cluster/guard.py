"""How a worker fails: any error in a call breaks its process group, so the worker leaves the
group (waking the peers blocked on it) and reports the error in one line that crosses Ray's
process boundary (`RankFailed`, with the time it happened)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from rayhybrid.errors import ConfigError, RankFailed


def guarded(reset: Callable[[], None], rank: int, fn: Callable, *args):
    """Run `fn(*args)`; on failure `reset` (leave the process group) and raise `RankFailed` with
    the error's one-line summary, or a `ConfigError` naming rank `rank` and this process."""
    config_error = None
    try:
        return fn(*args)
    except ConfigError as err:
        # The settings cannot work here (a model.module the workers cannot import, say):
        # no restart can help, so the driver stops with it (exit code 2).
        config_error = ConfigError(err.setting, f"{err.message} (on rank {rank}, pid {os.getpid()})")
    except Exception as err:  # noqa: BLE001 - any failure breaks the group the same way
        at = time.time()
        err = out_of_memory(err) or err
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        message = f"{type(err).__name__}: {lines[0] if lines else ''}"
    # Outside the handler, so the traceback's frames (and the trainer they hold) are gone.
    reset()
    if config_error is not None:
        raise config_error
    raise RankFailed(message, at)


def out_of_memory(err: BaseException) -> BaseException | None:
    """The out-of-memory error behind `err`, if any: torch's pipeline schedules wrap a stage's
    errors in a RuntimeError ("Failed to run stage backward")."""
    import torch

    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, torch.OutOfMemoryError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None
