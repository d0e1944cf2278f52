"""What rayhybrid needs to know about a model: a `ModelSpec` (after torchtitan's).

The trainer, the driver, the planner and the tuner never name a model: they ask the spec that
`rayhybrid.models.registry.get_spec(cfg.model)` returns. A model is one module exposing `SPEC`:
the built-in ones are `rayhybrid.models.gpt` and `rayhybrid.models.llama3`, and
`model.module=my_package.my_model` loads one from outside the package (examples/custom_model/).

A spec's module must import without torch (the planner counts parameters and FLOPs without it):
`build_stage` and `parallelize` import their torch code when called.

Contract of the pieces (docs/models.md says it for users):

- `build_stage(model_cfg, *, seq_len, layer_ids, first, last)` returns an `nn.Module`, one
  pipeline stage, built on whatever device is current (the trainer builds on `meta`). Its
  parameter names are the full model's (`layers.5.attention.wq.weight` on every stage that holds
  layer 5), so checkpoints reshard across any layout. It has `init_value(name, shape, seed)`:
  the whole initial value of a parameter or buffer, the same whichever stage holds it (the
  trainer then parallelises the meta stage and materialises only this rank's slices, see
  rayhybrid/parallel/materialise.py); or, a model written before that, `init_weights(seed)`,
  which fills the whole materialised stage before it is parallelised. `forward(tokens)` on the first stage,
  `forward(hidden)` on the others; the last stage returns logits (batch, seq, vocab), or with
  `chunked_head` and its `return_hidden` set, the hidden state its `output` reads.
- `parallelize(stage, *, tp_mesh, dp_mesh, dp_shard, activation_checkpointing, loss_parallel,
  reshard_after_forward)` (on the meta stage, for a stage with `init_value`: it must not read or
  set values) applies tensor parallelism (DTensor plans), activation checkpointing
  and data parallelism (`rayhybrid.parallel.data_parallel.apply_data_parallel`), in that order,
  and returns the module. With `loss_parallel` the last stage leaves its logits sharded over the
  vocabulary (`Shard(-1)`, a DTensor); otherwise they are a plain replicated tensor.
  A spec with `compiles=True` also takes `compile` (train.compile), passed only when it is
  true: it compiles each block on its own after activation checkpointing and before data
  parallelism (`rayhybrid.models.layers.checkpoint_and_shard(..., compile=compile)` does,
  or `rayhybrid.parallel.compile.compile_blocks`). With `compiles=False` (the default, a
  spec written before train.compile) train.compile=true stops the run with one line.
  A spec with `offloads=True` takes `offload_activations` (train.offload_activations) the same
  way: `checkpoint_and_shard(..., offload_activations=...)` applies it to the blocks.
- `num_params(model_cfg, seq_len)` and `flops_per_token(model_cfg, seq_len, attention=True)`:
  plain arithmetic.
- `validate(cfg)`: raise `rayhybrid.errors.ConfigError` naming the setting and the fix.
- `memory`: the planner's memory model (`MemoryModel`), or None (the plan then reports no
  memory figures for the model).
- `hf`: the Hugging Face adapter (`rayhybrid.models.hf.HFAdapter`) or None.
- `settings`: the family's own settings, a frozen dataclass without torch whose fields are read
  from `model.options` (`rayhybrid.models.settings`; llama3's `LlamaSettings`); None: the
  family reads `model.options` itself (free-form).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


def ceil_div(x: int, n: int) -> int:
    return -(-x // n)


@dataclass(frozen=True)
class ParamTensor:
    """One parameter as the planner sees it: its full name, shape and tensor-parallel split."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    """The dimension tensor parallelism shards (vocab rows of the embeddings and the output,
    heads / hidden units of the matrices); None: replicated over tp (norms, positions)."""
    matmul: bool = False
    """Read by a linear layer (autocast keeps a bfloat16 copy of it)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_shape(self, tp: int) -> tuple[int, ...]:
        if self.tp_dim is None or tp == 1:
            return self.shape
        shape = list(self.shape)
        shape[self.tp_dim] = ceil_div(shape[self.tp_dim], tp)
        return tuple(shape)

    def local_numel(self, tp: int, dp_shard: int = 1) -> int:
        """Elements on one rank: tp shard, then FSDP2's dim-0 shard (padded) over dp."""
        shape = self.local_shape(tp)
        if dp_shard > 1:
            return ceil_div(shape[0], dp_shard) * math.prod(shape[1:])
        return math.prod(shape)


class MemoryModel(Protocol):
    """The model-specific part of the planner's memory estimate (rayhybrid/plan/peak_memory.py owns
    the rest: optimizer state, pipeline buffers, FSDP2 and the schedules). Byte counts are the
    bytes of live tensor storages, as the trainer's meter counts them (`metrics.memory=true`).
    `cfg` is the whole `Config`; `tp` and `dtype` override the topology's and the train's."""

    def param_tensors(self, model: Any, seq_len: int, layers: range, first: bool, last: bool) -> list[ParamTensor]:
        """A stage's parameters, full names, with the model's TP plan."""
        ...

    def block_bytes(self, cfg: Any, tp: int, dtype: str) -> int:
        """What autograd saves for backward, per sample, in one block."""
        ...

    def head_bytes(self, cfg: Any, tp: int, dtype: str, vocab_local: int) -> int:
        """Saved per sample after the blocks (final norm, logits' log-softmax, targets);
        `vocab_local`: the logit columns a rank holds. A model with `chunked_head` also takes
        `chunked=True` (train.loss_chunk in use): what the head saves when the loss runs the
        output projection in chunks (its norm's, and the loss's gradient to the hidden state;
        the planner adds the output weight's gradient, per micro-batch)."""
        ...

    def cuda_not_saved(self, cfg: Any, tp: int, dtype: str) -> tuple[int, int]:
        """Per sample, (in one block, after the blocks): bytes `block_bytes` and `head_bytes`
        count (as the CPU meter measures them) that CUDA's kernels do not save, e.g. a fused
        normalisation's intermediates. Optional: a model without it is counted as on CPU."""
        ...

    def block_transient(self, cfg: Any, tp: int, dtype: str) -> int:
        """Per sample: the largest short-lived tensors of one block's backward (the MLP hidden
        state's gradient and the weight gradient made whole before it is accumulated),
        excluding the weight gradient, which `weight_transient` gives."""
        ...

    def weight_transient(self, cfg: Any, tp: int) -> int:
        """Bytes of the largest weight gradient a block makes whole before accumulating it."""
        ...

    def w_outputs(self, cfg: Any, tp: int) -> int:
        """Bytes per sample and block of the gradients of the outputs of every operator with
        weights, which a zero-bubble schedule keeps from its input backward to its weight
        backward (float32, local to a tp rank)."""
        ...


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build_stage: Callable[..., Any]
    parallelize: Callable[..., Any]
    num_params: Callable[[Any, int], int]
    flops_per_token: Callable[..., float]
    validate: Callable[[Any], None] | None = None
    memory: MemoryModel | None = None
    hf: Any = None
    description: str = ""
    settings: type | None = None
    """The family's settings dataclass, built from `model.options` by `registry.settings_of`
    (unknown keys and wrong types refused by name); None: `model.options` is free-form."""
    compiles: bool = False
    """`parallelize` takes `compile` and compiles each block (train.compile); False:
    train.compile=true is refused with one line naming the model."""
    offloads: bool = False
    """`parallelize` takes `offload_activations` (train.offload_activations, passed only when
    true) and keeps what its blocks save for backward in host memory
    (`rayhybrid.parallel.offload.offload_blocks`); False: the setting is refused with one line."""
    loss: Callable[[Any, Any], Any] | None = None
    """The family's own training loss, `loss(logits, targets) -> the SUM over the micro-batch's
    tokens` (a 0-d tensor; the trainer divides by the replica's token count, so micro-batch
    losses add up to the replica's mean). It runs inside torch's `loss_parallel()` when the
    output is tensor-parallel, so it must work on sharded logits as `F.cross_entropy` does.
    None: summed token cross-entropy, in chunks of tokens where the model has `chunked_head`
    (train.loss_chunk), else on whole logits. A family's own loss always reads whole logits."""
    chunked_head: bool = False
    """The last stage's module has `output`, the linear projection to the vocabulary (its
    `weight` the logits' matrix, tensor-parallel as the family's plan makes it; its only other
    parameter, if any, `bias`: the chunked loss refuses any other), and a
    `return_hidden` attribute: set True (by the trainer, train.loss_chunk > 0), its forward
    returns the hidden state that `output` reads instead of logits, and the trainer's loss runs
    `output` over chunks of tokens (rayhybrid/trainer/loss.py). False: the last stage always
    returns logits and the loss reads them whole."""

    def loss_in_chunks(self, chunk: int, micro_batch_tokens: int) -> bool:
        """Whether the trainer's loss runs in chunks of `chunk` tokens (train.loss_chunk): a
        model with `chunked_head`, the default cross-entropy, and micro-batches of more than
        `chunk` tokens (a smaller one is one chunk: its whole logits, exactly as with 0)."""
        return 0 < chunk < micro_batch_tokens and self.loss is None and self.chunked_head
