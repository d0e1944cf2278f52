"""`export`: a committed rayhybrid checkpoint as a Hugging Face model directory. It finds the
checkpoint and its model (`source.py`), reads the names and shapes of the model's tensors from
DCP's metadata, names them for Hugging Face with the model's adapter, groups them into files and
writes them (`files.py`); a failure leaves nothing half-written behind."""

from __future__ import annotations

import contextlib
import math
import os

from rayhybrid.errors import ConfigError, RayHybridError
from rayhybrid.export.files import check_out, natural_key, shard_groups, write_files
from rayhybrid.export.source import find_checkpoint, model_of
from rayhybrid.storage.store import one_line, redact_url


def export(
    url: str, out: str, options: dict | None = None, dtype: str | None = None, max_shard_gb: float = 5.0
) -> dict:
    """Write checkpoint `url` as a Hugging Face model directory `out`; returns what it wrote."""
    import torch

    from rayhybrid.trainer.checkpoint import reader

    out = check_out(out)
    store, ckpt = find_checkpoint(url, dict(options or {}))
    model, adapter, seq_len = model_of(ckpt.meta, ckpt.path)
    path = store.relative(ckpt.path)
    try:
        metadata = reader(store, path).read_metadata()
    except Exception as err:  # noqa: BLE001 - an unreadable .metadata: not a usable checkpoint
        raise ConfigError(
            "--checkpoint", f"cannot read {redact_url(ckpt.path)}'s DCP metadata ({one_line(err)})"
        ) from None
    ours = {
        key.removeprefix("model."): md
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(md, "size")
    }
    if not ours:
        raise ConfigError("--checkpoint", f"{store.display} holds no model tensors")
    if adapter.tied(model):
        ours.pop("output.weight", None)  # the embedding's tensor; tied models drop lm_head.weight
    try:
        hf_names = {name: adapter.to_hf(name) for name in ours}
    except KeyError as err:
        raise ConfigError("--checkpoint", f"the checkpoint holds a tensor the adapter cannot name ({err})") from None
    target = getattr(torch, dtype) if dtype else None

    def nbytes(name: str) -> int:
        md = ours[name]
        return math.prod(md.size) * (target or md.properties.dtype).itemsize

    order = sorted(ours, key=lambda n: natural_key(hf_names[n]))
    groups = shard_groups(order, {n: nbytes(n) for n in order}, int(max_shard_gb * 1e9))
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    files: list[str] = []
    try:
        return write_files(
            store, path, ckpt, model, adapter, seq_len, out, groups, hf_names, ours, target, dtype, files
        )
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        for name in files:  # nothing half-written is left behind
            with contextlib.suppress(OSError):
                os.remove(os.path.join(out, name))
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(out)
        if isinstance(err, (KeyboardInterrupt, SystemExit, RayHybridError)):
            raise
        raise RayHybridError(f"export of {redact_url(ckpt.path)} failed: {one_line(err)}") from err
