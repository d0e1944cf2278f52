"""The held-out loss of one rank's trainer (`eval.*`): forward only, training left untouched.

    evaluation = Evaluation()
    loss = evaluation.run(trainer)       # same value on every rank
    evaluation.val_loss                  # (step, loss) of the latest evaluation

The trainer's `evaluate()` runs it; its `val_loss` goes into the checkpoint of the same step.
"""

from __future__ import annotations

import torch

from rayhybrid.data.feed import DeviceFeed
from rayhybrid.data.streams import build_held_out, replica_shard


class Evaluation:
    """The held-out stream (built on first use) and the latest evaluation's result."""

    def __init__(self) -> None:
        self.held_out = None
        self.val_loss: tuple[int, float] | None = None  # (step, loss) of the latest evaluation

    @torch.no_grad()
    def run(self, trainer) -> float:
        """The mean token loss on the held-out data: `eval.batches` batches of the global
        batch size, always the same samples, each replica reading its share as in training.
        Forward only, under the training step's context (autocast, loss parallel) and through
        the pipeline schedule's forward-only pass; the optimizer, its state, the gradients and
        the training stream's position are not touched. Same value on every rank."""
        cfg, t = trainer.cfg, trainer.cfg.topology
        if self.held_out is None:
            self.held_out = build_held_out(cfg.data, cfg.model.vocab_size, cfg.seed, trainer.stream)
        meter, trainer.memory = trainer.memory, None  # what evaluation holds is not a training step's
        trainer.timeline.begin_step(record=False, measure=False)  # nor its spans (a traced step's are handed out)
        global_batch = cfg.train.global_batch_size
        shards = [
            replica_shard(b * global_batch, global_batch, t.dp, trainer.coord.dp) for b in range(cfg.eval.batches)
        ]
        keys = [(s.start, s.count) for s in shards]
        feed = DeviceFeed(self.held_out, trainer.device)  # read ahead as training is, and closed after
        total = torch.zeros((), device=trainer.device)
        try:
            for batch, key in enumerate(keys):
                inputs = targets = None
                if trainer.has_first or trainer.has_last:
                    inputs, targets = feed.take(key)
                    feed.ahead(keys[batch + 1 : batch + 1 + cfg.data.read_ahead])
                with trainer.step_context():
                    total += trainer.forward_only(inputs, targets)
        finally:
            trainer.memory = meter
            feed.close()
        loss = trainer.global_loss(total) / cfg.eval.batches
        self.val_loss = (trainer.step, loss)
        return loss
