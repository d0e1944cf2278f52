"""The worker actor: one per rank. It owns its device, joins the process group and runs
`Trainer` steps on request. Ray code stays here; the training code never sees Ray."""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from rayhybrid import faults as fault
from rayhybrid.cluster.guard import guarded
from rayhybrid.cluster.healer import Healer
from rayhybrid.config.schema import Config
from rayhybrid.config.topology import Layout
from rayhybrid.trainer import startup

if TYPE_CHECKING:
    from rayhybrid.trainer.results import HealResult, HeldState, RestoreResult, SaveResult, StepResult


@dataclass(frozen=True)
class WorkerInfo:
    rank: int
    node_id: str
    ip: str
    pid: int
    gpu_ids: tuple[str, ...]


ADOPTED_GPUS = "RAYHYBRID_GPU_IDS"
"""Set in a warm standby that took a rank's place: the GPU ids of that rank (cluster/standby.py)."""


def own_gpus() -> tuple[str, ...]:
    """The GPU ids Ray gave the calling worker (none on CPU), or a standby took over (ADOPTED_GPUS)."""
    if ADOPTED_GPUS in os.environ:
        return tuple(g for g in os.environ[ADOPTED_GPUS].split(",") if g)
    return tuple(str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", []))


def import_trainer() -> None:
    """Import the trainer once, with the collector off: the imports make ~300,000 long-lived
    objects, and each full collection they would trigger walks them all (~0.2 s of CPU each, a
    quarter of the imports' time); once made, they are frozen out of every later collection.
    torch._dynamo too: torch imports it on the first DTensor made, or the first parameter
    initialised on the meta device (`torch._disable_dynamo`), so every trainer build did, after
    the freeze, and every collection since (a failed rank's `reset`, on the recovery's critical
    path) walked its ~40,000 objects."""
    if "rayhybrid.trainer.loop" in sys.modules:
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        import torch._dynamo  # noqa: F401

        import rayhybrid.trainer.loop  # noqa: F401
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def drop_trainer(trainer, healer: Healer | None, rank: int, failed: bool) -> None:
    """What a worker does before it lets go of its trainer. After a `failed` call: on NCCL abort
    its communicators (rayhybrid/parallel/abort.py), so that nothing, the copy of its state to
    the host included, waits behind a collective hung on a dead peer; then, with fault.heal and
    a `healer`, keep its state there when it is a whole step's (`Trainer.settled`). A clean
    leave (a rejoin, a resize, the end) aborts nothing: its healthy groups are destroyed as
    usual. Either way abandon a save in flight, stop the stream's read-ahead thread and free its
    batches on the device."""
    from rayhybrid.parallel.abort import abort_collectives

    if failed:
        abort_collectives()
        if healer is not None and trainer.heal and trainer.settled:
            healer.keep(trainer, rank)
    trainer.close_checkpoints()
    trainer.feed.close()


def quiet_torch() -> None:
    """Silence torch's per-step warnings in this process: DTensor's that a 2-D norm reduction
    takes two all-reduces, and FSDP2/replicate's that a stage's output is a view (nothing here
    modifies it in place)."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


CONTROL = "control"  # the concurrency group that answers while a step is blocked


class TrainWorker:
    """Constructed by `WorkerGroup` through `ray.remote(...).options(...)` inside a replica's
    placement group bundle (bundle index = pipeline stage).

    A worker outlives its process group: when a call fails (a peer died, a collective broke),
    it drops its `Trainer` and destroys the process group before reporting, which closes its
    connections and so wakes the peers still waiting on it. The group can then join it again
    (`setup`) with replacements for the workers that died, instead of starting every process
    anew. `ping` runs in its own thread, so a worker blocked in a collective still answers and
    a stopped or wedged one can be told apart."""

    def __init__(self, cfg: Config, rank: int, world_size: int) -> None:
        startup.begin()  # the process is up: its first join's phases (`setup` reports them)
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.trainer = None
        self.healer = Healer()  # fault.heal: the state kept across a failure, and the heal
        self.store = None  # the rendezvous this worker serves as rank 0 (`host_store`)
        os.environ.setdefault("OMP_NUM_THREADS", str(cfg.cluster.torch_threads))
        quiet_torch()

    def info(self) -> WorkerInfo:
        """Where this worker runs. The first call also imports the trainer (`warm_up`)."""
        self.warm_up()
        return WorkerInfo(
            rank=self.rank,
            node_id=ray.get_runtime_context().get_node_id(),
            ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            gpu_ids=own_gpus(),
        )

    def warm_up(self) -> None:
        """Import the trainer, so that the ranks reach the rendezvous of `setup` together (a new
        worker would be seconds behind)."""
        import_trainer()
        startup.mark("imports")

    def placement(self, visible_gpus: tuple[str, ...] = ()) -> dict:
        """Where this rank runs, the GPUs Ray gave it, and the device, CUDA_VISIBLE_DEVICES and
        backend that `setup` would choose with `visible_gpus` (`choose_device`, as `_join`
        does). Neither touches CUDA nor imports torch: the placement can be checked on a
        cluster whose GPUs are only declared."""
        from rayhybrid.parallel.mesh import choose_device

        choice = choose_device(own_gpus(), visible_gpus)
        torch = sys.modules.get("torch")
        return {
            "rank": self.rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "gpu_ids": list(own_gpus()),
            "device": str(choice),
            "cuda_visible_devices": choice.cuda_visible_devices,
            "backend": choice.backend,
            "cuda_initialized": torch is not None and torch.cuda.is_initialized(),
        }

    @ray.method(concurrency_group=CONTROL)
    def ping(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group=CONTROL)
    def abort_collectives(self) -> bool:
        """After a failed call (the drain): abandon the save in flight, so a main thread waiting
        on its upload (rank 0 gathering a dead rank's results) returns at once, and on NCCL
        abort the communicators, so a collective blocked on a dead peer raises within seconds."""
        from rayhybrid.parallel.abort import abort_collectives

        if (trainer := self.trainer) is not None:
            trainer.close_checkpoints()
        return abort_collectives()

    @ray.method(concurrency_group=CONTROL)
    def host_store(self, world_size: int) -> int:
        """Serve the rendezvous of the next join (a TCPStore on a free port, as rank 0); returns
        its port. It lives apart from the process groups, so the driver can close it
        (`close_store`) when a rank is lost while the others wait in the rendezvous for it:
        their waits then fail at once instead of after JOIN_TIMEOUT_S."""
        from rayhybrid.parallel.mesh import host_store

        self.store = None
        self.store = host_store(ray.util.get_node_ip_address(), world_size)
        return self.store.port

    @ray.method(concurrency_group=CONTROL)
    def close_store(self) -> None:
        """Stop serving the rendezvous (its server stops with the object): every rank still
        waiting in it fails at once."""
        self.store = None

    def setup(
        self,
        master_addr: str,
        master_port: int,
        visible_gpus: tuple[str, ...] = (),
        rank: int | None = None,
        cfg: Config | None = None,
        generation: int = 0,
    ) -> dict:
        """Join the process group and build this rank's part of the model; again after a
        failure or a resize, when `rank` and `cfg` (its topology) may change.

        `visible_gpus`: every GPU the ranks on this node hold; each worker sees all of them
        (so NCCL can use peer-to-peer links) and picks its own by position. `generation`: the
        run's, which fences off the checkpoint writes of this rank once it is stale (trainer/fence.py).
        """
        self.reset()  # what a failure kept stays kept until the driver says what to do
        if cfg is not None:
            self.cfg, self.world_size = cfg, Layout.of(cfg).world_size
        if rank is not None:
            self.rank = rank
        return self._guarded(self._join, master_addr, master_port, visible_gpus, generation)

    def _join(self, master_addr: str, master_port: int, visible_gpus: tuple[str, ...], generation: int) -> dict:
        import torch

        from rayhybrid.faults import async_collectives
        from rayhybrid.parallel.mesh import (
            COLLECTIVE_TIMEOUT_S,
            JOIN_TIMEOUT_S,
            choose_device,
            host_store,
            init_process_group,
            joining,
        )
        from rayhybrid.trainer.loop import Trainer

        torch.set_num_threads(self.cfg.cluster.torch_threads)
        # What the imports made lives as long as the process: keep it out of the collections
        # that `reset` runs, which then take milliseconds instead of most of a second.
        gc.collect()
        gc.freeze()
        choice = choose_device(self.info().gpu_ids, visible_gpus)
        device = choice.device
        if choice.cuda_visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = choice.cuda_visible_devices
            torch.cuda.set_device(device)
        if self.rank == 0 and (self.store is None or self.store.port != master_port):
            # Nobody serves this rendezvous yet (a worker driven without the driver): rank 0 does.
            self.store = host_store(master_addr, self.world_size, master_port)
        # A short timeout while the groups form: a rank that dies meanwhile leaves the others
        # blocked in a rendezvous, until the driver closes its store (rayhybrid/cluster/drain.py).
        with joining(COLLECTIVE_TIMEOUT_S):
            init_process_group(
                rank=self.rank,
                world_size=self.world_size,
                master_addr=master_addr,
                master_port=master_port,
                device=device,
                timeout_s=JOIN_TIMEOUT_S,
                hosted=True,
            )
            if self.cfg.fault.nccl_like:  # a test mode: gloo's collectives fail as NCCL's do
                async_collectives.install()
            self.trainer = Trainer(self.cfg, rank=self.rank, device=device, generation=generation)
        return {**self.trainer.describe(), "startup": startup.reading()}

    def save(self, root: str, keep: int, inject: str | None = None) -> SaveResult:
        """Write a checkpoint (in the background when checkpoint.async_save); `inject`: a
        fault kind that fires in a save (kill_save): this rank dies once its own data is written."""
        if inject is not None and not fault.fires_at(inject, "save"):
            raise ValueError(f"fault {inject!r} does not fire in a save")
        return self._guarded(self.trainer.save_checkpoint, root, keep, inject is not None)

    def finished_saves(self, wait: bool = True) -> list[SaveResult]:
        """Asynchronous saves finished since the last report; `wait`: for the one in flight."""
        return self._guarded(self.trainer.finished_checkpoints, wait)

    def load(self, path: str, meta: dict) -> RestoreResult:
        self.healer.forget()  # the run goes back to the checkpoint
        return self._guarded(self.trainer.load_checkpoint, path, meta)

    def held(self) -> HeldState | None:
        """fault.heal: the step this worker kept across the failure, if its shards are the ones
        its new trainer holds, and whether it has that step's results (`recorded`); None when it
        kept nothing usable (`Healer.held`)."""
        return self.healer.held(self.trainer)

    def heal(self, src: int | None, receivers: list[int]) -> HealResult:
        """Take the state the run heals to: the kept one (`src` None), sent on to `receivers`,
        or rank `src`'s over the network (`Healer.heal`)."""
        # The trainer is looked up inside the call: on failure, `reset` must find it held by
        # nothing else, or its process groups (and their connections) stay open.
        return self._guarded(lambda: self.healer.heal(self.trainer, src, receivers))

    def trace(self, step: int, ranges: list[list[int]]) -> list[dict]:
        """data.trace: the rows of the samples in `ranges` ([start, count]) read in step `step`
        (`Healer.trace`), for a replica lost with its step."""
        return self.healer.trace(self.trainer, step, ranges)

    def train(self, steps: int = 1, inject: str | None = None) -> list[StepResult]:
        """Train `steps` steps, each followed by the held-out loss when eval.every says so;
        `inject`: a `fault.inject` kind to trigger where it fires: first (kill, hang, raise) or at
        the start of an evaluation (kill_eval)."""
        if fault.fires_at(inject, "eval"):
            return self._guarded(lambda: [self._step(inject) for _ in range(steps)])
        return self._guarded(self._injected(inject, lambda: [self._step() for _ in range(steps)]))

    def _step(self, eval_fault: str | None = None) -> StepResult:
        result = self.trainer.train_step()  # also the trainer's last_result, whose metrics the evaluation's add to
        metrics = result.metrics
        if self.cfg.eval.due(metrics["step"], self.cfg.train.steps):
            if eval_fault is not None:
                fault.trigger(eval_fault, metrics["step"])
            start = time.perf_counter()
            metrics["val_loss"] = self.trainer.evaluate()
            metrics["eval_s"] = time.perf_counter() - start
        return result

    def _injected(self, kind: str | None, fn):
        """`fn`, preceded by the injected fault `kind` (if any) in this process."""
        if kind is None:
            return fn

        def run(*args):
            fault.trigger(kind, self.trainer.step + 1)  # the step this call trains
            return fn(*args)

        return run

    def _guarded(self, fn, *args):
        """Run `fn`; on failure leave the process group (`reset`, failed) and raise `RankFailed` (`guard.guarded`)."""
        return guarded(lambda: self.reset(failed=True), self.rank, fn, *args)

    def reset(self, failed: bool = False) -> None:
        """Drop the trainer (`drop_trainer`; `failed`: after a failed call, abort its
        communicators and keep its state, with fault.heal, when it is a whole step's) and the
        process groups (`leave_world`); idempotent. A group's connections close only when
        nothing refers to it any more, hence the collections."""
        import torch

        from rayhybrid.faults import async_collectives
        from rayhybrid.parallel.mesh import leave_world

        if self.trainer is not None:
            drop_trainer(self.trainer, self.healer, self.rank, failed)
        self.trainer = None
        async_collectives.uninstall()  # fault.nccl_like's test mode, until the next join
        leave_world()
        gc.collect()
        if torch.cuda.is_initialized():  # after an out-of-memory error: hand the cached memory back
            torch.cuda.empty_cache()

    def close(self) -> None:
        self.healer.forget()
        self.store = None
        self.reset()
