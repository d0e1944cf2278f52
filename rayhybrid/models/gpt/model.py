"""A GPT-style decoder whose pipeline stages keep the full model's parameter names.

`GPT(cfg, layer_ids=..., first=..., last=...)` builds one pipeline stage: the layers it owns sit
in a ModuleDict keyed by their global index, so a stage's `state_dict()` names
(`layers.5.attn.wq.weight`) are the same as in the whole model (docs/design.md, invariant 5).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from rayhybrid.config.schema import ModelConfig
from rayhybrid.models.gpt.counts import num_params  # noqa: F401  (its home before counts.py)
from rayhybrid.models.layers import CheckpointedBlock, init_by_name, initial_value

RESIDUAL = ("wo.weight", "w2.weight")
"""The residual output projections, initialised smaller (GPT-2's 1/sqrt(2 x n_layers))."""


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, inner = cfg.d_model, cfg.attn_dim
        self.head_dim = inner // cfg.n_heads
        self.wq = nn.Linear(d, inner, bias=False)
        self.wk = nn.Linear(d, inner, bias=False)
        self.wv = nn.Linear(d, inner, bias=False)
        self.wo = nn.Linear(inner, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_dim
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(CheckpointedBlock):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def block_forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """The whole decoder (defaults) or one pipeline stage of it."""

    return_hidden = False
    """The last stage returns its final (normalised) hidden state, not logits: the trainer's
    chunked loss runs `output` itself (train.loss_chunk, rayhybrid/trainer/loss.py)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_seq_len: int,
        layer_ids: Iterable[int] | None = None,
        first: bool = True,
        last: bool = True,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        ids = range(cfg.n_layers) if layer_ids is None else layer_ids
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model) if first else None
        self.pos_embeddings = nn.Embedding(max_seq_len, cfg.d_model) if first else None
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in ids})
        self.norm = nn.LayerNorm(cfg.d_model) if last else None
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.tok_embeddings(x) + self.pos_embeddings(pos)
        for layer in self.layers.values():
            x = layer(x)
        if self.output is not None:
            x = self.norm(x)
            if not self.return_hidden:
                x = self.output(x)
        return x

    def init_value(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """The whole initial value of parameter `name` (float32, CPU): from a generator seeded by
        (seed, its full name), so the values do not depend on which stage or rank holds it and
        every topology starts from the same model. Residual output projections get the GPT-2
        1/sqrt(2L) scaling. The trainer keeps this rank's shard of it
        (rayhybrid/parallel/materialise.py)."""
        return initial_value(seed, name, shape, n_layers=self.cfg.n_layers, residual=RESIDUAL)

    def init_weights(self, seed: int) -> None:
        """Every parameter of a materialised stage set to its `init_value`."""
        init_by_name(self, seed, self.cfg.n_layers, residual=RESIDUAL)
