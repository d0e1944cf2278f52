"""Load a Hugging Face checkpoint (`model.init_from`) into a rank's parallelised stages.

Every rank asks DCP for its own part of each parameter: `get_model_state_dict` gives the stage's
parameters as they are laid out (DTensors sharded over tp and, with FSDP2, dp), their names are
mapped to Hugging Face's (`SPEC.hf.to_hf`), and `dcp.load` with `HuggingFaceStorageReader`
reads only those slices from the safetensors files, whatever the layout. Parameters of other
pipeline stages are not read at all. The values are then set back into the modules.

The trainer calls it after building the stages, before any step; a run that resumes from a
rayhybrid checkpoint restores that checkpoint afterwards, over these weights.
"""

from __future__ import annotations

import logging
import time

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from rayhybrid.models.layers import tied_names

log = logging.getLogger(__name__)


def load_pretrained(trainer) -> dict:
    """Read `trainer.cfg.model.init_from` into every stage of this rank; returns a summary
    (tensors read, seconds). All ranks of the world call it together (DCP plans collectively)."""
    from rayhybrid.models.hf import init_dir

    cfg = trainer.cfg
    adapter = trainer.spec.hf
    if adapter is None:
        raise ValueError(f"model {cfg.model.name!r} has no Hugging Face adapter; it cannot load model.init_from")
    directory = init_dir(cfg.model.init_from)
    start = time.perf_counter()
    ours = []  # per stage: {our name: the Hugging Face name it is read from}, its tied tensors
    request = {}
    for _, module in trainer.stages:
        # A tied output is read once, under the embedding's name (Hugging Face drops
        # lm_head.weight from a tied model's checkpoint): on a stage with both it is the
        # embedding's own tensor; on a later pipeline stage, its copy (parallel/tied.py).
        tied = tied_names(module)
        state = get_model_state_dict(module)
        names = {name: adapter.to_hf(tied.get(name, name)) for name in state}
        for name, tensor in state.items():
            if name not in tied:
                if names[name] in request:
                    raise ValueError(f"two parameters map to Hugging Face's {names[name]}")
                request[names[name]] = tensor
        ours.append((names, {name: state[name] for name in tied if name in state}))
    for names, held in ours:  # a copy whose embedding this rank holds too is read into that
        for name, tensor in held.items():
            request.setdefault(names[name], tensor)
    group = getattr(trainer, "world_group", None)
    # What the files hold (the same on every rank: every rank makes the same number of loads).
    stored = set(HuggingFaceStorageReader(directory).read_metadata().state_dict_metadata)
    copies = {
        name: source
        for name, source in adapter.tied_fallback.items()
        if name not in stored and source in stored and not adapter.tied(cfg.model)
    }
    first = {k: v for k, v in request.items() if k not in copies}
    dcp.load(first, storage_reader=HuggingFaceStorageReader(directory), process_group=group)
    if copies:
        # A tied checkpoint trained untied: the output starts as a copy of the embedding.
        second = {copies[k]: v for k, v in request.items() if k in copies}
        dcp.load(second, storage_reader=HuggingFaceStorageReader(directory), process_group=group)
    for (_, module), (names, _) in zip(trainer.stages, ours):
        loaded = {name: request[hf_name] for name, hf_name in names.items()}
        set_model_state_dict(module, loaded, options=StateDictOptions(strict=False))
    elapsed = time.perf_counter() - start
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info("loaded %d tensors from %s in %.1f s", len(request), directory, elapsed)
    return {"tensors": len(request), "seconds": elapsed, "path": directory}
