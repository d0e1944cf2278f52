"""An asynchronous checkpoint upload that no failure can block: DCP's save, with its collectives
moved out of the background thread.

DCP's own `async_save` runs the whole save in a thread: a gather and scatter of the plans, the
writes, then a gather of every rank's write results to the coordinator, which writes
`.metadata`. When a rank dies meanwhile, the other ranks' upload threads block in those
collectives on peers that are blocked too (a gloo wait cannot be aborted in torch 2.13), and
what they hold (the staged DTensors and, through them, the device meshes) keeps the training
process groups open, so ranks blocked on them in a training collective are never woken. A
killed upload then cost the whole drain timeout (30 s) and the survivors that did not leave in
time were replaced (issue 28).

Here the same steps are split so that only local work is left for the thread:

    planned = plan(state, writer, group)     # main thread, while the save blocks: the plans
                                             #   exchanged on `group`; a CPU copy of what this
                                             #   rank writes (no DTensor, mesh or group in it)
    upload(planned, ...)                     # background thread: write this rank's files and
                                             #   its write results (`__results_<rank>.pkl`);
                                             #   rank 0 waits for every rank's results in the
                                             #   store, writes `.metadata` and returns

The thread does no collective and refers to nothing of the trainer, so a rank that leaves its
process groups closes their connections at once. Rank 0 gives up waiting when the save is
abandoned (`Abandon.set`: the world it was written in failed), so a save with a dead rank is
never committed. The files written are DCP's own layout: `load` reads them as before.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from rayhybrid.storage.store import Store

RESULTS = "__results_{rank}.pkl"
"""Each rank's write results, beside its data; rank 0 removes them once `.metadata` is written."""
POLL_S = (0.05, 1.0)
"""Rank 0 lists the checkpoint's directory this often while it waits for the others (first,
most: the wait doubles)."""
DELAY_ENV = "RAYHYBRID_TEST_UPLOAD_DELAY_S"
"""A slow store, for tests (tests/test_fencing.py): each rank's upload thread waits this many
seconds before it writes. Unset everywhere else."""


class Abandoned(RuntimeError):
    """The save's world failed before every rank's data was in the store."""


class Abandon:
    """Shared by a rank's saves and its upload thread: set when the save must never commit.
    `commit_unless_set` runs the commit under the same lock, so a save is either committed
    before the flag is set or never."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()

    def set(self) -> None:
        with self._lock:
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        return self._event.wait(seconds)

    def commit_unless_set(self, commit) -> bool:
        with self._lock:
            if self._event.is_set():
                return False
            commit()
            return True


@dataclass
class Planned:
    """A save planned on every rank: this rank's final plan, the CPU copy of what it writes,
    and (rank 0) the global metadata that `.metadata` will hold."""

    plan: SavePlan
    staged: dict[MetadataIndex, object]
    metadata: Metadata | None
    rank: int
    world_size: int


def plan(state: dict, writer, group) -> Planned:
    """DCP's save planning (as `torch.distributed.checkpoint.save` does it: local plans,
    the coordinator's global plan with replicated tensors written once, each rank's final
    plan) on `group`, a CPU group, in the calling thread; then a CPU copy of every object this
    rank's plan writes."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans = [None] * world_size if rank == 0 else None
    dist.gather_object(local, plans, group=group, group_dst=0)
    metadata = None
    if rank == 0:
        plans, metadata = planner.create_global_plan(plans)
        plans = writer.prepare_global_plan(plans)
    mine = [None]
    dist.scatter_object_list(mine, plans, group=group, group_src=0)
    final = planner.finish_plan(mine[0])
    staged = {item.index: _copy(planner.resolve_data(item)) for item in final.items}
    return Planned(final, staged, metadata, rank, world_size)


def _copy(data):
    """What the writer will write, copied off the live state: a tensor to CPU memory (a plain
    tensor: DTensor's `resolve_data` gives the local shard), serialized bytes as they are."""
    if isinstance(data, torch.Tensor):
        return data.detach().to("cpu", copy=True)
    return data


class _Staged:
    """The planner the writer sees in the thread: it resolves each item to its staged copy."""

    def __init__(self, staged: dict[MetadataIndex, object]) -> None:
        self.staged = staged

    def resolve_data(self, item: WriteItem):
        data = self.staged[item.index]
        return io.BytesIO(data.getvalue()) if isinstance(data, io.BytesIO) else data


def upload(planned: Planned, writer, store: Store, path: str, abandon: Abandon) -> None:
    """In the upload thread: write this rank's data and its write results; on rank 0, wait for
    every rank's results, then write `.metadata`. Raises `Abandoned` (rank 0) when the save
    is abandoned first."""
    time.sleep(float(os.environ.get(DELAY_ENV) or 0))
    written = writer.write_data(planned.plan, _Staged(planned.staged))
    written.wait()
    results = written.value()
    planned.staged.clear()  # the copy's memory goes back as soon as it is written
    store.write_bytes(f"{path}/{RESULTS.format(rank=planned.rank)}", pickle.dumps(results))
    if planned.rank != 0:
        return
    everyone = gather_results(store, path, planned.world_size, abandon)
    writer.finish(metadata=planned.metadata, results=everyone)
    for rank in range(planned.world_size):
        store.fs.rm_file(f"{path}/{RESULTS.format(rank=rank)}")


def gather_results(store: Store, path: str, world_size: int, abandon: Abandon) -> list:
    """Every rank's write results, in rank order, read from the store once all are there."""
    names = {RESULTS.format(rank=rank): rank for rank in range(world_size)}
    found: dict[int, list] = {}
    delay = POLL_S[0]
    while len(found) < world_size:
        if abandon.is_set():
            raise Abandoned(path)
        store.fresh()
        for entry in store.fs.ls(path, detail=False):
            rank = names.get(entry.rstrip("/").rsplit("/", 1)[-1])
            if rank is not None and rank not in found:
                found[rank] = pickle.loads(store.read_bytes(f"{path}/{RESULTS.format(rank=rank)}"))
        if len(found) < world_size:
            abandon.wait(delay)
            delay = min(POLL_S[1], 2 * delay)
    return [found[rank] for rank in range(world_size)]
