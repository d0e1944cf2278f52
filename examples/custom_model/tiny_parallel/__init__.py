"""tiny_parallel: a small decoder defined outside rayhybrid, loaded with
`model.module=tiny_parallel` (this directory's parent on PYTHONPATH; see ../README.md).

Its block is the "parallel" block of GPT-J and PaLM: one shared RMSNorm feeds attention and
the MLP side by side, and both add to the residual stream at once,

    h = norm(x);  x = x + attention(h) + mlp(h)

so under tensor parallelism the block needs one all-reduce forward and one backward, where the
built-in models' sequential blocks need two of each (parallelize.py).

This module is what rayhybrid imports on the driver, in the planner and in every worker: it
imports no torch. `build_stage` and `parallelize` import model.py and parallelize.py when called.

Its own settings live in `model.options` (`model.options.activation=relu`):
    activation  gelu (default), relu or silu: the MLP's nonlinearity
    init_std    0.02 (default): the standard deviation of the initial weights
"""

from __future__ import annotations

from dataclasses import fields

from rayhybrid.config.schema import ModelConfig
from rayhybrid.errors import ConfigError
from rayhybrid.models.spec import ModelSpec

OPTIONS = {"activation": "gelu", "init_std": 0.02}
"""model.options this model reads, with their defaults."""
ACTIVATIONS = ("gelu", "relu", "silu")
UNUSED_FIELDS = ("head_dim", "init_from")
"""ModelConfig fields this model does not read: they must keep their defaults."""


def option(model_cfg, name: str):
    """A setting from `model.options`, or its default."""
    return model_cfg.options.get(name, OPTIONS[name])


def build_stage(model_cfg, *, seq_len: int, layer_ids, first: bool, last: bool):
    from .model import TinyParallel

    return TinyParallel(model_cfg, seq_len=seq_len, layer_ids=layer_ids, first=first, last=last)


def parallelize(stage, **kwargs):
    from .parallelize import parallelize_tiny

    return parallelize_tiny(stage, **kwargs)


def num_params(m, seq_len: int) -> int:
    """Token and position embeddings, per layer one norm, q/k/v/o and the MLP's two matrices,
    the final norm and the output projection."""
    d, h = m.d_model, m.hidden_dim
    per_layer = d + 4 * d * d + 2 * d * h
    return m.vocab_size * d + seq_len * d + m.n_layers * per_layer + d + d * m.vocab_size


def flops_per_token(m, seq_len: int, attention: bool = True) -> float:
    """6 x the parameters that multiply (not the embedding tables) plus, with `attention`,
    12 x layers x seq_len x d_model for the attention scores and their weighted sum."""
    dense = num_params(m, seq_len) - m.vocab_size * m.d_model - seq_len * m.d_model
    return 6.0 * dense + (12.0 * m.n_layers * seq_len * m.d_model if attention else 0.0)


def validate(cfg) -> None:
    """One-line ConfigErrors naming the setting and the fix."""
    m, tp = cfg.model, cfg.topology.tp
    defaults = {f.name: f.default for f in fields(ModelConfig)}
    same = {"head_dim": m.d_model // max(m.n_heads, 1)}
    for name in UNUSED_FIELDS:  # a preset may spell out what this model does anyway
        value = getattr(m, name)
        if value != defaults[name] and value != same.get(name):
            raise ConfigError(f"model.{name}", f"tiny_parallel does not use it (got {value!r}); remove it")
    for name in ("n_layers", "n_heads", "d_model", "vocab_size"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}", f"must be positive, got {getattr(m, name)}")
    if m.d_model % m.n_heads:
        raise ConfigError("model.d_model", f"{m.d_model} is not divisible by model.n_heads={m.n_heads}")
    mlp = "the MLP width (model.ffn_dim, or model.ffn_mult x model.d_model)"
    for what, size in (("model.n_heads", m.n_heads), ("model.vocab_size", m.vocab_size), (mlp, m.hidden_dim)):
        if size % tp:  # heads, vocabulary rows and MLP units are split over tp
            raise ConfigError("topology.tp", f"tp={tp} does not divide {what}={size}; use a tp that divides {size}")
    unknown = sorted(set(m.options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"model.options.{unknown[0]}", f"unknown option; tiny_parallel reads {', '.join(OPTIONS)}")
    if option(m, "activation") not in ACTIVATIONS:
        raise ConfigError("model.options.activation", f"got {option(m, 'activation')!r}; use one of {ACTIVATIONS}")
    std = option(m, "init_std")
    if isinstance(std, bool) or not isinstance(std, (int, float)) or std <= 0:
        raise ConfigError("model.options.init_std", f"must be a positive number, got {std!r}")


SPEC = ModelSpec(
    name="tiny_parallel",
    build_stage=build_stage,
    parallelize=parallelize,
    num_params=num_params,
    flops_per_token=flops_per_token,
    validate=validate,
    memory=None,  # the planner then reports no memory figures for this model
    description="decoder with GPT-J/PaLM parallel blocks: one shared RMSNorm, attention + MLP side by side",
)
