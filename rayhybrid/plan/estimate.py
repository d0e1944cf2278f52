"""What a training step costs, per rank, without building anything: parameters, memory,
communication, pipeline bubble, FLOPs. The formulas common to every model live here; each
rank's peak memory, term by term (`rank_memory`), is rayhybrid/plan/peak_memory.py's, which builds
on them; what is particular to a model (its parameter tensors and TP plan, what its blocks save
for backward, its parameter and FLOP counts) comes from its spec's `MemoryModel`
(rayhybrid/models/spec.py; the GPT's in rayhybrid/models/gpt/memory.py, Llama's in
rayhybrid/models/llama3/memory.py).

Memory is counted the way the trainer's meter counts it (`metrics.memory=true`,
rayhybrid/trainer/memory_meter.py): bytes of live tensor storages. The counts come from the model's
operators (what autograd saves for backward) and from what torch 2.13's pipelining, DTensor,
FSDP2 and `replicate` keep around them, as measured on CPU with that meter (tests/test_memory.py,
tests/test_plan.py). Symbols: b micro-batch, s sequence length, d model width, a attention width
(heads x head_dim), h MLP width (ffn_mult x d), H heads, V vocabulary, L layers, t tp, m
micro-batches per replica and step.

Nothing here imports torch or Ray or makes a tensor, and the built-in models' specs are
arithmetic too: `python -m rayhybrid.plan` runs without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayhybrid.config.schema import Config, ModelConfig
from rayhybrid.config.topology import Layout, bubble_fraction  # noqa: F401 (est.bubble_fraction: kept there)
from rayhybrid.errors import ConfigError
from rayhybrid.models.registry import get_spec
from rayhybrid.models.spec import MemoryModel, ParamTensor
from rayhybrid.models.spec import ceil_div as _ceil

FLOAT = 4  # float32: parameters, gradients, optimizer state, the residual stream, LayerNorm statistics
BF16 = 2
INT64 = 8  # token ids
MB = 2**20
"""Multi-stage schedules run by torch's `_PipelineScheduleRuntime`, which waits for its sends only
at the end of the step."""


def _t(cfg: Config, tp: int | None) -> int:
    return cfg.topology.tp if tp is None else tp


def _dtype(cfg: Config, dtype: str | None) -> str:
    return cfg.train.dtype if dtype is None else dtype


def memory_model(cfg: Config) -> MemoryModel:
    """The model's memory model (its spec's); a `ConfigError` when it has none."""
    spec = get_spec(cfg.model)
    if spec.memory is None:
        raise ConfigError("model", f"model {spec.name} has no memory model for the planner (ModelSpec.memory)")
    return spec.memory


def has_memory_model(cfg: Config) -> bool:
    return get_spec(cfg.model).memory is not None


def vocab_local(cfg: Config, tp: int | None = None, loss_parallel: bool | None = None) -> int:
    """Logit columns a rank holds: V, or V / tp when the logits stay sharded into the loss."""
    t = _t(cfg, tp)
    if loss_parallel is None:
        loss_parallel = t > 1 and cfg.topology.use_loss_parallel(cfg.model.vocab_size)
    return _ceil(cfg.model.vocab_size, t) if loss_parallel else cfg.model.vocab_size


# ------------------------------------------------------------------------------------------
# Activations saved for backward, per sample (the hand count checked by tests/test_memory.py)


def cuda_not_saved(cfg: Config, tp: int | None = None, dtype: str | None = None) -> tuple[int, int]:
    """Per sample, (in one block, after the blocks): what the CPU count keeps that CUDA's
    kernels do not (the model's memory model's `cuda_not_saved`; (0, 0) without one)."""
    less = getattr(memory_model(cfg), "cuda_not_saved", None)
    return less(cfg, _t(cfg, tp), _dtype(cfg, dtype)) if less is not None else (0, 0)


def block_bytes(cfg: Config, tp: int | None = None, dtype: str | None = None, device: str = "cpu") -> int:
    """What autograd keeps for backward per sample in one block (the model's memory model;
    the GPT's is counted in rayhybrid/models/gpt/memory.py); `device` "cuda": less what CUDA's
    fused kernels do not keep (`cuda_not_saved`)."""
    less = cuda_not_saved(cfg, tp, dtype)[0] if device == "cuda" else 0
    return memory_model(cfg).block_bytes(cfg, _t(cfg, tp), _dtype(cfg, dtype)) - less


def loss_chunk(cfg: Config) -> int:
    """Tokens per chunk of the training loss (train.loss_chunk, where the model's spec runs it
    in chunks: `ModelSpec.loss_in_chunks`); 0: whole logits."""
    chunk, tokens = cfg.train.loss_chunk, cfg.train.micro_batch_size * cfg.data.seq_len
    return chunk if get_spec(cfg.model).loss_in_chunks(chunk, tokens) else 0


def head_bytes(
    cfg: Config,
    tp: int | None = None,
    dtype: str | None = None,
    loss_parallel: bool | None = None,
    device: str = "cpu",
) -> int:
    """Per sample after the blocks: the final norm, the log-softmax of the logits (float32), the
    targets (the model's memory model); in chunks (train.loss_chunk), the norm's and the loss's
    gradient to the hidden state; `device` as for `block_bytes`."""
    v = vocab_local(cfg, tp, loss_parallel)
    chunked = {"chunked": True} if loss_chunk(cfg) else {}
    less = cuda_not_saved(cfg, tp, dtype)[1] if device == "cuda" else 0
    return memory_model(cfg).head_bytes(cfg, _t(cfg, tp), _dtype(cfg, dtype), v, **chunked) - less


def saved_bytes_per_sample(cfg: Config, tp: int | None = None, dtype: str | None = None) -> int:
    return cfg.model.n_layers * block_bytes(cfg, tp, dtype) + head_bytes(cfg, tp, dtype)


def megatron_activation_bytes(model: ModelConfig, seq_len: int, micro_batch: int, tp: int = 1) -> int:
    """Megatron-LM's activation memory per transformer layer (Korthikanti et al. 2022, "Reducing
    Activation Recomputation in Large Transformer Models", eqs. 1-2): 16-bit activations, no
    recomputation, h = d_model, a = heads; with tensor parallelism and no sequence parallelism
    s b h (10 + 24/t + 5 a s / (h t))."""
    s, b, h, a = seq_len, micro_batch, model.d_model, model.n_heads
    if tp == 1:
        return round(s * b * h * (34 + 5 * a * s / h))
    return round(s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)))


# ------------------------------------------------------------------------------------------
# Parameters


def stage_param_tensors(model: ModelConfig, seq_len: int, layers: range, first: bool, last: bool) -> list[ParamTensor]:
    """The parameters of one pipeline stage, named as in the full model, with the model's TP
    plan (its memory model's `param_tensors`)."""
    spec = get_spec(model)
    if spec.memory is None:
        return []
    return spec.memory.param_tensors(model, seq_len, layers, first, last)


@dataclass(frozen=True)
class Stage:
    index: int
    layers: range
    first: bool
    last: bool
    tensors: tuple[ParamTensor, ...]

    @property
    def params(self) -> int:
        return sum(p.numel for p in self.tensors)

    def describe(self) -> str:
        lo, hi = self.layers.start, self.layers.stop - 1
        layers = f"layers {lo}-{hi}" if hi > lo else f"layer {lo}"
        extra = [x for x, on in (("embeddings", self.first), ("head", self.last)) if on]
        return f"stage {self.index}: {layers}" + (f" + {' + '.join(extra)}" if extra else "")


def num_stages(cfg: Config) -> int:
    return Layout.of(cfg).num_stages


def stages(cfg: Config) -> list[Stage]:
    n = num_stages(cfg)
    out = []
    for i, layers in enumerate(Layout.of(cfg).stage_layers):
        first, last = i == 0, i == n - 1
        tensors = stage_param_tensors(cfg.model, cfg.data.seq_len, layers, first, last)
        out.append(Stage(i, layers, first, last, tuple(tensors)))
    return out


def owned_stages(cfg: Config, pp_rank: int) -> list[int]:
    """Global stage ids pipeline rank `pp_rank` holds (as the trainer assigns them)."""
    return Layout.of(cfg).stages_of(pp_rank)


def stage_owners(cfg: Config) -> dict[int, int]:
    """Global stage id -> the pipeline rank that holds it."""
    t = cfg.topology
    return {sid: r for r in range(t.pp) for sid in owned_stages(cfg, r)} if t.pp > 1 else {0: 0}


def _microbatches(cfg: Config) -> int:
    return max(1, Layout.of(cfg).num_microbatches)


# ------------------------------------------------------------------------------------------
# FLOPs, bubble


def num_params(model_cfg: ModelConfig, seq_len: int) -> int:
    """The whole model's parameter count (its spec's)."""
    return get_spec(model_cfg).num_params(model_cfg, seq_len)


def model_flops_per_token(model_cfg: ModelConfig, seq_len: int, attention: bool = True) -> float:
    """Training FLOPs per token, forward + backward, no recomputation (its spec's; for the
    built-in models 6N for the weights, Kaplan et al. 2020, plus, with `attention`, 12 x n_layers
    x seq_len x attn_dim for the attention scores and their weighted sum)."""
    return float(get_spec(model_cfg).flops_per_token(model_cfg, seq_len, attention=attention))


# ------------------------------------------------------------------------------------------
# Communication per optimizer step


def ring_all_reduce_wire(payload: int, n: int) -> int:
    """Bytes a rank sends (and receives) in a ring all-reduce of `payload` bytes over n ranks."""
    return 0 if n <= 1 else round(2 * (n - 1) / n * payload)


def ring_gather_wire(total: int, n: int) -> int:
    """Bytes a rank sends in a ring all-gather (or reduce-scatter) whose full tensor is `total`."""
    return 0 if n <= 1 else round((n - 1) / n * total)


def communication(cfg: Config, pp_rank: int) -> dict:
    """Bytes one rank of pipeline rank `pp_rank` moves per optimizer step, by parallelism.

    - dp, replicated: one all-reduce of the gradients (the micro-batches accumulate locally and
      synchronise on the last one). FSDP2: all-gathers of the parameters (without a pipeline:
      every micro-batch gathers every parameter twice, for forward and again for backward; in
      a pipeline: once per step, kept to the end) and one reduce-scatter of the gradients.
      HSDP (`topology.dp_shard=N`): the same within a shard group of N, then an all-reduce of
      the reduce-scattered gradient shard across the dp / N replica groups.
    - tp, per micro-batch: forward, the all-reduce after each row-parallel projection (wo, w2:
      2 per block, in the activation dtype) and after the vocab-parallel embedding; the gathered
      logits (or, with loss parallelism, three all-reduces of b x s for the loss); backward, the
      all-reduce of the gradient of each column-parallel input (the attention input, w1's input,
      the output projection's input: float32). Checkpointing repeats wo's in backward (the
      recomputation stops before w2's).
    - pp: b x s x d float32 per micro-batch per remote stage boundary: activations forward,
      their gradients backward.
    Payloads are the tensors' sizes; "wire" is what a ring algorithm sends per rank.
    """
    all_stages = stages(cfg)
    owned = [all_stages[sid] for sid in owned_stages(cfg, pp_rank)]
    dp = dp_communication(cfg, owned)
    tp = tp_communication(cfg, owned)
    pp = pp_communication(cfg, pp_rank, all_stages)
    return {"dp": dp, "tp": tp, "pp": pp, "total_wire_bytes": dp["wire_bytes"] + tp["wire_bytes"] + pp["wire_bytes"]}


def dp_communication(cfg: Config, owned: list[Stage]) -> dict:
    """Data parallelism's share of `communication`: the gradients' all-reduce (replicated), or
    FSDP2's all-gathers and reduce-scatter, of the stages `owned`."""
    t = cfg.topology
    local = FLOAT * sum(p.local_numel(t.tp) for st in owned for p in st.tensors)
    if t.dp == 1:
        return {"kind": "none", "payload_bytes": 0, "wire_bytes": 0}
    n = t.shard_group
    if n == 1:
        return {
            "kind": "all-reduce of gradients",
            "payload_bytes": local,
            "wire_bytes": ring_all_reduce_wire(local, t.dp),
        }
    # Without a pipeline every micro-batch gathers each block and the root twice (forward,
    # and again for backward); a pipeline gathers once and keeps them to the step's end.
    gathered = local if t.pp > 1 else 2 * _microbatches(cfg) * local
    out = {
        "kind": "FSDP2 all-gather of parameters + reduce-scatter of gradients",
        "all_gather_bytes": gathered,
        "reduce_scatter_bytes": local,
        "payload_bytes": gathered + local,
        "wire_bytes": ring_gather_wire(gathered, n) + ring_gather_wire(local, n),
    }
    if n < t.dp:  # HSDP: the shard groups' gradient shards are averaged across the replicas
        shard = local // n
        out["kind"] = f"HSDP: {out['kind']} within {n} ranks + all-reduce of gradient shards across {t.dp // n}"
        out["all_reduce_bytes"] = shard
        out["payload_bytes"] += shard
        out["wire_bytes"] += ring_all_reduce_wire(shard, t.dp // n)
    return out


def tp_communication(cfg: Config, owned: list[Stage]) -> dict:
    """Tensor parallelism's share of `communication`: the all-reduces in forward and backward,
    and the logits' all-gather (without loss parallelism), of the stages `owned`."""
    t, tr, model = cfg.topology, cfg.train, cfg.model
    if t.tp == 1:
        return {"kind": "none", "payload_bytes": 0, "wire_bytes": 0}
    m = _microbatches(cfg)
    b, s, d = tr.micro_batch_size, cfg.data.seq_len, model.d_model
    act = BF16 if tr.dtype == "bfloat16" else FLOAT
    lp = t.use_loss_parallel(model.vocab_size)
    fwd_ar = bwd_ar = gather = 0
    for st in owned:
        n = len(st.layers)
        # Recomputing a checkpointed block stops once its saved tensors are back: it repeats
        # wo's all-reduce, not w2's.
        fwd_ar += (3 if tr.activation_checkpointing else 2) * n * act * b * s * d
        bwd_ar += 2 * n * FLOAT * b * s * d
        if st.first:
            fwd_ar += FLOAT * b * s * d
        if st.last:
            bwd_ar += FLOAT * b * s * d
            if lp:
                fwd_ar += 3 * FLOAT * b * s
            else:
                gather += act * b * s * model.vocab_size
    fwd_ar, bwd_ar, gather = m * fwd_ar, m * bwd_ar, m * gather
    return {
        "kind": "all-reduce" + (" + all-gather of logits" if gather else ""),
        "forward_all_reduce_bytes": fwd_ar,
        "backward_all_reduce_bytes": bwd_ar,
        "logits_all_gather_bytes": gather,
        "payload_bytes": fwd_ar + bwd_ar + gather,
        "wire_bytes": ring_all_reduce_wire(fwd_ar + bwd_ar, t.tp) + ring_gather_wire(gather, t.tp),
    }


def pp_communication(cfg: Config, pp_rank: int, all_stages: list[Stage]) -> dict:
    """The pipeline's share of `communication`: b x s x d float32 per micro-batch each way
    across every boundary of pipeline rank `pp_rank`'s stages with another rank's."""
    owner = stage_owners(cfg)
    send = recv = 0
    boundary = _microbatches(cfg) * FLOAT * cfg.train.micro_batch_size * cfg.data.seq_len * cfg.model.d_model
    for sid in owned_stages(cfg, pp_rank):
        st = all_stages[sid]
        if not st.last and owner[sid + 1] != pp_rank:
            send += boundary  # activations to the next stage
            recv += boundary  # their gradients back
        if not st.first and owner[sid - 1] != pp_rank:
            recv += boundary
            send += boundary
    return {
        "kind": "point-to-point" if send else "none",
        "send_bytes": send,
        "recv_bytes": recv,
        "payload_bytes": send,
        "wire_bytes": send,
    }
