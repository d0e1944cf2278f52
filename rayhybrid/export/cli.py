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
import json
import os
import sys

from rayhybrid.errors import ConfigError
from rayhybrid.export.convert import export

DTYPES = ("float32", "bfloat16")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, as the other CLIs
        raise ConfigError("arguments", message)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options of the usage above; a bad one is a ConfigError (exit 2, one line)."""
    parser = _Parser(prog="python -m rayhybrid.export", add_help=False)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--storage-option", action="append", default=[])
    parser.add_argument("--dtype", choices=DTYPES, default=None)
    parser.add_argument("--max-shard-gb", type=float, default=5.0)
    return parser.parse_args(argv)


def storage_options(items: list[str]) -> dict:
    """--storage-option's KEY=VALUE items as fsspec options (a VALUE that is JSON, as JSON)."""
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


def main(argv: list[str] | None = None) -> None:
    """`python -m rayhybrid.export`: export, then print what was written."""
    from rayhybrid.preflight import exit_codes

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return
    with exit_codes("rayhybrid.export"):
        args = parse_args(argv)
        if args.max_shard_gb <= 0:
            raise ConfigError("--max-shard-gb", f"must be positive, got {args.max_shard_gb}")
        done = export(args.checkpoint, args.out, storage_options(args.storage_option), args.dtype, args.max_shard_gb)
    print(
        f"exported step {done['step']} of {done['checkpoint']}: {done['tensors']} tensors, "
        f"{done['bytes'] / 1e6:.1f} MB -> {done['out']}"
    )
    for name in done["files"]:
        print(f"  {os.path.join(done['out'], name)}")
