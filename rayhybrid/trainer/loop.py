"""The training step, readable top to bottom: one `Trainer` per rank (no Ray here).

trainer = Trainer(cfg, rank=rank, device=device)   # after init_process_group
for _ in range(cfg.train.steps):
    result = trainer.train_step()                  # a StepResult: its metrics, the saves that ended
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from rayhybrid.config.schema import Config
from rayhybrid.config.topology import Layout
from rayhybrid.data.feed import DeviceFeed
from rayhybrid.data.streams import build_stream, replica_shard, trace_rows
from rayhybrid.faults import async_collectives, pause
from rayhybrid.models.registry import get_spec
from rayhybrid.parallel.grad import clip_grad_norm_
from rayhybrid.parallel.mesh import build_mesh
from rayhybrid.parallel.tied import TiedCopies
from rayhybrid.trainer.build import build_loss, build_memory_meter, build_optimizers, build_pipeline, build_stages
from rayhybrid.trainer.checkpoint import Checkpoints
from rayhybrid.trainer.evaluation import Evaluation
from rayhybrid.trainer.heal import commit_vote, heal_enabled, state_digest
from rayhybrid.trainer.instrument import instrument_stage
from rayhybrid.trainer.optim import lr_at, set_lr
from rayhybrid.trainer.passes import Accumulate, Pipelined
from rayhybrid.trainer.results import RestoreResult, SaveResult, StepMetrics, StepResult
from rayhybrid.trainer.split import ideal_bubble, install
from rayhybrid.trainer.startup import mark
from rayhybrid.trainer.timeline import Timeline

log = logging.getLogger(__name__)


def describe(trainer) -> dict:
    """What a `Trainer` holds (its method `describe`), for the driver's start-up table and summary."""
    return {
        "coord": [trainer.coord.dp, trainer.coord.pp, trainer.coord.tp],
        "device": str(trainer.device),
        "device_name": torch.cuda.get_device_name(trainer.device) if trainer.device.type == "cuda" else "cpu",
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "stages": {str(i): layers for i, layers in trainer.stage_layers.items()},
        "local_params": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in trainer.params),
        "model_params": trainer.spec.num_params(trainer.cfg.model, trainer.cfg.data.seq_len),
        "num_microbatches": trainer.n_microbatches,
        "loss_floor": trainer.stream.loss_floor,
    }


class Trainer:
    """One rank's training: its stages, optimizers and pipeline schedule (trainer/build.py) and
    the step. It owns the passes of a batch through its stages (trainer/passes.py), held-out
    evaluation (trainer/evaluation.py) and its checkpoints (trainer/checkpoint.py)."""

    def __init__(self, cfg: Config, *, rank: int, device: torch.device, generation: int | None = None) -> None:
        self.cfg = cfg
        self.generation = generation  # the run's, given by the worker (trainer/fence.py); None: no driver
        t = cfg.topology
        torch.manual_seed(cfg.seed)
        self.layout = Layout.of(cfg)
        self.topo = self.layout.topology
        self.coord = self.topo.coord(rank)
        self.device = device
        self.spec = get_spec(cfg.model)
        self.mesh = build_mesh(t.dp, t.pp, t.tp, device)
        # All ranks, for checkpoints: a group of its own rather than the default one, so that
        # leaving it after a failure (see cluster/worker.py) closes its connections too.
        self.world_group = dist.new_group()
        mark("device_init")
        self.checkpoints = Checkpoints(self)  # saves, the ones that ended, restores
        self.stream = build_stream(cfg.data, cfg.model.vocab_size, cfg.seed)
        self.feed = DeviceFeed(self.stream, device)  # its batches on the device, read ahead
        mark("data")
        self.evaluation = Evaluation()  # the held-out stream, built on first use, and val_loss
        self.n_microbatches = self.layout.num_microbatches
        self.replica_tokens = self.layout.replica_batch_size * cfg.data.seq_len
        self.loss_parallel = t.use_loss_parallel(cfg.model.vocab_size)
        self.num_stages = self.layout.num_stages
        self.stages = build_stages(
            cfg, self.spec, self.layout, self.mesh, device, pp_rank=self.coord.pp, loss_parallel=self.loss_parallel
        )
        if cfg.model.init_from:  # a Hugging Face checkpoint; a resumed checkpoint loads over it
            from rayhybrid.trainer.hf_load import load_pretrained

            load_pretrained(self)
            mark("restore")
        self.has_first = any(i == 0 for i, _ in self.stages)
        self.has_last = any(i == self.num_stages - 1 for i, _ in self.stages)
        self.loss = build_loss(cfg, self.spec, self.layout, self.stages)  # in chunks: train.loss_chunk
        self.params = [p for _, m in self.stages for p in m.parameters()]
        self.tied = TiedCopies(self.stages, self.layout)  # an output tied to the embedding at pp>1
        self.optimizers = build_optimizers(self.stages, cfg.train)
        self.timeline = Timeline(rank, device)  # its clock: the step's MFU split (trainer/split.py)
        self.timeline.ideal_bubble = ideal_bubble(t.schedule, t.pp, len(self.stages), self.n_microbatches)
        install()  # the waits torch blocks in, charged to the running step's clock
        self.trace_steps = set(cfg.metrics.trace_steps)
        instrument = functools.partial(instrument_stage, timeline=self.timeline, phase=self._phase)
        schedule = build_pipeline(cfg, self.layout, self.stages, self.mesh, device, self.loss_fn, instrument)
        if schedule is None:  # one stage: gradient accumulation over the micro-batches
            self.passes = Accumulate(
                self.stages[0][1], self.n_microbatches, self.loss_fn, self.timeline, self._phase, device
            )
        else:
            self.passes = Pipelined(schedule, self.has_first, self.has_last, self.timeline, device)
        self.memory = build_memory_meter(cfg, device, self.stages, self.optimizers)
        self.step = 0
        self.consumed_samples = 0
        # fault.heal: ranks vote before stepping, and keep their state across a failure when
        # another replica holds the same shards (trainer/heal.py).
        self.heal = heal_enabled(cfg)
        self.settled = False  # whether the state is the run's (trained, restored or healed)
        self.last_result: StepResult | None = None  # the last step's, for a step the driver missed
        self.stage_layers = {i: list(self.layout.stage_layers[i]) for i, _ in self.stages}
        mark("parallelize")  # with the optimizers and the pipeline schedule

    def save_checkpoint(self, root: str, keep: int, die_after_write: bool = False) -> SaveResult:
        """Save the current step under `root` (a path or URL): `Checkpoints.save`."""
        return self.checkpoints.save(root, keep, die_after_write)

    def finished_checkpoints(self, wait: bool = False) -> list[SaveResult]:
        """Asynchronous saves that ended since the last call: `Checkpoints.finished`."""
        return self.checkpoints.finished(wait)

    def close_checkpoints(self) -> None:
        """Abandon a save in flight, before the process group goes: `Checkpoints.close`."""
        self.checkpoints.close()

    def load_checkpoint(self, path: str, meta: dict) -> RestoreResult:
        """Restore a checkpoint written under any topology: `Checkpoints.load`."""
        return self.checkpoints.load(path, meta)

    describe = describe  # what this rank holds (module-level, below the imports)

    def loss_fn(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's summed loss over the replica's token count (`TokenLoss`, trainer/loss.py)."""
        with self.timeline.clock.part("compute"):  # a schedule computes it outside the stage's chunk
            return self.loss(output, targets)

    def step_context(self) -> contextlib.ExitStack:
        """What a pass of the model runs under: loss parallel (a vocab-parallel output) and
        autocast (train.dtype=bfloat16); training and evaluation alike."""
        stack = contextlib.ExitStack()
        if self.loss_parallel:
            stack.enter_context(loss_parallel())
        if self.cfg.train.dtype == "bfloat16":
            stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
        return stack

    def _phase(self, stage: int, phase: str) -> None:
        if self.memory is not None:
            self.memory.phase(stage, phase)

    def train_step(self) -> StepResult:
        """One optimizer step over the global batch: its metrics (same on every rank, but
        `samples_read` and `peak_mb`, this rank's) and the asynchronous saves that ended meanwhile."""
        cfg, t = self.cfg, self.cfg.topology
        start, cpu_start = time.perf_counter(), time.process_time()
        self.timeline.begin_step(record=self.step + 1 in self.trace_steps)  # and the step's clock
        lr = lr_at(self.step, cfg.train)
        for opt in self.optimizers:
            set_lr(opt, lr)

        self.settled = True  # the state is the run's at step `self.step` (docs/recovery-and-elasticity.md)
        async_collectives.host_sync()  # fault.nccl_like: a failure of the last step's collectives raises here
        with self.memory.step() if self.memory is not None else contextlib.nullcontext():
            loss = self.forward_backward()
            self._phase(self.stages[0][0], "optimizer")
            grad_norm = self.clip_gradients()
            # Every collective of the step comes before the optimizer step, which is local.
            with self.timeline.span("all_reduce loss", "comm"):
                loss = self.global_loss(loss)
            vote_s = self.commit_vote()
            optimizer_span = self.timeline.span("optimizer", "optimizer", stage=self.stages[0][0])
            with optimizer_span, self.timeline.clock.part("compute"):
                if pause.ARMED:
                    pause.at("optimizer")
                self.settled = False  # between the first optimizer's step and the step count
                for opt in self.optimizers:
                    opt.step()
                self.step += 1
                self.consumed_samples += cfg.train.global_batch_size
                self.settled = True
        if pause.ARMED:  # tests/test_vote.py: the state after the step, to compare replicas bit for bit
            pause.record("state", step=self.step, rank=dist.get_rank(), digest=state_digest(self))
        elapsed = time.perf_counter() - start
        metrics: StepMetrics = {
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "step_time_s": elapsed,
            **({"vote_s": vote_s} if vote_s is not None else {}),  # fault.heal's commit vote, in step_time_s
            "cpu_s": time.process_time() - cpu_start,  # this rank's process CPU time (all threads)
            "tokens_per_s": cfg.train.global_batch_size * cfg.data.seq_len / elapsed,
            "consumed_samples": self.consumed_samples,
            "num_microbatches": self.n_microbatches,
            "dp": t.dp,
            "pp": t.pp,
            "tp": t.tp,
            "samples_read": self.samples_read,  # [first sample index, count] this rank read
            "data_wait_s": self.data_wait_s,  # seconds this rank waited for its samples
            **({"data_read": self.data_read} if self.data_read is not None else {}),  # data.trace
            **(self.memory.step_metrics() if self.memory is not None else {}),
            "bubble": self.timeline.bubble(),  # this rank's idle share of the pipeline's time
            **self.timeline.split(elapsed),  # the step's time by part, and this rank's own compute_s
            **({"trace": self.timeline.events} if self.timeline.record else {}),
        }
        self.last_result = StepResult(metrics)  # kept before anything can fail: a peer heal records it
        if finished := self.finished_checkpoints():  # uploads done since the last step
            self.last_result = StepResult(metrics, tuple(finished))
        return self.last_result

    def clip_gradients(self) -> torch.Tensor:
        """Sum the tied copies' gradients, clip all to train.grad_clip; the global norm. Its
        collectives (the tied all-reduce too), as all the step's own, wait as dp's (the MFU
        split, trainer/split.py)."""
        clock, pp = self.timeline.clock, self._group("pp")
        with self.timeline.span("clip grad norm", "comm", stage=self.stages[0][0]), clock.part("compute", "dp"):
            self.tied.sum_grads(waiting=clock.wait)  # first and last stage's all-reduce: a dp wait
            return clip_grad_norm_(self.params, self.cfg.train.grad_clip, pp, self.tied.uncounted, waiting=clock.wait)

    def forward_backward(self) -> torch.Tensor:
        """Gradients of the global batch's mean loss (no optimizer step); returns this rank's
        part of the loss (non-zero on last stages only)."""
        t = self.cfg.topology
        # This replica's share of the global batch: samples [start, start + G/dp).
        shard = replica_shard(self.consumed_samples, self.cfg.train.global_batch_size, t.dp, self.coord.dp)
        # Last step's gradients go before the forward starts (and so do not count toward it).
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self._phase(self.stages[0][0], "forward")
        inputs, targets, self.samples_read = None, None, None
        self.data_wait_s, self.data_read = 0.0, None
        if self.has_first or self.has_last:
            inputs, targets = self.read(shard)
        with self.step_context():
            loss = self.passes.forward_backward(inputs, targets)
        self.feed.stage()  # the next batch's copy to the device, behind this step's work (CUDA)
        return loss

    def read(self, shard) -> tuple[torch.Tensor, torch.Tensor]:
        """This replica's samples of the step on the device (timed: `data_wait_s`), the next
        data.read_ahead steps' read in the background meanwhile (`DeviceFeed`), and with
        data.trace what was read."""
        d, t, global_batch = self.cfg.data, self.cfg.topology, self.cfg.train.global_batch_size
        following = [
            replica_shard(self.consumed_samples + ahead * global_batch, global_batch, t.dp, self.coord.dp)
            for ahead in range(1, d.read_ahead + 1)
        ]
        waited = time.perf_counter()
        with self.timeline.clock.part("data"):
            inputs, targets = self.feed.take((shard.start, shard.count))
        self.data_wait_s = time.perf_counter() - waited
        self.feed.ahead([(s.start, s.count) for s in following])
        self.samples_read = [shard.start, shard.count]
        if d.trace:
            self.data_read = trace_rows(self.stream, self.step + 1, shard)
        return inputs, targets

    def evaluate(self) -> float:
        """The mean token loss on the held-out data (`eval.batches` global batches), forward
        only, training left untouched; same value on every rank. See `Evaluation.run`."""
        return self.evaluation.run(self)

    def forward_only(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
        """This rank's part of one replica batch's mean loss (non-zero on last stages only)."""
        return self.passes.forward_only(inputs, targets)

    def named_parameters(self):
        """(full-model name, parameter) for every parameter this rank holds."""
        for _, module in self.stages:
            yield from module.named_parameters()

    def _group(self, dim: str) -> dist.ProcessGroup | None:
        return self.mesh[dim].get_group() if self.mesh[dim].size() > 1 else None

    def commit_vote(self) -> float | None:
        """fault.heal: the commit vote after the step's last collective and before any optimizer
        step (`heal.commit_vote`, which says why it holds on NCCL too); raises `VoteFailed`
        unless every rank voted. Returns its seconds (None: no vote)."""
        if not self.heal:
            return None
        start = time.perf_counter()
        with self.timeline.span("commit vote", "comm"), self.timeline.clock.wait("dp"):
            commit_vote(self.world_group, self.device, self.step + 1)
        return time.perf_counter() - start

    def global_loss(self, loss: torch.Tensor) -> float:
        """The replica's loss lives on its last stage: sum over pp, average over dp."""
        loss = loss.detach().float().reshape(())
        with self.timeline.clock.wait("dp"):  # the step's own collective (a wait, in the MFU split)
            if (pp := self._group("pp")) is not None:
                dist.all_reduce(loss, group=pp)
            if (dp := self._group("dp")) is not None:
                dist.all_reduce(loss, group=dp)
        if dp is not None:
            loss = loss / self.topo.dp
        with self.timeline.clock.sync():  # CUDA: the step's first device sync (compute, in the split)
            return float(loss)
