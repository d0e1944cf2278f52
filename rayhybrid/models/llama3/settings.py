"""Llama 3's own settings (no torch): what the shared ModelConfig does not hold, set under
`model.options` (`model.options.rope_theta=500000`, conf/model/llama3*.yaml) and named by
`SPEC.settings`. Every piece of the family reads them through `settings(model)`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rayhybrid.models.settings import build_settings

ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class LlamaSettings:
    """Llama's settings beyond the shape every model has (Hugging Face's names in brackets)."""

    n_kv_heads: int = 0
    """Key/value heads, grouped-query attention (num_key_value_heads); 0: as many as n_heads."""
    rope_theta: float = 10000.0
    """Rotary embedding base (rope_theta)."""
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    """Llama 3.1's rotary frequency scaling (rope_scaling with rope_type llama3): factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings; empty: none."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (rms_norm_eps)."""
    tie_embeddings: bool = False
    """The output projection shares the token embedding's weight, as in Llama 3.2 1B/3B
    (tie_word_embeddings)."""


def settings(model) -> LlamaSettings:
    """`model.options` (a ModelConfig's) as LlamaSettings; ConfigError names a bad option."""
    return build_settings(LlamaSettings, model.options, "llama3")


def kv_heads(model, s: LlamaSettings | None = None) -> int:
    """Key/value heads: n_kv_heads, or n_heads when it is 0."""
    return (s or settings(model)).n_kv_heads or model.n_heads


def kv_dim(model, s: LlamaSettings | None = None) -> int:
    """Width of the key and value projections: kv_heads x head_dim."""
    return kv_heads(model, s) * model.head_width
