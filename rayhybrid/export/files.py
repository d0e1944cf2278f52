"""The Hugging Face model directory an export writes: the --out check (`check_out`), the
tensors cut into safetensors files of at most --max-shard-gb (`shard_groups`, in natural name
order), and the files themselves (`write_files`: model*.safetensors, the index when there are
several, config.json, generation_config.json)."""

from __future__ import annotations

import json
import os
import re

from rayhybrid.errors import ConfigError
from rayhybrid.storage.store import redact_url

GENERATION_CONFIG = {"do_sample": False}


def check_out(out: str) -> str:
    """--out as an absolute local path, new or an empty directory; ConfigError otherwise."""
    out = os.path.abspath(os.path.expanduser(out))
    if "://" in out:
        raise ConfigError("--out", f"{out} must be a local directory")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError("--out", f"{out} exists and is not an empty directory; give a new one")
    return out


def shard_groups(names: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    """`names` in order, cut into files of at most `limit` bytes (`sizes`: each tensor's); a
    tensor larger than the limit gets a file of its own."""
    groups: list[list[str]] = [[]]
    total = 0
    for name in names:
        if groups[-1] and total + sizes[name] > limit:
            groups.append([])
            total = 0
        groups[-1].append(name)
        total += sizes[name]
    return groups


def write_files(store, path, ckpt, model, adapter, seq_len, out, groups, hf_names, ours, target, dtype, files) -> dict:
    """Load each group's tensors from the checkpoint (every shard, whichever topology wrote
    them) and write it as a safetensors file, then the index (several files), config.json and
    generation_config.json; each file's name is added to `files` as it is started, so that a
    failure can remove what was written. Returns what `export` reports."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from rayhybrid.trainer.checkpoint import reader

    weight_map, total = {}, 0
    for i, names in enumerate(groups, 1):
        state = {f"model.{n}": torch.empty(tuple(ours[n].size), dtype=ours[n].properties.dtype) for n in names}
        # Every shard of these tensors, whichever topology wrote them; no process group.
        dcp.load(state, storage_reader=reader(store, path), no_dist=True)
        tensors = {}
        for n in names:
            t = state.pop(f"model.{n}")
            tensors[hf_names[n]] = (t.to(target) if target is not None else t).contiguous()
        name = "model.safetensors" if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        files.append(name)
        save_file(tensors, os.path.join(out, name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        files.append("model.safetensors.index.json")
        _write_json(os.path.join(out, files[-1]), index)
    config = adapter.config_to_hf(model, seq_len)
    if dtype:
        for key in ("torch_dtype", "dtype"):
            if key in config:
                config[key] = dtype
    files.append("config.json")
    _write_json(os.path.join(out, files[-1]), config)
    files.append("generation_config.json")
    _write_json(os.path.join(out, files[-1]), GENERATION_CONFIG)
    return {
        "checkpoint": redact_url(ckpt.path),
        "step": ckpt.step,
        "out": out,
        "files": files,
        "tensors": len(weight_map),
        "bytes": total,
    }


def natural_key(name: str) -> list:
    """Sorts layers.2 before layers.10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
