"""`python -m rayhybrid.export --checkpoint <step dir or checkpoint.dir> --out <dir>`: a rayhybrid
checkpoint as a Hugging Face model directory (config.json, model.safetensors,
generation_config.json) that `AutoModelForCausalLM.from_pretrained(<dir>)` loads.

--checkpoint        a committed checkpoint: its step directory (.../step_00000020), or a
                    checkpoint.dir, whose latest committed checkpoint is taken; a path or any
                    fsspec URL (s3://bucket/run/checkpoints/step_00000020)
--out               a local directory, new or empty
--storage-option K=V  an option of the store's fsspec filesystem (repeatable; e.g.
                    endpoint_url=http://...); credentials are better left to the store's own
                    environment variables and files
--dtype             float32 (default: as trained, rayhybrid keeps float32 weights) or bfloat16
--max-shard-gb      largest safetensors file, in GB (default 5); a larger model is written as
                    model-0000i-of-0000n.safetensors with model.safetensors.index.json

Only the model's weights are written (no optimizer state), from any topology: the checkpoint's
shards are read without a process group, one output file's tensors at a time. The model and
sequence length come from the checkpoint's meta.json; the model must have a Hugging Face adapter
(llama3 has; gpt has not).

Exit codes: 0 done, 1 failed, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys

from rayhybrid.errors import ConfigError, RayHybridError
from rayhybrid.storage.store import one_line, redact_url

GENERATION_CONFIG = {"do_sample": False}
DTYPES = ("float32", "bfloat16")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, as the other CLIs
        raise ConfigError("arguments", message)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="python -m rayhybrid.export", add_help=False)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--storage-option", action="append", default=[])
    parser.add_argument("--dtype", choices=DTYPES, default=None)
    parser.add_argument("--max-shard-gb", type=float, default=5.0)
    return parser.parse_args(argv)


def _options(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError("--storage-option", f"expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def find_checkpoint(url: str, options: dict):
    """The committed checkpoint at `url` (a step directory), or the latest one under it (a
    checkpoint.dir); ConfigError saying why there is none."""
    from rayhybrid.storage import checkpoints as checkpoint_store
    from rayhybrid.storage.store import Store

    shown = redact_url(url)
    try:
        store = Store.open(url, options)
    except ValueError as err:
        raise ConfigError("--checkpoint", f"{shown}: {err}") from None
    try:
        exists = store.fs.exists(store.root)
        is_step = checkpoint_store.step_of(store.root) is not None or store.fs.exists(
            f"{store.root}/{checkpoint_store.META}"
        )
    except Exception as err:  # noqa: BLE001 - any client error: the store cannot be read
        raise ConfigError("--checkpoint", f"cannot read {shown} ({one_line(err)})") from None
    if not exists:
        raise ConfigError("--checkpoint", f"{shown} does not exist")
    if is_step:
        try:
            return store, checkpoint_store.check(store, store.root)
        except ValueError as err:
            raise ConfigError("--checkpoint", f"{shown} is not a usable checkpoint: {err}") from None
    ckpt = checkpoint_store.latest(store)
    if ckpt is None:
        raise ConfigError(
            "--checkpoint", f"{shown} holds no committed checkpoint (give a step_<N> directory or a checkpoint.dir)"
        )
    return store, ckpt


def model_of(meta: dict, path: str):
    """(ModelConfig, its adapter, seq_len) from a checkpoint's meta.json."""
    from rayhybrid.models.registry import get_spec, model_from_record

    recorded = meta.get("model")
    if not isinstance(recorded, dict):
        raise ConfigError(
            "--checkpoint",
            f"{redact_url(path)}'s meta.json records no model (written by an older rayhybrid); "
            "save a checkpoint with this version first",
        )
    model = model_from_record(recorded)  # a family's settings an older rayhybrid kept flat too
    spec = get_spec(model)
    if spec.hf is None:
        chosen = f"model.module={model.module}" if model.module else f"model.name={model.name}"
        raise ConfigError("--checkpoint", f"{chosen} has no Hugging Face adapter (SPEC.hf); it cannot be exported")
    seq_len = int(meta.get("seq_len") or model.max_positions or 0)
    return model, spec.hf, seq_len


def check_out(out: str) -> str:
    out = os.path.abspath(os.path.expanduser(out))
    if "://" in out:
        raise ConfigError("--out", f"{out} must be a local directory")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError("--out", f"{out} exists and is not an empty directory; give a new one")
    return out


def _shards(names: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    total = 0
    for name in names:
        if groups[-1] and total + sizes[name] > limit:
            groups.append([])
            total = 0
        groups[-1].append(name)
        total += sizes[name]
    return groups


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

    order = sorted(ours, key=lambda n: _natural(hf_names[n]))
    groups = _shards(order, {n: nbytes(n) for n in order}, int(max_shard_gb * 1e9))
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    files: list[str] = []
    try:
        return _write(store, path, ckpt, model, adapter, seq_len, out, groups, hf_names, ours, target, dtype, files)
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


def _write(store, path, ckpt, model, adapter, seq_len, out, groups, hf_names, ours, target, dtype, files) -> dict:
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


def _natural(name: str) -> list:
    import re

    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def main(argv: list[str] | None = None) -> None:
    from rayhybrid.preflight import exit_codes

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return
    with exit_codes("rayhybrid.export"):
        args = parse_args(argv)
        if args.max_shard_gb <= 0:
            raise ConfigError("--max-shard-gb", f"must be positive, got {args.max_shard_gb}")
        done = export(args.checkpoint, args.out, _options(args.storage_option), args.dtype, args.max_shard_gb)
    print(
        f"exported step {done['step']} of {done['checkpoint']}: {done['tensors']} tensors, "
        f"{done['bytes'] / 1e6:.1f} MB -> {done['out']}"
    )
    for name in done["files"]:
        print(f"  {os.path.join(done['out'], name)}")
