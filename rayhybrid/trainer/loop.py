"""The training step, readable top to bottom: one `Trainer` per rank (no Ray here).

trainer = Trainer(cfg, rank=rank, device=device)   # after init_process_group
for _ in range(cfg.train.steps):
    metrics = trainer.train_step()
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from rayhybrid.config.schema import Config
from rayhybrid.config.topology import Layout
from rayhybrid.data.streams import build_held_out, build_stream, replica_shard
from rayhybrid.models.layers import shared_parameters
from rayhybrid.models.registry import get_spec
from rayhybrid.parallel.grad import clip_grad_norm_
from rayhybrid.parallel.mesh import build_mesh
from rayhybrid.parallel.pipeline import build_schedule, forward_only
from rayhybrid.trainer.memory import MemoryMeter
from rayhybrid.trainer.optim import build_optimizer, lr_at, set_lr
from rayhybrid.trainer.timeline import Timeline

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config, *, rank: int, device: torch.device) -> None:
        self.cfg = cfg
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
        # Asynchronous checkpoint uploads run their collectives in a thread of their own, on a
        # CPU group of their own (NCCL cannot stage; no other thread may share the group).
        async_saves = cfg.checkpoint.async_save and cfg.checkpoint.every > 0
        self.upload_group = dist.new_group(backend="gloo") if async_saves else None
        self.saver = None
        self.stream = build_stream(cfg.data, cfg.model.vocab_size, cfg.seed)
        self.held_out = None  # evaluation's stream, built on first use
        self.val_loss: tuple[int, float] | None = None  # (step, loss) of the latest evaluation
        self.n_microbatches = self.layout.num_microbatches
        self.replica_tokens = self.layout.replica_batch_size * cfg.data.seq_len
        self.loss_parallel = t.use_loss_parallel(cfg.model.vocab_size)

        # Pipeline stages this rank owns, each keeping the full model's parameter names.
        self.num_stages = self.layout.num_stages
        ranges = self.layout.stage_layers
        owned = self.layout.stages_of(self.coord.pp)
        self.stages = [(i, self._build_stage(i, ranges[i])) for i in owned]
        if cfg.model.init_from:  # a Hugging Face checkpoint; a resumed checkpoint loads over it
            from rayhybrid.trainer.hf_load import load_pretrained

            load_pretrained(self)
        self.has_first = any(i == 0 for i, _ in self.stages)
        self.has_last = any(i == self.num_stages - 1 for i, _ in self.stages)
        self.params = [p for _, m in self.stages for p in m.parameters()]
        # One optimizer per stage module, so optimizer state is keyed by that module's full
        # parameter names (reshardable checkpoints, see trainer/checkpoint.py).
        self.optimizers = [build_optimizer(list(m.parameters()), cfg.train) for _, m in self.stages]
        self.schedule = None
        if t.pp > 1:
            self.schedule = build_schedule(
                t.schedule,
                self.stages,
                num_stages=self.num_stages,
                device=device,
                group=self.mesh["pp"].get_group(),
                n_microbatches=self.n_microbatches,
                loss_fn=self.loss_fn,
                instrument=self._instrument,
            )
        self.timeline = Timeline(rank)
        self.trace_steps = set(cfg.metrics.trace_steps)
        self.memory = None
        if cfg.metrics.memory:
            budget = cfg.tune.memory_budget_mb if device.type == "cpu" else 0.0
            self.memory = MemoryMeter(device, [m for _, m in self.stages], self.optimizers, budget_mb=budget)
        self.step = 0
        self.consumed_samples = 0
        self.stage_layers = {i: list(ranges[i]) for i in owned}

    def checkpoint_meta(self) -> dict:
        """Trainer state that travels with a checkpoint, as JSON."""
        t = self.cfg.topology
        return {
            "version": 1,
            "step": self.step,
            # The whole model config, so a checkpoint alone says what it holds (export needs it).
            "model": dataclasses.asdict(self.cfg.model),
            "seq_len": self.cfg.data.seq_len,
            "consumed_samples": self.consumed_samples,
            # The held-out loss of this very step, when it was evaluated (checkpoint.keep_best).
            **({"val_loss": self.val_loss[1]} if self.val_loss and self.val_loss[0] == self.step else {}),
            "global_batch_size": self.cfg.train.global_batch_size,
            "seed": self.cfg.seed,
            "topology": {"dp": t.dp, "pp": t.pp, "tp": t.tp, "schedule": t.schedule, "dp_shard": t.dp_shard},
        }

    def save_checkpoint(self, root: str, keep: int, die_after_write: bool = False) -> dict:
        """Save the current step under `root` (a path or URL); returns what it did and any
        earlier asynchronous save that finished meanwhile (`finished`), see `Saver`."""
        from rayhybrid.trainer.checkpoint import Saver

        ck = self.cfg.checkpoint
        if self.saver is None or self.saver.root != root or self.saver.keep != keep:
            self.close_checkpoints()
            self.saver = Saver(self, root, ck.storage_options, keep, ck.async_save, ck.keep_best)
        return self.saver.save(die_after_write)

    def finished_checkpoints(self, wait: bool = False) -> list[dict]:
        """Asynchronous saves finished (committed or failed) since the last call; `wait`: wait
        for the one in flight first."""
        if self.saver is None:
            return []
        return self.saver.wait() if wait else self.saver.poll()

    def close_checkpoints(self) -> None:
        """Abandon a save in flight (it is never committed); before the process group goes."""
        if self.saver is not None:
            self.saver.close()
            self.saver = None

    def load_checkpoint(self, path: str, meta: dict) -> None:
        """Restore a checkpoint written under any topology; the LR schedule follows `step`."""
        from rayhybrid.trainer import checkpoint

        if meta["global_batch_size"] != self.cfg.train.global_batch_size:
            raise ValueError(
                f"checkpoint {path} was trained with train.global_batch_size={meta['global_batch_size']}; "
                f"resume with the same global batch (it fixes the sample stream and the LR schedule)"
            )
        checkpoint.load(self, path, self.cfg.checkpoint.storage_options)
        self.step = int(meta["step"])
        self.consumed_samples = int(meta["consumed_samples"])

    def describe(self) -> dict:
        """What this rank holds, for the driver's start-up table and summary."""
        return {
            "coord": [self.coord.dp, self.coord.pp, self.coord.tp],
            "device": str(self.device),
            "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "stages": {str(i): layers for i, layers in self.stage_layers.items()},
            "local_params": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in self.params),
            "model_params": self.spec.num_params(self.cfg.model, self.cfg.data.seq_len),
            "num_microbatches": self.n_microbatches,
            "loss_floor": self.stream.loss_floor,
        }

    def _build_stage(self, index: int, layers: range) -> torch.nn.Module:
        """One pipeline stage of the model its spec builds (full parameter names), made on the
        meta device, materialised here, initialised, then parallelised (TP, AC, dp)."""
        cfg = self.cfg
        with torch.device("meta"):
            stage = self.spec.build_stage(
                cfg.model,
                seq_len=cfg.data.seq_len,
                layer_ids=layers,
                first=index == 0,
                last=index == self.num_stages - 1,
            )
        tied = shared_parameters(stage)
        stage.to_empty(device=self.device)  # a new tensor per name: ties (a shared output) undone
        for name, source in tied:
            owner, _, attr = name.rpartition(".")
            setattr(stage.get_submodule(owner), attr, stage.get_parameter(source))
        stage.init_weights(cfg.seed)
        return self.spec.parallelize(
            stage,
            tp_mesh=self.mesh["tp"],
            dp_mesh=self.mesh["dp"],
            dp_shard=cfg.topology.dp_shard,
            activation_checkpointing=cfg.train.activation_checkpointing,
            loss_parallel=self.loss_parallel,
            reshard_after_forward=cfg.topology.pp == 1,
        )

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy over the replica's token count: micro-batch losses add
        up to the replica's mean loss, and averaging over dp gives the global batch's mean."""
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        return loss / self.replica_tokens

    def _step_context(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.loss_parallel:
            stack.enter_context(loss_parallel())
        if self.cfg.train.dtype == "bfloat16":
            stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
        return stack

    def _instrument(self, stage) -> None:
        """Time and label a pipeline stage's chunks: spans for the timeline (and its bubble),
        phases for the memory meter."""
        for method, phase, letter in (
            ("forward_one_chunk", "forward", "F"),
            ("backward_one_chunk", "backward", "B"),
            ("backward_weight_one_chunk", "backward", "W"),
        ):
            setattr(stage, method, self._chunk(getattr(stage, method), stage.stage_index, phase, letter))

    def _chunk(self, fn, stage: int, phase: str, letter: str):
        def run(chunk, *args, **kwargs):
            self._phase(stage, phase)
            with self.timeline.span(f"{letter}{chunk}", phase, busy=True, stage=stage, microbatch=chunk):
                return fn(chunk, *args, **kwargs)

        return run

    def _phase(self, stage: int, phase: str) -> None:
        if self.memory is not None:
            self.memory.phase(stage, phase)

    def train_step(self) -> dict[str, float]:
        """One optimizer step over the global batch; returns metrics (same on every rank, but
        `samples_read` and `peak_mb`, which are this rank's)."""
        cfg, t = self.cfg, self.cfg.topology
        start, cpu_start = time.perf_counter(), time.process_time()
        lr = lr_at(self.step, cfg.train)
        for opt in self.optimizers:
            set_lr(opt, lr)

        self.timeline.begin_step(record=self.step + 1 in self.trace_steps)
        with self.memory.step() if self.memory is not None else contextlib.nullcontext():
            loss = self.forward_backward()
            self._phase(self.stages[0][0], "optimizer")
            with self.timeline.span("optimizer", "optimizer", stage=self.stages[0][0]):
                grad_norm = clip_grad_norm_(self.params, cfg.train.grad_clip, self._group("pp"))
                for opt in self.optimizers:
                    opt.step()

        with self.timeline.span("all_reduce loss", "comm"):
            loss = self._global_loss(loss)
        self.step += 1
        self.consumed_samples += cfg.train.global_batch_size
        elapsed = time.perf_counter() - start
        finished = self.finished_checkpoints()
        return {
            **({"checkpoints": finished} if finished else {}),  # uploads done since the last step
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "step_time_s": elapsed,
            "cpu_s": time.process_time() - cpu_start,  # this rank's process CPU time (all threads)
            "tokens_per_s": cfg.train.global_batch_size * cfg.data.seq_len / elapsed,
            "consumed_samples": self.consumed_samples,
            "num_microbatches": self.n_microbatches,
            "dp": t.dp,
            "pp": t.pp,
            "tp": t.tp,
            "samples_read": self.samples_read,  # [first sample index, count] this rank read
            **(
                {"peak_mb": self.memory.peaks_mb(), "activation_mb": self.memory.activation_mb()}
                if self.memory is not None
                else {}
            ),
            "bubble": self.timeline.bubble(),  # this rank's idle share of the pipeline's time
            **({"trace": self.timeline.events} if self.timeline.record else {}),
        }

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
        inputs, targets = None, None
        self.samples_read = None
        if self.has_first or self.has_last:
            inputs, targets = self.stream.batch(shard.start, shard.count)
            self.samples_read = [shard.start, shard.count]
            inputs, targets = inputs.to(self.device), targets.to(self.device)
        with self._step_context():
            if self.schedule is None:
                return self._forward_backward(inputs, targets)
            return self._forward_backward_pipeline(inputs, targets)

    @torch.no_grad()
    def evaluate(self) -> float:
        """The mean token loss on the held-out data: `eval.batches` batches of the global
        batch size, always the same samples, each replica reading its share as in training.
        Forward only, under the training step's context (autocast, loss parallel) and through
        the pipeline schedule's forward-only pass; the optimizer, its state, the gradients and
        the training stream's position are not touched. Same value on every rank."""
        cfg, t = self.cfg, self.cfg.topology
        if self.held_out is None:
            self.held_out = build_held_out(cfg.data, cfg.model.vocab_size, cfg.seed, self.stream)
        meter, self.memory = self.memory, None  # what evaluation holds is not a training step's
        self.timeline.begin_step(record=False)  # nor its spans (a traced step's are handed out)
        global_batch = cfg.train.global_batch_size
        total = torch.zeros((), device=self.device)
        try:
            for batch in range(cfg.eval.batches):
                shard = replica_shard(batch * global_batch, global_batch, t.dp, self.coord.dp)
                inputs = targets = None
                if self.has_first or self.has_last:
                    inputs, targets = self.held_out.batch(shard.start, shard.count)
                    inputs, targets = inputs.to(self.device), targets.to(self.device)
                with self._step_context():
                    total += self._forward_only(inputs, targets)
        finally:
            self.memory = meter
        loss = self._global_loss(total) / cfg.eval.batches
        self.val_loss = (self.step, loss)
        return loss

    def _forward_only(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
        """This rank's part of one replica batch's mean loss (non-zero on last stages only)."""
        if self.schedule is None:
            (_, model), n = self.stages[0], self.n_microbatches
            return sum(_local(self.loss_fn(model(x), y)) for x, y in zip(inputs.chunk(n), targets.chunk(n)))
        return self._through_pipeline(functools.partial(forward_only, self.schedule), inputs, targets)

    def named_parameters(self):
        """(full-model name, parameter) for every parameter this rank holds."""
        for _, module in self.stages:
            yield from module.named_parameters()

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """No pipeline: gradient accumulation over the micro-batches, dp sync on the last."""
        (_, model), n = self.stages[0], self.n_microbatches
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(n), targets.chunk(n))):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(i == n - 1)
            self._phase(0, "forward")
            with self.timeline.span(f"F{i}", "forward", busy=True, stage=0, microbatch=i):
                loss = self.loss_fn(model(x), y)
            self._phase(0, "backward")
            with self.timeline.span(f"B{i}", "backward", busy=True, stage=0, microbatch=i):
                loss.backward()
            total += _local(loss.detach())
        return total

    def _forward_backward_pipeline(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
        def step(*args, **kwargs) -> None:
            with self.timeline.pipeline(), self._timed_p2p() if self.timeline.record else contextlib.nullcontext():
                self.schedule.step(*args, **kwargs)

        return self._through_pipeline(step, inputs, targets)

    def _through_pipeline(self, run, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
        """`run` (the schedule's step, or its forward-only pass) on the replica batch, each rank
        giving what its stages take; returns this rank's part of the loss (non-zero on last
        stages only)."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        run(*args, **kwargs)
        if self.has_last:
            return torch.stack([_local(x.detach()) for x in losses]).sum()
        return torch.zeros((), device=self.device)

    @contextlib.contextmanager
    def _timed_p2p(self):
        """Spans for the schedule's waits on sends and receives (a traced step only): the
        schedules wait through one module-level function, looked up at each call."""
        from torch.distributed.pipelining import schedules

        original = schedules._wait_batch_p2p

        def wait(work):
            with self.timeline.span("p2p wait", "comm"):
                original(work)

        schedules._wait_batch_p2p = wait
        try:
            yield
        finally:
            schedules._wait_batch_p2p = original

    def _group(self, dim: str) -> dist.ProcessGroup | None:
        return self.mesh[dim].get_group() if self.mesh[dim].size() > 1 else None

    def _global_loss(self, loss: torch.Tensor) -> float:
        """The replica's loss lives on its last stage: sum over pp, average over dp."""
        loss = loss.detach().float().reshape(())
        if (pp := self._group("pp")) is not None:
            dist.all_reduce(loss, group=pp)
        if (dp := self._group("dp")) is not None:
            dist.all_reduce(loss, group=dp)
            loss = loss / self.topo.dp
        return float(loss)


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if isinstance(x, DTensor) else x
