"""The Llama 3 decoder, one pipeline stage at a time, with the full model's parameter names.

RMSNorm, rotary embeddings in Hugging Face's layout (rotate-half: the two halves of each head
rotate together, so Hugging Face checkpoints load without permuting q and k), grouped-query
attention (n_kv_heads key/value heads, each shared by n_heads / n_kv_heads query heads), a
SwiGLU MLP (w2(silu(w1 x) * w3 x)) and an output projection, tied to the token embedding or
not. Names follow torchtitan (`layers.3.attention.wq.weight`, `layers.3.feed_forward.w1.weight`);
rayhybrid/models/llama3/hf.py maps them to Hugging Face's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from rayhybrid.config.schema import ModelConfig
from rayhybrid.models.layers import CheckpointedBlock, init_by_name, initial_value
from rayhybrid.models.llama3.settings import LlamaSettings, kv_dim, settings

RESIDUAL = ("wo.weight", "w2.weight")
"""The residual output projections, initialised smaller (GPT-2's 1/sqrt(2 x n_layers))."""


def inverse_frequencies(cfg: ModelConfig, s: LlamaSettings) -> torch.Tensor:
    """RoPE's inverse frequencies, float32, as Hugging Face computes them (default, or Llama
    3.1's `rope_type: llama3` scaling of the low frequencies)."""
    dim = cfg.head_width
    inv = 1.0 / (s.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = s.rope_scaling
    if not scaling:
        return inv
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope(
    seq_len: int, cfg: ModelConfig, s: LlamaSettings, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (seq, head_dim), for positions 0..seq_len-1 (computed in float32)."""
    inv = inverse_frequencies(cfg, s).to(device)
    freqs = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, s: LlamaSettings) -> None:
        super().__init__()
        d = cfg.d_model
        self.cfg, self.settings = cfg, s
        self.head_dim = cfg.head_width
        self.wq = nn.Linear(d, cfg.attn_dim, bias=False)
        self.wk = nn.Linear(d, kv_dim(cfg, s), bias=False)
        self.wv = nn.Linear(d, kv_dim(cfg, s), bias=False)
        self.wo = nn.Linear(cfg.attn_dim, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp and n_kv_heads / tp.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope(seq, self.cfg, self.settings, x.device, q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.hidden_dim, bias=False)  # gate
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.d_model, bias=False)  # down
        self.w3 = nn.Linear(cfg.d_model, cfg.hidden_dim, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def RMSNorm(dim: int, eps: float) -> nn.RMSNorm:
    """torch's RMSNorm. Hugging Face's LlamaRMSNorm computes the same in float32, the residual
    stream's dtype here under bfloat16 autocast too. (On CPU, torch 2.13 runs it as separate
    operators that keep the input, 1/rms and the normalised input for backward; see memory.py.)"""
    return nn.RMSNorm(dim, eps=eps)


class Block(CheckpointedBlock):
    def __init__(self, cfg: ModelConfig, s: LlamaSettings) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, eps=s.norm_eps)
        self.attention = Attention(cfg, s)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=s.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def block_forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """The whole decoder (defaults) or one pipeline stage of it."""

    return_hidden = False
    """The last stage returns its final (normalised) hidden state, not logits: the trainer's
    chunked loss runs `output` itself (train.loss_chunk, rayhybrid/trainer/loss.py)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        layer_ids: Iterable[int] | None = None,
        first: bool = True,
        last: bool = True,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.settings = s = settings(cfg)
        ids = range(cfg.n_layers) if layer_ids is None else layer_ids
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model) if first else None
        self.layers = nn.ModuleDict({str(i): Block(cfg, s) for i in ids})
        self.norm = RMSNorm(cfg.d_model, eps=s.norm_eps) if last else None
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if last else None
        if s.tie_embeddings and first and last:
            self.tie()

    def tie(self) -> None:
        """The output projection reads the token embedding's weight (one parameter, Llama 3.2
        1B and 3B); called again after tensor parallelism has replaced the parameters."""
        self.output.weight = self.tok_embeddings.weight

    def tied_copies(self) -> dict[str, str]:
        """{a parameter's name: the parameter it is tied to}, whichever of the two this stage
        holds. A tied output on a stage without the embedding (pipeline parallelism) is a copy
        of it, as in Megatron: it starts equal and the trainer sums the two copies' gradients
        every step (rayhybrid/parallel/tied.py); on a stage with both it is the embedding's own
        tensor (`tie`)."""
        return {"output.weight": "tok_embeddings.weight"} if self.settings.tie_embeddings else {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.output is not None:
            x = self.norm(x)
            if not self.return_hidden:
                x = self.output(x)
        return x

    def init_value(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """The whole initial value of parameter `name` (float32, CPU): from a generator seeded by
        (seed, its full name), so every topology starts from the same model: normal(0, 0.02)
        matrices and embeddings, the residual output projections (wo, w2) scaled by
        1/sqrt(2 x n_layers), norms at one; a tied output's copy as the embedding. The trainer
        keeps this rank's shard of it (rayhybrid/parallel/materialise.py)."""
        name = self.tied_copies().get(name, name)
        return initial_value(seed, name, shape, n_layers=self.cfg.n_layers, residual=RESIDUAL)

    def init_weights(self, seed: int) -> None:
        """Every parameter of a materialised stage set to its `init_value`."""
        init_by_name(self, seed, self.cfg.n_layers, residual=RESIDUAL, aliases=self.tied_copies())
