"""Llama 3 (and 3.1, 3.2): RMSNorm, rotate-half rotary embeddings with Llama 3.1's frequency
scaling, grouped-query attention, a SwiGLU MLP, an output tied to the embedding or not.

`SPEC` is what rayhybrid knows of it (rayhybrid/models/spec.py); `hf` maps its checkpoints to
and from Hugging Face's LlamaForCausalLM. This module imports no torch.
"""

from __future__ import annotations

from rayhybrid.errors import ConfigError
from rayhybrid.models.llama3.counts import flops_per_token, num_params
from rayhybrid.models.llama3.hf import HF
from rayhybrid.models.llama3.memory import MEMORY
from rayhybrid.models.llama3.settings import ROPE_SCALING_KEYS, LlamaSettings, kv_heads, settings
from rayhybrid.models.spec import ModelSpec


def build_stage(model, *, seq_len: int, layer_ids, first: bool, last: bool):
    from rayhybrid.models.llama3.model import Llama

    return Llama(model, layer_ids=layer_ids, first=first, last=last)


def parallelize(stage, **kwargs):
    from rayhybrid.models.llama3.parallelize import parallelize_llama

    return parallelize_llama(stage, **kwargs)


def validate(cfg) -> None:
    from rayhybrid.models.common import validate_attention

    m, s = cfg.model, settings(cfg.model)
    if s.n_kv_heads < 0:
        raise ConfigError("model.options.n_kv_heads", f"must not be negative, got {s.n_kv_heads}; 0 means n_heads")
    validate_attention(cfg, kv_heads=kv_heads(m, s))
    if m.head_width % 2:
        raise ConfigError("model.head_dim", f"rotary embeddings need an even head width, got {m.head_width}")
    if s.rope_theta <= 0:
        raise ConfigError("model.options.rope_theta", f"must be positive, got {s.rope_theta}")
    if s.norm_eps <= 0:
        raise ConfigError("model.options.norm_eps", f"must be positive, got {s.norm_eps}")
    if s.rope_scaling:
        unknown = sorted(set(s.rope_scaling) - set(ROPE_SCALING_KEYS) - {"rope_type"})
        if unknown or "factor" not in s.rope_scaling:
            raise ConfigError(
                "model.options.rope_scaling",
                f"Llama 3.1 scaling takes {', '.join(ROPE_SCALING_KEYS)} (factor required); got {dict(s.rope_scaling)}",
            )
        if s.rope_scaling.get("rope_type", "llama3") != "llama3":
            raise ConfigError(
                "model.options.rope_scaling", f"rope_type {s.rope_scaling['rope_type']!r} is not supported; only llama3"
            )


SPEC = ModelSpec(
    name="llama3",
    build_stage=build_stage,
    parallelize=parallelize,
    compiles=True,
    offloads=True,
    chunked_head=True,
    num_params=num_params,
    flops_per_token=flops_per_token,
    validate=validate,
    memory=MEMORY,
    hf=HF,
    settings=LlamaSettings,
    description="Llama 3: RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU",
)
