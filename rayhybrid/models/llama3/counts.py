"""Parameter and FLOP counts of the Llama 3 decoder from its shape alone (no torch)."""

from __future__ import annotations

from rayhybrid.models.llama3.settings import kv_dim, settings


def num_params(cfg, max_seq_len: int = 0) -> int:
    """Parameters of the whole model: token embedding, per layer q/k/v/o (k and v n_kv_heads
    wide), the SwiGLU MLP's three matrices and two RMSNorms, the final norm, and the output
    projection unless it is tied to the embedding. (Rotary embeddings have no parameters, so
    `max_seq_len` does not count.)"""
    s = settings(cfg)
    d, a, kv, h, v = cfg.d_model, cfg.attn_dim, kv_dim(cfg, s), cfg.hidden_dim, cfg.vocab_size
    per_layer = 2 * d * a + 2 * d * kv + 3 * d * h + 2 * d
    output = 0 if s.tie_embeddings else v * d
    return v * d + cfg.n_layers * per_layer + d + output


def flops_per_token(cfg, seq_len: int, attention: bool = True) -> float:
    """Training FLOPs per token (forward and backward), as torchtitan counts them: 6 x the
    parameters that multiply (every one but the token embedding's lookup table; a tied output
    multiplies with it), plus, with `attention`, 12 x layers x seq_len x n_heads x head_dim for
    the scores and their weighted sum (grouped-query attention shares K and V between heads but
    computes as many scores as heads, causal mask ignored)."""
    n = num_params(cfg, seq_len)
    dense = n if settings(cfg).tie_embeddings else n - cfg.vocab_size * cfg.d_model
    return 6.0 * dense + (12.0 * cfg.n_layers * seq_len * cfg.attn_dim if attention else 0.0)
