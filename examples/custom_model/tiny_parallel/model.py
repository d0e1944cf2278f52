"""The tiny_parallel decoder in torch, one pipeline stage at a time.

A stage holds the layers it is given in a ModuleDict keyed by their global index, so its
parameter names are the whole model's (`layers.5.mixer.attn.wq.weight` on whichever stage holds
layer 5): checkpoints then load under any pipeline split.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = d // n_heads
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = h.shape
        # -1 heads: under tensor parallelism a rank holds n_heads / tp of them.
        q, k, v = (w(h).view(bsz, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int, activation: str) -> None:
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.w_in = nn.Linear(d, hidden, bias=False)
        self.w_out = nn.Linear(hidden, d, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.w_out(self.act(self.w_in(h)))


class Mixer(nn.Module):
    """Attention and MLP side by side on the same input; their outputs summed."""

    def __init__(self, cfg) -> None:
        super().__init__()
        from . import option

        self.attn = Attention(cfg.d_model, cfg.n_heads)
        self.mlp = MLP(cfg.d_model, cfg.hidden_dim, option(cfg, "activation"))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.attn(h) + self.mlp(h)


class ParallelBlock(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(cfg.d_model, eps=1e-5)
        self.mixer = Mixer(cfg)
        self.checkpoint_activations = False  # set by parallelize (train.activation_checkpointing)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_activations and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class TinyParallel(nn.Module):
    """The whole model (first=last=True, every layer) or one pipeline stage of it."""

    def __init__(self, cfg, *, seq_len: int, layer_ids=None, first: bool = True, last: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        ids = range(cfg.n_layers) if layer_ids is None else layer_ids
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model) if first else None
        self.pos_embeddings = nn.Embedding(seq_len, cfg.d_model) if first else None
        self.layers = nn.ModuleDict({str(i): ParallelBlock(cfg) for i in ids})
        self.norm = nn.RMSNorm(cfg.d_model, eps=1e-5) if last else None
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:  # first stage: token ids in
            x = self.tok_embeddings(x) + self.pos_embeddings(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers.values():
            x = layer(x)
        if self.output is not None:  # last stage: logits out
            x = self.output(self.norm(x))
        return x

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Each parameter from a generator seeded by (seed, its full name): the same values
        whichever stage holds it, so every topology starts from the same model. Norms at one;
        the residual projections (wo, w_out) scaled down by 1/sqrt(2 x n_layers)."""
        from . import option

        std = float(option(self.cfg, "init_std"))
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            scale = std / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "w_out.weight")) else std
            param.copy_((torch.randn(param.shape, generator=gen) * scale).to(param.device, param.dtype))
