"""The training loss of the last pipeline stage: the token cross-entropy summed over a
micro-batch and divided by the replica's token count, over whole logits or in chunks of tokens
(`train.loss_chunk`).

    loss = build_loss(cfg, spec, layout, stages)   # trainer/build.py: a TokenLoss
    loss(stage_output, targets)   # the trainer's `loss_fn`, pipeline schedules' too

In chunks, the last stage returns its final (normalised) hidden state instead of logits (a spec
with `chunked_head`, its module's `return_hidden` set here) and the loss runs the stage's
`output` projection itself, `chunk` tokens at a time: no float32 logits of the whole
micro-batch exist, forward or backward. Training, each chunk's logits, cross-entropy and their
gradients (to the hidden state and to the output's weight and bias, if any) are made in the forward
(`ChunkedCrossEntropy`), and only the two gradients are kept for backward: one chunk's logits
and their gradient at a time, no recomputation, and the backward is one autograd node whose
gradient to the weight a zero-bubble schedule's weight pass reads again
(docs/configuration.md, "The loss in chunks").
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rayhybrid.errors import ConfigError
from rayhybrid.trainer.passes import local as _plain  # a loss-parallel DTensor's full value

log = logging.getLogger(__name__)


def _chunk_loss(output: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, divisor: int) -> torch.Tensor:
    """One chunk's summed cross-entropy divided by `divisor`, as the whole-logits loss computes
    it (the projection under the current autocast, float32 logits into the loss)."""
    logits = output(hidden)
    return F.cross_entropy(logits.float(), targets, reduction="sum") / divisor


def _scaled(g: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A kept gradient times the loss's gradient; a DTensor stays one, with its placements."""
    if isinstance(g, DTensor):
        return DTensor.from_local(g.to_local() * grad, g.device_mesh, g.placements, run_check=False)
    return g * grad


class ChunkedCrossEntropy(torch.autograd.Function):
    """The summed token cross-entropy of `output(hidden)` over `divisor`, `chunk` rows at a time.
    The forward makes each chunk's gradients to `hidden` and to `weight` and `bias` (the
    output's, passed in so that autograd links them; `bias` may be None), adds them up and
    keeps them; backward multiplies them by the loss's gradient. Works on a tensor-parallel
    output (DTensor weight, loss parallel)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, output, chunk, divisor):
        params = [p for p in (weight, bias) if p is not None and p.requires_grad]
        total, sums, grad_hidden = None, [None] * len(params), torch.empty_like(hidden)
        with torch.enable_grad():
            for start in range(0, hidden.shape[0], chunk):
                rows = hidden[start : start + chunk].detach().requires_grad_()
                loss = _chunk_loss(output, rows, targets[start : start + chunk], divisor)
                g_rows, *g_params = torch.autograd.grad(loss, (rows, *params))
                grad_hidden[start : start + chunk] = g_rows
                sums = [g if s is None else s.add_(g) for s, g in zip(sums, g_params, strict=True)]
                loss = _plain(loss.detach())
                total = loss if total is None else total + loss
        ctx.save_for_backward(grad_hidden, *sums)
        ctx.which = [p is not None and p.requires_grad for p in (weight, bias)]
        return total

    @staticmethod
    def backward(ctx, grad):
        grad_hidden, *sums = ctx.saved_tensors
        kept = iter(_scaled(g, grad) for g in sums)
        grad_weight, grad_bias = (next(kept) if has else None for has in ctx.which)
        return grad_hidden * grad, grad_weight, grad_bias, None, None, None, None


def chunked_cross_entropy(
    output: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk: int, divisor: int
) -> torch.Tensor:
    """The summed token cross-entropy of `output(hidden)` over `chunk` tokens at a time,
    divided by `divisor`; `hidden` (batch, seq, d) or (tokens, d), `targets` the matching token
    ids. `output` is a linear projection: its parameters `weight` and, optionally, `bias`."""
    hidden, targets = hidden.flatten(0, -2), targets.flatten()
    weight, bias = output.weight, getattr(output, "bias", None)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        return ChunkedCrossEntropy.apply(hidden, weight, bias, targets, output, chunk, divisor)
    losses = [
        _plain(_chunk_loss(output, hidden[i : i + chunk], targets[i : i + chunk], divisor))
        for i in range(0, hidden.shape[0], chunk)
    ]
    return torch.stack(losses).sum()


def _check_projection(model: str, output: nn.Module) -> None:
    """The chunked loss runs `output` as a linear projection and keeps gradients for its
    `weight` and `bias` only: any other parameter would get none, so it is refused."""
    others = sorted({name for name, _ in output.named_parameters()} - {"weight", "bias"})
    if others:
        raise ConfigError(
            "train.loss_chunk",
            f"model {model}'s output has parameters besides weight and bias ({', '.join(others)}), "
            "which the chunked loss cannot train; set train.loss_chunk=0",
        )


class TokenLoss:
    """The trainer's loss: the family's own (`ModelSpec.loss`) on whole logits, else the token
    cross-entropy, in chunks (`chunk` > 0 and a spec with `chunked_head`) or on whole logits.
    Either way summed over the micro-batch and divided by `replica_tokens`. `sharded`: the
    stages are sharded by FSDP2 (topology.dp_shard), not replicated."""

    def __init__(
        self,
        spec,
        stages: list[tuple[int, nn.Module]],
        *,
        num_stages: int,
        chunk: int,
        micro_batch_tokens: int,
        replica_tokens: int,
        sharded: bool = False,
    ) -> None:
        self.spec, self.replica_tokens = spec, replica_tokens
        self.sharded = sharded  # FSDP2 / HSDP (topology.dp_shard): parameters sharded between passes
        # A micro-batch of at most `chunk` tokens is one chunk: its whole logits, as without.
        self.chunk = chunk if spec.loss_in_chunks(chunk, micro_batch_tokens) else 0
        if 0 < chunk < micro_batch_tokens and not self.chunk:
            why = "has its own loss (ModelSpec.loss)" if spec.loss is not None else "has no chunked_head"
            log.info("train.loss_chunk=%d is not used: model %s %s; its loss reads whole logits", chunk, spec.name, why)
        self.stage: nn.Module | None = None  # the last stage, whose `output` the loss runs
        for index, module in stages if self.chunk else ():
            if index == num_stages - 1:
                module.return_hidden = True
                self.stage = module
                _check_projection(spec.name, module.output)

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.spec.loss is not None:
            return self.spec.loss(output, targets) / self.replica_tokens
        if self.chunk:
            if isinstance(self.stage, FSDPModule):
                # FSDP2 resharded the stage after its forward (topology.dp_shard, pp = 1):
                # gathered again for the loss, and kept for the backward that follows, which
                # starts with them (a no-op where they are whole: pipelines, replicate).
                self.stage.unshard()
            loss = chunked_cross_entropy(self.stage.output, output, targets, self.chunk, self.replica_tokens)
            if self.sharded and isinstance(self.stage, FSDPModule) and not torch.is_grad_enabled():
                # Evaluation: no backward follows to reshard them; sharded again, as FSDP2
                # leaves them after a forward (replicate keeps them whole).
                self.stage.reshard()
            return loss
        loss = F.cross_entropy(output.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        return loss / self.replica_tokens
