"""Config checks that several models share (no torch): one-line `ConfigError`s."""

from __future__ import annotations

from dataclasses import fields

from rayhybrid.config.schema import ModelConfig
from rayhybrid.errors import ConfigError

LLAMA_FIELDS = ("n_kv_heads", "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings", "init_from")


def validate_attention(cfg, *, kv_heads: bool) -> None:
    """Heads split d_model (or head_dim is set), and tp splits heads (and KV heads) and the
    vocabulary (vocab-parallel embedding and output)."""
    m, tp = cfg.model, cfg.topology.tp
    for name in ("n_heads", "d_model", "ffn_mult"):  # n_layers and vocab_size: config/validate.py
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}", f"must be positive, got {getattr(m, name)}")
    for name in ("head_dim", "ffn_dim", "n_kv_heads", "max_positions"):
        if getattr(m, name) < 0:
            raise ConfigError(f"model.{name}", f"must not be negative, got {getattr(m, name)}; 0 means the default")
    if m.head_dim == 0 and m.d_model % m.n_heads:
        raise ConfigError(
            "model.d_model",
            f"{m.d_model} is not divisible by model.n_heads={m.n_heads}; pick a multiple or set model.head_dim",
        )
    if m.n_heads % tp:
        raise ConfigError(
            "topology.tp", f"tp={tp} does not divide model.n_heads={m.n_heads}; use a tp that divides {m.n_heads}"
        )
    if kv_heads:
        if m.n_heads % m.kv_heads:
            raise ConfigError(
                "model.n_kv_heads",
                f"{m.kv_heads} does not divide model.n_heads={m.n_heads}; each KV head serves a whole group of heads",
            )
        if m.kv_heads % tp:
            raise ConfigError(
                "topology.tp",
                f"tp={tp} does not divide model.n_kv_heads={m.kv_heads} (tensor parallelism splits the KV heads); "
                f"use a tp that divides {m.kv_heads}",
            )
    if m.vocab_size % tp:
        raise ConfigError(
            "topology.tp",
            f"tp={tp} does not divide model.vocab_size={m.vocab_size} (vocab-parallel embedding); "
            "pad the vocabulary to a multiple of tp",
        )


def no_llama_fields(cfg, model_name: str, allowed: tuple[str, ...] = ()) -> None:
    """Settings the model does not read must keep their defaults: a silently ignored
    `model.n_kv_heads=2` would train another model than the one asked for."""
    defaults = {f.name: f.default for f in fields(ModelConfig) if f.name in LLAMA_FIELDS}
    defaults["rope_scaling"] = {}
    for name in LLAMA_FIELDS:
        if name in allowed:
            continue
        value = getattr(cfg.model, name)
        if value != defaults[name] and not (name == "n_kv_heads" and value == cfg.model.n_heads):
            raise ConfigError(
                f"model.{name}",
                f"the {model_name} model does not use it (got {value!r}); remove it, or pick a llama3 preset "
                "(model=llama3_debug)",
            )
