"""The GPT decoder: learned positions, LayerNorm, GELU MLP, multi-head attention, untied output.

`SPEC` is what rayhybrid knows of it (rayhybrid/models/spec.py). This module imports no torch:
the model code is imported when a stage is built.
"""

from __future__ import annotations

from rayhybrid.models.gpt.counts import flops_per_token, num_params
from rayhybrid.models.gpt.memory import MEMORY
from rayhybrid.models.settings import NoSettings
from rayhybrid.models.spec import ModelSpec


def build_stage(model, *, seq_len: int, layer_ids, first: bool, last: bool):
    from rayhybrid.models.gpt.model import GPT

    return GPT(model, max_seq_len=seq_len, layer_ids=layer_ids, first=first, last=last)


def parallelize(stage, **kwargs):
    from rayhybrid.models.gpt.parallelize import parallelize_gpt

    return parallelize_gpt(stage, **kwargs)


def validate(cfg) -> None:
    from rayhybrid.models.common import validate_attention

    validate_attention(cfg)


SPEC = ModelSpec(
    name="gpt",
    build_stage=build_stage,
    parallelize=parallelize,
    compiles=True,
    offloads=True,
    chunked_head=True,
    num_params=num_params,
    flops_per_token=flops_per_token,
    validate=validate,
    memory=MEMORY,
    settings=NoSettings,
    description="GPT-2/3 style decoder: learned positions, LayerNorm, GELU MLP, untied output",
)
