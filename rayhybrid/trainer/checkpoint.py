"""Sharded, reshardable checkpoints with torch.distributed.checkpoint (DCP), on any store.

Every rank writes its own shards (DCP de-duplicates replicated tensors, so data-parallel
replicas do not write copies) straight into `step_<N>/` of the store (a local path, a shared
mount, or an fsspec URL such as s3://). DCP's coordinator writes `.metadata` once every rank's
data is complete; rank 0 then writes the commit marker (checkpoint_store.py). State keys are the
full model's parameter names (docs/design.md, invariant 5) and the optimizer state is flattened
by those names, so a checkpoint loads under any dp/pp/tp: DCP reads each rank's slices of each
tensor, whatever the saving layout was.

Saves are asynchronous by default (`checkpoint.async_save`): a save blocks training only while
the ranks exchange DCP's plans (on a gloo group of their own: NCCL jobs need a CPU group for
object collectives) and copy the state to CPU memory; the upload then runs in a thread that
does no collective (upload.py), and rank 0 writes DCP's `.metadata` and the marker once every
rank's data is in the store. The next save waits for the previous one. A save that fails or is
interrupted is never committed, so the previous checkpoint stays the latest, and a rank's
failure never blocks the others' upload threads or their leaving the process groups.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rayhybrid.errors import TESTED_TORCH, ConfigError
from rayhybrid.models.layers import tied_names
from rayhybrid.storage import checkpoints as checkpoint_store
from rayhybrid.storage.store import Store, one_line, open_store
from rayhybrid.trainer import upload
from rayhybrid.trainer.fence import Fence
from rayhybrid.trainer.results import RestoreResult, SaveResult

log = logging.getLogger(__name__)

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def trainer_meta(trainer) -> dict:
    """The trainer's state that travels with a checkpoint, as JSON (committed beside its data)."""
    cfg, t, val_loss = trainer.cfg, trainer.cfg.topology, trainer.evaluation.val_loss
    return {
        "version": 1,
        "step": trainer.step,
        # The whole model config, so a checkpoint alone says what it holds (export needs it).
        "model": dataclasses.asdict(cfg.model),
        "seq_len": cfg.data.seq_len,
        "consumed_samples": trainer.consumed_samples,
        # What sample i is (with the seed and seq_len): a resume must read the same stream.
        "data": trainer.stream.identity(),
        # The held-out loss of this very step, when it was evaluated (checkpoint.keep_best).
        **({"val_loss": val_loss[1]} if val_loss and val_loss[0] == trainer.step else {}),
        "global_batch_size": cfg.train.global_batch_size,
        "seed": cfg.seed,
        "topology": {"dp": t.dp, "pp": t.pp, "tp": t.tp, "schedule": t.schedule, "dp_shard": t.dp_shard},
    }


def restore(trainer, path: str, meta: dict) -> None:
    """Load the checkpoint at `path` (its committed `meta`) into `trainer`'s stages, optimizers
    and RNG, whatever topology wrote it. Whether it fits this run (model, global batch, data)
    was asked once, by the driver before any worker started
    (`rayhybrid.driver.compatibility.check_fits`). The trainer's step counters are the caller's
    to set."""
    load(trainer, path, trainer.cfg.checkpoint.storage_options)


def _parts(trainer) -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    return [(module, opt) for (_, module), opt in zip(trainer.stages, trainer.optimizers)]


def state_dict(trainer) -> tuple[dict, list[dict[str, str]]]:
    """{"model": ..., "optim": ..., "extra": ...} for this rank, and for each stage {its key:
    the key the checkpoint stores it under}. A tied parameter is stored once, under the name of
    the one it is tied to: the output of a one-stage tied model is the embedding's own tensor,
    and a later stage's copy of the embedding (rayhybrid/parallel/tied.py) equals it."""
    model, optim, keys = {}, {}, []
    for module, opt in _parts(trainer):
        tied = tied_names(module)
        stored = {}
        for key, value in get_model_state_dict(module, options=OPTIONS).items():
            stored[key] = tied.get(key, key)
            model.setdefault(stored[key], value)
        for key, value in get_optimizer_state_dict(module, opt, options=OPTIONS).items():
            stored[key] = _optim_key(key, tied)
            optim.setdefault(stored[key], value)
        keys.append(stored)
    extra = {"rng": torch.get_rng_state()}
    return {"model": model, "optim": optim, "extra": extra}, keys


def _optim_key(key: str, tied: dict[str, str]) -> str:
    """A flattened optimizer key (state.<name>.exp_avg, param_groups.<name>.lr) under the tied
    parameter's stored name."""
    kind, _, rest = key.partition(".")
    for name, source in tied.items():
        if rest.startswith(name + "."):
            return f"{kind}.{source}{rest[len(name) :]}"
    return key


def writer(store: Store, path: str, die_after_write: bool = False):
    """DCP's writer for `path` of `store`, configured with the store's options. Never handed a
    `checkpoint_id` as well: DCP would rebuild the filesystem from it and drop the options.
    `die_after_write`: the rank SIGKILLs itself once its own data is written (fault.inject's
    kill_save: a save killed mid-upload)."""
    if store.local:
        cls, args = dcp.FileSystemWriter, {}
    else:
        cls, args = _fsspec_io()[1], store.options
    if die_after_write:
        cls = type("DieAfterWrite", (_DieAfterWrite, cls), {})
    return cls(store.url_of(path), **args)


def reader(store: Store, path: str):
    if store.local:
        return dcp.FileSystemReader(path)
    return _fsspec_io()[0](store.url_of(store.relative(path)), **store.options)


def _fsspec_io() -> tuple[type, type]:
    """DCP's reader and writer for fsspec stores (torch's private `_fsspec_filesystem`): in a
    torch where they moved, a checkpoint.dir on a store is refused in one line (a local path or
    a shared mount still works), and nothing else is lost."""
    try:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    except ImportError as err:
        raise ConfigError(
            "checkpoint.dir",
            f"this torch cannot write checkpoints to a store ({one_line(err)}); give a local path or a shared "
            f"mount, or use {TESTED_TORCH}",
        ) from None
    return FsspecReader, FsspecWriter


class _DieAfterWrite:
    def write_data(self, plan, planner):
        from rayhybrid import faults as fault

        written = super().write_data(plan, planner)
        written.wait()
        fault.trigger("kill_save", -1)
        return written


@contextlib.contextmanager
def _as_exception():
    """DCP's CheckpointException is a BaseException: raise it as an ordinary error, so that the
    worker's failure handling (which leaves the process group) sees it."""
    try:
        yield
    except Exception:
        raise
    except BaseException as err:
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise RuntimeError(one_line(err)) from err


class Checkpoints:
    """One rank's checkpoints, owned by its `Trainer`: saving the trainer's state into a store
    (through a `Saver`, made again when the root or the retention changes), the asynchronous
    saves that ended since they were last asked for, and restoring a checkpoint.

        checkpoints.save(root, keep)   # -> SaveResult; pending while an async upload runs
        checkpoints.finished()         # -> the saves that ended (committed, or with `error`)
        checkpoints.load(path, meta)   # -> RestoreResult; the trainer at the step restored
        checkpoints.close()            # abandon a save in flight (a failed or rebuilt world)
    """

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.cfg = trainer.cfg.checkpoint
        # Asynchronous saves exchange their plans on a CPU group of their own (NCCL cannot carry
        # Python objects); their upload threads do no collective (trainer/upload.py). Made as the
        # trainer is built, so every rank creates its process groups in the same order.
        async_saves = self.cfg.async_save and self.cfg.every > 0
        self.upload_group = dist.new_group(backend="gloo") if async_saves else None
        self.saver: Saver | None = None
        # The run's generation this rank joined: its checkpoints go to that generation's
        # directories, and rank 0 commits only while it is current (trainer/fence.py).
        self.fence = Fence(trainer.generation or 0, exits=trainer.generation is not None)

    def save(self, root: str, keep: int, die_after_write: bool = False) -> SaveResult:
        """Save the trainer's current step under `root` (a path or URL); with any earlier
        asynchronous save that ended meanwhile in `finished` (see `Saver`)."""
        ck = self.cfg
        if self.saver is None or self.saver.root != root or self.saver.keep != keep:
            self.close()
            self.saver = Saver(
                self.trainer, root, ck.storage_options, keep, ck.async_save, ck.keep_best, self.upload_group, self.fence
            )
        return self.saver.save(trainer_meta(self.trainer), die_after_write)

    def finished(self, wait: bool = False) -> list[SaveResult]:
        """Asynchronous saves that ended (committed or failed) since the last call; `wait`:
        wait for the one in flight first."""
        if self.saver is None:
            return []
        return self.saver.wait() if wait else self.saver.poll()

    def close(self) -> None:
        """Abandon a save in flight (it is never committed); before the process group goes."""
        if self.saver is not None:
            self.saver.close()
            self.saver = None

    def load(self, path: str, meta: dict) -> RestoreResult:
        """Restore the checkpoint at `path` (its committed `meta`), written under any topology,
        into the trainer, and set the trainer's position to its step (the LR schedule follows)."""
        trainer, start = self.trainer, time.perf_counter()
        trainer.settled = False
        restore(trainer, path, meta)
        trainer.step, trainer.consumed_samples = int(meta["step"]), int(meta["consumed_samples"])
        trainer.settled = True
        return RestoreResult(trainer.step, trainer.consumed_samples, time.perf_counter() - start)


class Saver:
    """This rank's side of saving checkpoints into one store (one per trainer and root).

    save(meta) -> a SaveResult (`pending` while async); blocks only for staging when async
    poll()     -> saves finished since the last call: SaveResults with `upload_s`, or with
                  `error`; committed by rank 0 before they are reported
    wait()     -> the same, after waiting for the save in flight
    close()    -> abandon a save in flight: it is never committed (a failed or rebuilt world)
    """

    def __init__(
        self,
        trainer,
        root: str,
        options: dict | None,
        keep: int,
        async_save: bool,
        keep_best: bool = False,
        upload_group: dist.ProcessGroup | None = None,
        fence: Fence | None = None,
    ) -> None:
        self.trainer = trainer
        self.fence = fence or Fence()  # the generation whose directories it writes, checked before a commit
        self.root = root
        self.store = open_store(root, options, setting="checkpoint.dir")
        self.keep = keep
        self.keep_best = keep_best  # checkpoint.keep_best: retention spares the lowest val_loss
        self.rank = dist.get_rank()
        self.group = trainer.world_group
        self.upload_group = upload_group if async_save else None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-upload") if async_save else None
        self._inflight: concurrent.futures.Future | None = None
        self._abandon = upload.Abandon()

    @property
    def asynchronous(self) -> bool:
        return self._pool is not None

    def save(self, meta: dict, die_after_write: bool = False) -> SaveResult:
        """Save the trainer's current step, whose `meta` (`trainer_meta`) is committed with it."""
        trainer, store = self.trainer, self.store
        start = time.perf_counter()
        finished = self.wait()  # the next save waits for the previous one
        waited_s = time.perf_counter() - start
        step, generation = trainer.step, self.fence.generation
        meta = {**meta, "generation": generation}
        if self.rank == 0:
            path = checkpoint_store.begin(store, step, generation)
        else:
            path = store.join(checkpoint_store.name_for(step, generation))
        dist.barrier(group=self.group)  # nothing left of an earlier save of this step
        state, _ = state_dict(trainer)
        out = writer(store, path, die_after_write)
        record = SaveResult(step, store.url_of(path), self.asynchronous, waited_s)
        if not self.asynchronous:
            written = time.perf_counter()
            with _as_exception():
                dcp.save(state, storage_writer=out, process_group=self.group)  # every rank's data and .metadata
            if self.rank == 0:
                self.fence.check(store, f"step {step}")
                checkpoint_store.commit(store, path, meta)
                checkpoint_store.retain(store, self.keep, self.keep_best, generation)
            end = time.perf_counter()
            return dataclasses.replace(record, blocked_s=end - start, upload_s=end - written, finished=tuple(finished))
        planned = upload.plan(state, out, self.upload_group)  # the plans exchanged; a CPU copy of the data
        del state
        staged = time.perf_counter()
        record = dataclasses.replace(record, blocked_s=staged - start)
        # A module-level function holding nothing of the trainer: see rayhybrid/trainer/upload.py.
        self._inflight = self._pool.submit(
            _finish,
            planned,
            out,
            self.store,
            path,
            meta,
            record,
            staged,
            self._abandon,
            (self.keep, self.keep_best),
            self.fence,
        )
        return dataclasses.replace(record, finished=tuple(finished))

    def poll(self) -> list[SaveResult]:
        if self._inflight is None or not self._inflight.done():
            return []
        done, self._inflight = self._inflight.result(), None
        return [done]

    def wait(self) -> list[SaveResult]:
        if self._inflight is not None:
            concurrent.futures.wait([self._inflight])
        return self.poll()

    def close(self) -> None:
        """Abandon the save in flight without waiting for it: it is never committed, and its
        thread ends on its own (its writes are local; rank 0 stops waiting for the others)."""
        self._abandon.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def _finish(
    planned: upload.Planned,
    out,
    store: Store,
    path: str,
    meta: dict,
    record: SaveResult,
    staged: float,
    abandon: upload.Abandon,
    retention: tuple[int, bool],
    fence: Fence,
) -> SaveResult:
    """In the upload thread: write this rank's data; rank 0 then commits once every rank's data
    and DCP's .metadata are in the store, unless the save was abandoned meanwhile or the run
    moved on to a newer generation (`fence`: this rank is a zombie; a worker exits there).
    `retention`: checkpoint.keep and keep_best."""
    abandoned = dataclasses.replace(record, error="abandoned: the process group it was written by failed")
    try:
        upload.upload(planned, out, store, path, abandon)
    except upload.Abandoned:
        return abandoned
    except BaseException as err:  # noqa: BLE001 - a failed write or an abandoned save is reported, never raised
        return dataclasses.replace(record, error=one_line(err))

    def commit() -> None:
        fence.check(store, f"step {record.step}")
        checkpoint_store.commit(store, path, meta)
        checkpoint_store.retain(store, *retention, fence.generation)

    if planned.rank == 0:
        try:
            if not abandon.commit_unless_set(commit):
                return abandoned
        except Exception as err:  # noqa: BLE001 - reported to the driver, never committed
            return dataclasses.replace(record, error=one_line(err))
    elif abandon.is_set():
        return abandoned
    return dataclasses.replace(record, upload_s=time.perf_counter() - staged)


def load(trainer, path: str | Path, options: dict | None = None) -> None:
    """Restore model, optimizer and RNG from the checkpoint at `path` (a path or URL),
    resharding to this rank's layout."""
    path = str(path)
    store = open_store(path, options, setting="checkpoint.dir")
    state, keys = state_dict(trainer)
    with _as_exception():
        dcp.load(state, storage_reader=reader(store, store.root), process_group=trainer.world_group)
    apply(trainer, state, keys)


def apply(trainer, state: dict, keys: list[dict[str, str]]) -> None:
    """Set the stages, optimizers and RNG from `state` (as `state_dict` made it, filled in)."""
    for (module, opt), stored in zip(_parts(trainer), keys):
        model = {k: state["model"][v] for k, v in stored.items() if v in state["model"]}
        optim = {k: state["optim"][v] for k, v in stored.items() if v in state["optim"]}
        set_model_state_dict(module, model, options=OPTIONS)
        set_optimizer_state_dict(module, opt, optim, options=OPTIONS)
    torch.set_rng_state(state["extra"]["rng"])
