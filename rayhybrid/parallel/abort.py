"""NCCL's error handling, and aborting a rank's communicators from another thread.

On NCCL a collective whose peer died does not raise on the host that issued it: its kernel waits
on the device, and the host learns of it only through ProcessGroupNCCL's watchdog.
`TORCH_NCCL_ASYNC_ERROR_HANDLING` says what the watchdog does on an error or a timeout: 0
nothing, 1 abort the communicator and tear the process down, 2 only abort the communicator
(the failed collective's work raises, the process lives on), 3 tear down without aborting,
torch's default (torch's docs/source/torch_nccl_environment_variables.md). Peer healing needs
the survivors alive with their state, so `nccl_error_handling` sets 2 before an NCCL process
group forms, unless the environment sets it already.

A dead peer may still show only as a hang until the watchdog's timeout (minutes). The driver
does not wait for it: after a failed call it aborts the communicators of every rank still busy
(`abort_collectives`, run in the worker's control thread, `TrainWorker.abort_collectives`), so a
survivor blocked in a collective raises within seconds; and a worker leaving its groups after a
failed call aborts them before it keeps its state, so the copy to the host is not queued behind
a hung kernel. A worker leaving healthy groups (a rejoin, a resize, the end) destroys them as
usual, without an abort. On gloo a dead peer already raises on the host: both are no-ops there.

The two threads may abort at once (the drain's call and the main thread's failed call): a lock
makes one abort a world, once; the other finds it aborted and does nothing. Leaving the world
(`leaving`, before `destroy_process_group`) takes the same lock, so no abort walks the groups
while they are destroyed, and a new world (`formed`) may be aborted again.

`ProcessGroup.abort` is public; the list of a world's groups (c10d's `_world.pg_map`) is not
(tests/test_private_apis.py lists it).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
CLEAN_UP_ONLY = "2"
"""Abort the communicator on an error, keep the process."""

_lock = threading.Lock()
_aborted = False
"""This process's world was aborted or left (under `_lock`): nothing is left to abort until
the next one forms."""


def formed() -> None:
    """A new world formed (`mesh.init_process_group`): it may be aborted once."""
    global _aborted
    with _lock:
        _aborted = False


def leaving() -> None:
    """Before this process's world is destroyed: waits for an abort in progress, and no abort
    starts until the next world forms."""
    global _aborted
    with _lock:
        _aborted = True


def nccl_error_handling() -> None:
    """Before an NCCL process group forms: a failed collective aborts its communicator and
    raises, and the process lives on (unless the environment chose otherwise)."""
    chosen = os.environ.setdefault(ERROR_HANDLING_ENV, CLEAN_UP_ONLY)
    if chosen != CLEAN_UP_ONLY:
        log.warning(
            "%s=%s (set outside rayhybrid): a rank that sees a collective fail may be torn down, and peer "
            "healing then loses its state; %s keeps it",
            ERROR_HANDLING_ENV,
            chosen,
            CLEAN_UP_ONLY,
        )


def abort_collectives() -> bool:
    """Abort every NCCL communicator of this process's world, from any thread: a collective
    blocked in one raises in the thread that issued it. Returns whether it aborted any (never on
    gloo, nor before a world formed, nor a second time). The groups stay registered: the rank
    leaves them as always (`destroy_process_group`)."""
    global _aborted
    if "torch.distributed" not in sys.modules:  # never imported torch: no world
        return False
    with _lock:
        if _aborted or not _abort_world():
            return False
        _aborted = True
        return True


def _abort_world() -> bool:
    """Abort every NCCL group of the world (under `_lock`); False on gloo or without a world."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return False
    world = getattr(c10d, "_world", None)
    groups = list(getattr(world, "pg_map", None) or [dist.group.WORLD])  # a torch without it: the default group
    for group in groups:
        try:
            group.abort()
        except RuntimeError as err:  # already aborted or shut down: nothing left to stop
            log.debug("abort of a process group failed: %s", err)
    return True
