"""The example's model family (examples/custom_model/tiny_parallel) with a training loss of its
own (`ModelSpec.loss`), for tests/test_custom_model.py: token cross-entropy plus PaLM's z-loss,
`Z_WEIGHT * logsumexp(logits)**2` per token, which keeps the softmax normaliser near 1. Loaded
with `model.module=tests.z_loss`; written for logits that are not sharded (no loss parallel)."""

from __future__ import annotations

import dataclasses

import tiny_parallel

Z_WEIGHT = 1e-2


def loss(logits, targets):
    """Cross-entropy plus z-loss, summed over the micro-batch's tokens (the trainer divides by
    the replica's token count)."""
    from torch.nn import functional as F

    flat = logits.flatten(0, 1).float()
    z = flat.logsumexp(dim=-1)
    return F.cross_entropy(flat, targets.flatten(), reduction="sum") + Z_WEIGHT * z.square().sum()


SPEC = dataclasses.replace(tiny_parallel.SPEC, loss=loss)
