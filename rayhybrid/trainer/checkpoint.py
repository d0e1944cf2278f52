"""Sharded, atomic, reshardable checkpoints with torch.distributed.checkpoint (DCP).

Every rank writes its own shards (DCP de-duplicates replicated tensors, so data-parallel
replicas do not write copies); rank 0 publishes the directory with one rename after every rank
has finished. State keys are the full model's parameter names (docs/design.md, invariant 5) and the
optimizer state is flattened by those names, so a checkpoint loads under any dp/pp/tp: DCP
reads each rank's slices of each tensor, whatever the saving layout was.
"""

from __future__ import annotations

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

from rayhybrid import checkpoint_store as store

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _parts(trainer) -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    return [(module, opt) for (_, module), opt in zip(trainer.stages, trainer.optimizers)]


def state_dict(trainer) -> tuple[dict, list[tuple[set, set]]]:
    """{"model": ..., "optim": ..., "extra": ...} for this rank, and each stage's keys."""
    model, optim, keys = {}, {}, []
    for module, opt in _parts(trainer):
        m = get_model_state_dict(module, options=OPTIONS)
        o = get_optimizer_state_dict(module, opt, options=OPTIONS)
        model.update(m)
        optim.update(o)
        keys.append((set(m), set(o)))
    extra = {"rng": torch.get_rng_state()}
    return {"model": model, "optim": optim, "extra": extra}, keys


def save(trainer, root: str | Path, keep: int) -> dict:
    """Write a checkpoint of the trainer's current step; returns timings (rank 0 publishes)."""
    root = Path(root)
    start = time.perf_counter()
    name = store.name_for(trainer.step)
    tmp, final = root / (store.TMP_PREFIX + name), root / name
    group = trainer.world_group
    state, _ = state_dict(trainer)
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier(group=group)
    dcp.save(state, checkpoint_id=str(tmp), process_group=group)
    dist.barrier(group=group)  # every rank's shards are on disk
    if dist.get_rank() == 0:
        store.write_meta(tmp, trainer.checkpoint_meta())
        store.publish(tmp, final)
        store.retain(root, keep)
    dist.barrier(group=group)
    return {"path": str(final), "save_s": time.perf_counter() - start}


def load(trainer, path: str | Path) -> None:
    """Restore model, optimizer and RNG from `path`, resharding to this rank's layout."""
    state, keys = state_dict(trainer)
    dcp.load(state, checkpoint_id=str(path), process_group=trainer.world_group)
    for (module, opt), (model_keys, optim_keys) in zip(_parts(trainer), keys):
        set_model_state_dict(module, {k: state["model"][k] for k in model_keys}, options=OPTIONS)
        set_optimizer_state_dict(module, opt, {k: state["optim"][k] for k in optim_keys}, options=OPTIONS)
    torch.set_rng_state(state["extra"]["rng"])
