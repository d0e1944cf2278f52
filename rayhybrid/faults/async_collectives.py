"""A test mode (`fault.nccl_like`): gloo's collectives behave as NCCL's do when a peer dies.

On gloo a collective blocks the host until it ends, and raises there when a peer is gone. On
NCCL the host only queues the kernel: a collective whose peer died ends (once the communicator
is aborted: its watchdog with TORCH_NCCL_ASYNC_ERROR_HANDLING=2, or the drain's
`abort_collectives`) with its buffer as far as it got, partly reduced, and the host, which went
on meanwhile, learns nothing when it reads a value: a read (`.item()`, `float()`) waits for the
kernels before it, then returns what the buffer holds. The failure is raised later, when the
host next issues work on the aborted communicator. This mode takes the latest moment NCCL allows
for that: within a step the host learns only what it reads, and the failure is raised at the next
`host_sync()` (`Trainer.train_step` calls it as a step begins).

Installed, each collective below that rayhybrid or torch's replicate/FSDP2 call through
`torch.distributed` is issued with `async_op=True` and waited at once; a failed wait is
recorded, the tensor left as it is, and the host carries on. Covered: all_reduce,
all_gather_into_tensor, all_gather_single, reduce_scatter_tensor, reduce_scatter_single,
broadcast (replicate and FSDP2 issue all_reduce, all_gather_single, reduce_scatter_single; the
trainer all_reduce). Not covered: a caller's own `async_op=True` call (its wait raises as
usual), barrier and the object collectives (checkpoint saves), point-to-point sends (the heal,
the pipeline schedules) and the functional collectives of DTensor (tensor parallelism).

    install()      # the worker joins with fault.nccl_like
    host_sync()    # raises the first failure recorded since install (no-op when not installed)
    uninstall()    # the worker leaves its process groups
"""

from __future__ import annotations

import functools
import logging

import torch.distributed as dist

from rayhybrid.faults import pause

COVERED = (
    "all_reduce",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
)

log = logging.getLogger(__name__)

_originals: dict[str, object] = {}
_failures: list[str] = []


class CollectiveFailed(RuntimeError):
    """A collective that failed earlier in `fault.nccl_like` mode, raised at a host sync."""


def installed() -> bool:
    return bool(_originals)


def install() -> None:
    """Replace the covered collectives of `torch.distributed` (idempotent)."""
    if _originals:
        return
    _failures.clear()
    for name in COVERED:
        original = getattr(dist, name)
        _originals[name] = original
        setattr(dist, name, _deferred(name, original))
    log.warning("fault.nccl_like: collectives fail as on NCCL (a test mode)")


def uninstall() -> None:
    """Put the originals back and forget what failed."""
    for name, original in _originals.items():
        setattr(dist, name, original)
    _originals.clear()
    _failures.clear()


def host_sync() -> None:
    """Where the host learns of a failed collective: raises the first one recorded."""
    if _failures:
        first = _failures[0]
        _failures.clear()
        raise CollectiveFailed(f"fault.nccl_like: a collective failed earlier in this step: {first}")


def _deferred(name: str, original):
    @functools.wraps(original)
    def issue(*args, **kwargs):
        if kwargs.get("async_op"):
            return original(*args, **kwargs)
        if pause.ARMED and name == "all_reduce" and args and args[0].numel() > 1:
            pause.at("grad_all_reduce", numel=args[0].numel())
        try:
            work = original(*args, **{**kwargs, "async_op": True})
            if work is not None:
                work.wait()
        except RuntimeError as err:  # DistBackendError and the like: recorded, the host goes on
            _failures.append(f"{name}: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
        return None

    return issue
