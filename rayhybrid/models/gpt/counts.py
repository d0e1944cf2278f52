"""Parameter and FLOP counts of the GPT decoder from its shape alone: plain arithmetic, no torch
(the driver and the planner use them without importing torch)."""

from __future__ import annotations

from rayhybrid.config.schema import ModelConfig


def num_params(cfg: ModelConfig, max_seq_len: int) -> int:
    """Parameter count of the whole model, computed without building it."""
    d, h = cfg.d_model, cfg.hidden_dim
    per_layer = 4 * d * cfg.attn_dim + 2 * d * h + 4 * d
    return cfg.vocab_size * d + max_seq_len * d + cfg.n_layers * per_layer + 2 * d + d * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int, attention: bool = True) -> float:
    """Training FLOPs per token (forward and backward): 6N for the N parameters' multiply-adds
    (Kaplan et al. 2020), plus, with `attention`, 12 x layers x seq_len x attention width for
    the attention scores and their weighted sum (PaLM's MFU appendix, causal mask ignored)."""
    n = num_params(cfg, seq_len)
    return 6.0 * n + (12.0 * cfg.n_layers * seq_len * cfg.attn_dim if attention else 0.0)
