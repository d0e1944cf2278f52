"""Config checks that several models share (no torch): one-line `ConfigError`s."""

from __future__ import annotations

from rayhybrid.errors import ConfigError


def validate_attention(cfg, *, kv_heads: int | None = None) -> None:
    """Heads split d_model (or head_dim is set), and tp splits heads (and `kv_heads`, the
    key/value heads of grouped-query attention, given by a family that has them) and the
    vocabulary (vocab-parallel embedding and output)."""
    m, tp = cfg.model, cfg.topology.tp
    for name in ("n_heads", "d_model", "ffn_mult"):  # n_layers and vocab_size: config/validate.py
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}", f"must be positive, got {getattr(m, name)}")
    for name in ("head_dim", "ffn_dim", "max_positions"):
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
    if kv_heads is not None:
        if m.n_heads % kv_heads:
            raise ConfigError(
                "model.options.n_kv_heads",
                f"{kv_heads} does not divide model.n_heads={m.n_heads}; each KV head serves a whole group of heads",
            )
        if kv_heads % tp:
            raise ConfigError(
                "topology.tp",
                f"tp={tp} does not divide model.options.n_kv_heads={kv_heads} (tensor parallelism splits the KV "
                f"heads); use a tp that divides {kv_heads}",
            )
    if m.vocab_size % tp:
        raise ConfigError(
            "topology.tp",
            f"tp={tp} does not divide model.vocab_size={m.vocab_size} (vocab-parallel embedding); "
            "pad the vocabulary to a multiple of tp",
        )
