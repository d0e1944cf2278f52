"""What a training step of the GPT costs, per rank, without building anything: parameters,
memory, communication, pipeline bubble, FLOPs.

Memory is counted the way the trainer's meter counts it (`metrics.memory=true`,
rayhybrid/trainer/memory.py): bytes of live tensor storages. The counts come from the model's
operators (what autograd saves for backward) and from what torch 2.13's pipelining, DTensor,
FSDP2 and `replicate` keep around them, as measured on CPU with that meter (tests/test_memory.py,
tests/test_plan.py). Symbols: b micro-batch, s sequence length, d model width, a attention width
(heads x head_dim), h MLP width (ffn_mult x d), H heads, V vocabulary, L layers, t tp, m
micro-batches per replica and step.

No torch tensors are made here; `model_flops_per_token` needs `num_params` from the model
module, which imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayhybrid.config.schema import Config, ModelConfig
from rayhybrid.config.topology import Layout
from rayhybrid.errors import ConfigError
from rayhybrid.models.registry import get_spec
from rayhybrid.models.spec import MemoryModel, ParamTensor
from rayhybrid.models.spec import ceil_div as _ceil
from rayhybrid.plan.schedule import rank_actions

FLOAT = 4  # float32: parameters, gradients, optimizer state, the residual stream, LayerNorm statistics
BF16 = 2
INT64 = 8  # token ids
MB = 2**20
RUNTIME_SCHEDULES = ("interleaved_1f1b", "interleaved_zb", "zbv")
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


def block_bytes(cfg: Config, tp: int | None = None, dtype: str | None = None) -> int:
    """What autograd keeps for backward per sample in one block (the model's memory model;
    the GPT's is counted in rayhybrid/models/gpt/memory.py)."""
    return memory_model(cfg).block_bytes(cfg, _t(cfg, tp), _dtype(cfg, dtype))


def head_bytes(cfg: Config, tp: int | None = None, dtype: str | None = None, loss_parallel: bool | None = None) -> int:
    """Per sample after the blocks: the final norm, the log-softmax of the logits (float32), the
    targets (the model's memory model)."""
    v = vocab_local(cfg, tp, loss_parallel)
    return memory_model(cfg).head_bytes(cfg, _t(cfg, tp), _dtype(cfg, dtype), v)


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


def bubble_fraction(schedule: str, pp: int, m: int, v: int = 1) -> tuple[float, str]:
    """Theoretical idle fraction of a pipeline step, assuming equal stage times; (value, formula)."""
    if pp == 1:
        return 0.0, "no pipeline"
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / (m + pp - 1), "(pp-1)/(m+pp-1)"
    if schedule == "interleaved_1f1b":
        return (pp - 1) / (v * m + pp - 1), "(pp-1)/(v*m+pp-1), v stages per rank (Narayanan et al. 2021)"
    if schedule == "interleaved_zb":
        # ZB-H1 (Qi et al. 2024): splitting backward into B (inputs) and W (weights) and
        # filling the cool-down with W leaves (pp-1)(T_F + T_B - T_W) idle, a third of 1F1B's
        # (pp-1)(T_F + T_B + T_W) when T_F = T_B = T_W; interleaving v stages per rank divides it by v.
        return (pp - 1) / (3 * v * m + pp - 1), "(pp-1)/(3*v*m+pp-1): ZB-H1 with T_F=T_B=T_W, interleaved v-way"
    if schedule == "zbv":
        # ZB-V (Qi et al. 2024) has no bubble when T_F = T_B = T_W and m >= 2pp-1; torch pads
        # the schedule to 2pp-1 micro-batches, so fewer leave their slots idle.
        if m >= 2 * pp - 1:
            return 0.0, "0: ZB-V with T_F=T_B=T_W and m >= 2pp-1"
        n = 2 * pp - 1
        return (n - m) / n, "(2pp-1-m)/(2pp-1): ZB-V padded to 2pp-1 micro-batches"
    raise ValueError(schedule)


# ------------------------------------------------------------------------------------------
# Memory per rank


@dataclass
class _StageCost:
    stage: Stage
    held: int  # saved for backward per micro-batch
    head_saved: int  # part of `held` freed before the blocks' backward (the head's)
    fwd_transient: int
    head_transient: int  # backward of the loss: gradients of the log-softmax output and the logits
    output_transient: int  # backward of the output projection: its input's and weight's gradients
    block_transient: int  # backward of a block (with checkpointing: its recomputed activations too)
    embedding_transient: int  # end of the first stage's backward: the token embedding's gradient
    w_intermediates: int  # zero bubble: output gradients kept from I to W
    logits: int  # per micro-batch, kept by the last stage's schedule
    out_send: int  # b x s x d sent to the next stage's rank per micro-batch (0: same rank or last)
    grad_send: int  # b x s x d gradient sent back per micro-batch (0: same rank or first)
    grad_extra: int  # bytes beyond 4 x params in the gradients (DTensor quirks)


@dataclass
class RankMemory:
    pp_rank: int
    stages: list[int]
    params: int
    grads: int
    optimizer: int
    activations: int
    pipeline_buffers: int
    transient: int
    batch: int
    dp_buffers: int
    autocast_weights: int
    peak_at: str
    in_flight: dict[int, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    saved_peak: int = 0  # most bytes saved for backward at any point of the step (with the kept logits)
    max_in_flight: dict[int, int] = field(default_factory=dict)  # most micro-batches in flight per stage

    @property
    def total(self) -> int:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.activations
            + self.pipeline_buffers
            + self.transient
            + self.batch
            + self.dp_buffers
            + self.autocast_weights
        )

    def as_dict(self) -> dict:
        keys = (
            "params",
            "grads",
            "optimizer",
            "activations",
            "pipeline_buffers",
            "transient",
            "batch",
            "dp_buffers",
            "autocast_weights",
            "total",
        )
        return {
            "pp_rank": self.pp_rank,
            "stages": self.stages,
            **{f"{k}_mb": getattr(self, k) / MB for k in keys},
            "total_bytes": self.total,
            "peak_at": self.peak_at,
            "in_flight": {str(k): v for k, v in self.in_flight.items()},
            "saved_peak_mb": self.saved_peak / MB,
            "max_in_flight": {str(k): v for k, v in self.max_in_flight.items()},
            "notes": self.notes,
        }


_ACTION_NAMES = {"F": "forward", "B": "backward", "I": "backward (inputs)", "W": "backward (weights)"}


def _microbatches(cfg: Config) -> int:
    return max(1, Layout.of(cfg).num_microbatches)


def _stage_cost(cfg: Config, stage: Stage, remote_prev: bool, remote_next: bool) -> _StageCost:
    t, tr, m = cfg.topology, cfg.train, cfg.model
    tp, b, s, d = t.tp, tr.micro_batch_size, cfg.data.seq_len, m.d_model
    bf16 = tr.dtype == "bfloat16"
    act = BF16 if bf16 else FLOAT
    lp = tp > 1 and t.use_loss_parallel(m.vocab_size)
    v_local = vocab_local(cfg)
    bsd = FLOAT * b * s * d  # the residual stream is float32 under autocast too
    n_layers = len(stage.layers)
    block = b * block_bytes(cfg)
    head = b * head_bytes(cfg) if stage.last else 0
    if tr.activation_checkpointing:
        held = n_layers * bsd  # each block keeps only its input
    else:
        held = n_layers * block
    held += head if stage.last else bsd  # the head's, or the stage output kept for its backward
    if not stage.first:
        held -= bsd  # the first block's input is the receive buffer (counted there)
    logits = b * s * v_local * act
    shard = act * b * s * _ceil(m.vocab_size, tp) if tp > 1 and not lp else 0  # local logits before the gather
    if stage.last:
        # The logits (bfloat16: and the loss's float32 copy) exist until the log-softmax is made;
        # a pipeline keeps every micro-batch's logits anyway (counted as a buffer).
        fwd = shard + (FLOAT * b * s * v_local if bf16 else 0) + (logits if t.pp == 1 else 0)
    else:
        fwd = act * b * s * d  # the MLP output before the residual add
    # The loss's backward: gradients of the log-softmax output and of the logits (float32); the
    # loss-parallel cross-entropy keeps one more (measured on torch 2.13).
    head_tr = (3 if lp else 2) * FLOAT * b * s * v_local if stage.last else 0
    # A new weight gradient is made whole before it is added to the accumulated one (or
    # becomes it): the output projection's (V x d), the token embedding's (V x d: DTensor makes
    # it replicated under tp), a block's w2 (d x h) while the MLP hidden state's gradient lives.
    out_tr = bsd + FLOAT * _ceil(m.vocab_size, tp) * d if stage.last else 0
    emb_tr = FLOAT * m.vocab_size * d + bsd if stage.first else 0
    mem = memory_model(cfg)
    block_tr = b * mem.block_transient(cfg, tp, tr.dtype) + mem.weight_transient(cfg, tp)
    if tr.activation_checkpointing:
        block_tr += block  # one block's activations, recomputed
        if bf16 and n_layers:
            # The recomputation casts the block's matrices to bfloat16 again (outside the
            # step's autocast cache).
            one = f"layers.{stage.layers.start}."
            block_tr += BF16 * sum(p.local_numel(tp) for p in stage.tensors if p.matmul and p.name.startswith(one))
    w_int = 0
    if t.schedule in ("interleaved_zb", "zbv") and t.pp > 1:
        # Backward for the inputs (I) keeps, until the weights' backward (W), the gradients of
        # the outputs of every operator with weights: q, k, v, wo, w1, w2 and both LayerNorms
        # per block; the final LayerNorm and the logits in the head. The first stage has no
        # input gradient to compute: torch runs its whole backward in W.
        per_block = mem.w_outputs(cfg, tp)
        w_int = b * (n_layers * per_block + (FLOAT * s * (d + v_local) if stage.last else 0))
    grad_extra = 0
    if stage.first and tp > 1:
        # torch 2.13's DTensor gives the vocab-sharded token embedding a replicated (full V x d)
        # gradient on every tp rank.
        emb = stage.tensors[0]
        grad_extra = FLOAT * (emb.numel - emb.local_numel(tp))
    return _StageCost(
        stage=stage,
        held=held,
        head_saved=head,
        fwd_transient=fwd,
        head_transient=head_tr,
        output_transient=out_tr,
        block_transient=block_tr,
        embedding_transient=emb_tr,
        w_intermediates=w_int,
        logits=logits if (stage.last and t.pp > 1) else 0,
        out_send=bsd if remote_next else 0,
        grad_send=bsd if remote_prev else 0,
        grad_extra=grad_extra,
    )


def rank_memory(cfg: Config, pp_rank: int, cuda: bool = False) -> RankMemory:
    """Peak memory of every rank of pipeline rank `pp_rank` (its dp and tp ranks hold the same).

    Walks the schedule's actions (rayhybrid/plan/schedule.py) and adds up, at each forward and
    backward, what is alive:
    - parameters; optimizer state (AdamW: 2 x parameters + one float32 step per tensor); the
      gradients of the stages whose first backward has run (FSDP2: unsharded while the
      micro-batches accumulate);
    - activations: what autograd saves for each micro-batch in flight (`block_bytes`,
      `head_bytes`; with checkpointing each block's input only); zero bubble: plus the output
      gradients kept from I to W;
    - pipeline buffers: a receive buffer per micro-batch and boundary direction (allocated once,
      kept), every micro-batch's logits on the last stage (torch merges them after the step),
      tensors still referenced by sends;
    - the operation's transient: forward, the logits (no pipeline) or the MLP output before the
      residual add; backward, the loss's gradients (2 x b s V) or a block's (the MLP hidden
      state's gradient and a b s d; with checkpointing, the block recomputed too);
    - the batch (int64 inputs and targets, on ranks with the first or last stage), the
      unsharded parameters data parallelism computes with (replicate: all of them; FSDP2: the
      root's and one block's, all of them in a pipeline), bfloat16 autocast's matrix copies.
    The optimizer step is a candidate too (final gradients, kept buffers, AdamW's temporaries:
    `cuda` chooses torch's foreach implementation, which makes them for all tensors at once).
    """
    t, tr = cfg.topology, cfg.train
    all_stages = stages(cfg)
    owned = owned_stages(cfg, pp_rank)
    owner = {sid: r for r in range(t.pp) for sid in owned_stages(cfg, r)} if t.pp > 1 else {0: 0}
    costs = {}
    for sid in owned:
        st = all_stages[sid]
        remote_prev = not st.first and owner[sid - 1] != pp_rank
        remote_next = not st.last and owner[sid + 1] != pp_rank
        costs[sid] = _stage_cost(cfg, st, remote_prev, remote_next)
    m = _microbatches(cfg)
    b, s, d = tr.micro_batch_size, cfg.data.seq_len, cfg.model.d_model
    bsd = FLOAT * b * s * d
    shard = t.dp_shard and t.dp > 1
    dp_div = t.dp if shard else 1

    # Parameters, gradients, optimizer state (AdamW: exp_avg, exp_avg_sq, one float32 step per tensor).
    tensors = [p for sid in owned for p in all_stages[sid].tensors]
    params = FLOAT * sum(p.local_numel(t.tp, dp_div) for p in tensors)
    unsharded = FLOAT * sum(p.local_numel(t.tp) for p in tensors)
    grad_extra = sum(c.grad_extra for c in costs.values())
    optimizer = 2 * params + FLOAT * len(tensors)
    grads_final = params + (grad_extra if not shard else 0)
    # FSDP2 accumulates micro-batches' gradients unsharded (no reduce-scatter until the last
    # one; a pipeline holds them to the end of the step).
    grads_during = {
        sid: FLOAT
        * sum(p.local_numel(t.tp, 1 if (shard and (m > 1 or t.pp > 1)) else dp_div) for p in all_stages[sid].tensors)
        + costs[sid].grad_extra
        for sid in owned
    }

    # Unsharded parameter copies that data parallelism holds while forward and backward run.
    dp_copies, head_sees_copies = 0, True
    notes = []
    if t.dp > 1 and not shard:
        dp_copies = unsharded  # `replicate` computes with unsharded copies of every parameter
        notes.append("replicate (dp): forward/backward use unsharded copies of the parameters (+1x params)")
    elif shard:
        if t.pp > 1:
            dp_copies = unsharded  # reshard_after_forward=False in a pipeline: all gathered
            notes.append("FSDP2 in a pipeline gathers the stage's parameters once and keeps them to the step's end")
        else:
            root = [p for p in tensors if not p.name.startswith("layers.")]
            per_block: dict[str, int] = {}
            for p in tensors:
                if p.name.startswith("layers."):
                    key = p.name.split(".")[1]
                    per_block[key] = per_block.get(key, 0) + FLOAT * p.local_numel(t.tp)
            dp_copies = FLOAT * sum(p.local_numel(t.tp) for p in root) + max(per_block.values(), default=0)
            head_sees_copies = False  # the root's parameters are gathered again after the loss's backward
            notes.append("FSDP2: the root's parameters and one block's are gathered at a time")
        if m > 1 or t.pp > 1:
            notes.append("FSDP2 accumulates gradients unsharded until the last micro-batch's reduce-scatter")
    autocast = 0
    if tr.dtype == "bfloat16":
        autocast = BF16 * sum(p.local_numel(t.tp) for p in tensors if p.matmul)
        notes.append("bfloat16 autocast keeps a bfloat16 copy of every matrix for the step")

    holds_batch = any(all_stages[sid].first or all_stages[sid].last for sid in owned)
    batch = 2 * INT64 * (tr.global_batch_size // t.dp) * s if holds_batch else 0

    # Receive buffers: one per micro-batch and stage boundary direction, allocated once.
    recv = 0
    local_boundary = False
    for sid in owned:
        c = costs[sid]
        st = c.stage
        if not st.first:
            recv += m * bsd if c.grad_send else 0
            local_boundary |= not c.grad_send
        if not st.last:
            recv += m * bsd if c.out_send else 0
            local_boundary |= not c.out_send
    if local_boundary:
        recv += m * bsd  # a V's turn (same rank): measured one set of buffers for both directions

    # Walk the schedule.
    actions = rank_actions(t.schedule, t.pp, pp_rank, m, Layout.of(cfg).virtual_stages)
    held = {sid: 0 for sid in owned}
    grads_on: set[int] = set()
    kept_logits = kept_sends = intermediates = 0
    # From its first backward on, torch's 1F1B keeps one more b x s x d alive: the stage
    # output (first stages) or input gradient (others) of a finished micro-batch, referenced
    # by the last send it made.
    stale = 0
    best: tuple[int, dict] | None = None
    saved_peak, max_in_flight = 0, dict(held)

    def consider(where: str, transient: int) -> None:
        nonlocal best, saved_peak
        saved = sum(costs[sid].held * n for sid, n in held.items()) + intermediates
        saved_peak = max(saved_peak, saved + kept_logits)
        for sid, n in held.items():
            max_in_flight[sid] = max(max_in_flight[sid], n)
        parts = {
            "params": params,
            "grads": sum(grads_during[sid] for sid in grads_on),
            "optimizer": optimizer,
            "activations": saved,
            "pipeline_buffers": recv + kept_logits + kept_sends + stale,
            "transient": transient,
            "batch": batch,
            "dp_buffers": dp_copies,
            "autocast_weights": autocast,
            "in_flight": dict(held),
            "where": where,
        }
        total = sum(v for k, v in parts.items() if isinstance(v, int))
        if best is None or total > best[0]:
            best = (total, parts)

    for kind, sid, mb in actions:
        c = costs[sid]
        where = f"{_ACTION_NAMES[kind]} of stage {sid}, micro-batch {mb}"
        if kind == "F":
            held[sid] += 1
            kept_logits += c.logits
            consider(where, c.fwd_transient)
        elif kind == "I" and c.stage.first:
            continue  # nothing to do: W runs the first stage's whole backward
        elif kind == "B" or (kind == "W" and c.stage.first):
            # Relative to everything the micro-batch saved: the loss's gradients first, then the
            # output projection's, the blocks' (the head's activations gone), and at the end the
            # embedding's (the whole micro-batch's gone).
            candidates = [c.block_transient - c.head_saved, c.embedding_transient - c.held]
            if c.stage.last:
                extra = 0 if head_sees_copies else dp_copies
                candidates += [c.head_transient - extra, c.head_transient // 2, c.output_transient]
            consider(where, max(candidates))
            held[sid] -= 1
            grads_on.add(sid)
            if t.schedule == "1f1b":
                stale = bsd if t.pp > 1 else 0
            else:
                kept_sends += c.grad_send + c.out_send
        elif kind == "I":
            # The loss's gradients at first; then the kept output gradients plus a block's.
            consider(where, max(c.head_transient, c.w_intermediates + c.block_transient))
            intermediates += c.w_intermediates
            kept_sends += c.grad_send
        else:  # W
            consider(where, 0)
            intermediates -= c.w_intermediates
            held[sid] -= 1
            grads_on.add(sid)
            kept_sends += c.out_send

    if any(all_stages[sid].last for sid in owned) and t.pp > 1:
        # After the last backward, torch's schedule concatenates every micro-batch's logits
        # into the step's output (the trainer drops it): twice the kept logits for a moment.
        consider("merge of the micro-batches' logits after the last backward", kept_logits)
        # (`consider` counts the kept logits once already; gradients are all there by now.)

    # The optimizer step: gradients final, buffers kept, AdamW's temporaries. On CPU torch runs
    # AdamW tensor by tensor: measured twice the largest tensor plus one MLP matrix (the largest
    # matrix of a block, whatever the model names it). On CUDA the
    # foreach implementation makes the square roots of all exp_avg_sq at once: about one copy
    # of the parameters.
    sizes = sorted(FLOAT * p.local_numel(t.tp, dp_div) for p in tensors)
    mlp = max((FLOAT * p.local_numel(t.tp, dp_div) for p in tensors if p.name.startswith("layers.")), default=0)
    opt_temp = params if cuda else 2 * sizes[-1] + mlp
    opt_total = params + grads_final + optimizer + recv + kept_logits + opt_temp
    assert best is not None
    total, parts = best
    if opt_total > total:
        parts = {
            "params": params,
            "grads": grads_final,
            "optimizer": optimizer,
            "activations": 0,
            "pipeline_buffers": recv + kept_logits,
            "transient": opt_temp,
            "batch": 0,
            "dp_buffers": 0,
            "autocast_weights": 0,
            "in_flight": {sid: 0 for sid in owned},
            "where": "optimizer step",
        }
    if t.schedule == "gpipe" and t.pp > 1 and not parts["grads"]:
        notes.append("GPipe peaks before the first backward ends: no gradients exist yet at the peak")
    return RankMemory(
        pp_rank=pp_rank,
        stages=owned,
        params=parts["params"],
        grads=parts["grads"],
        optimizer=parts["optimizer"],
        activations=parts["activations"],
        pipeline_buffers=parts["pipeline_buffers"],
        transient=parts["transient"],
        batch=parts["batch"],
        dp_buffers=parts["dp_buffers"],
        autocast_weights=parts["autocast_weights"],
        peak_at=parts["where"],
        in_flight=parts["in_flight"],
        notes=notes,
        saved_peak=saved_peak,
        max_in_flight=max_in_flight,
    )


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
    t, tr, model = cfg.topology, cfg.train, cfg.model
    m = _microbatches(cfg)
    b, s, d = tr.micro_batch_size, cfg.data.seq_len, model.d_model
    act = BF16 if tr.dtype == "bfloat16" else FLOAT
    all_stages = stages(cfg)
    owned = owned_stages(cfg, pp_rank)
    owner = {sid: r for r in range(t.pp) for sid in owned_stages(cfg, r)} if t.pp > 1 else {0: 0}
    tensors = [p for sid in owned for p in all_stages[sid].tensors]
    local = FLOAT * sum(p.local_numel(t.tp) for p in tensors)

    dp: dict = {"kind": "none", "payload_bytes": 0, "wire_bytes": 0}
    if t.dp > 1 and not t.dp_shard:
        dp = {
            "kind": "all-reduce of gradients",
            "payload_bytes": local,
            "wire_bytes": ring_all_reduce_wire(local, t.dp),
        }
    elif t.dp > 1:
        # Without a pipeline every micro-batch gathers each block and the root twice (forward,
        # and again for backward); a pipeline gathers once and keeps them to the step's end.
        gathered = local if t.pp > 1 else 2 * m * local
        dp = {
            "kind": "FSDP2 all-gather of parameters + reduce-scatter of gradients",
            "all_gather_bytes": gathered,
            "reduce_scatter_bytes": local,
            "payload_bytes": gathered + local,
            "wire_bytes": ring_gather_wire(gathered, t.dp) + ring_gather_wire(local, t.dp),
        }

    tp: dict = {"kind": "none", "payload_bytes": 0, "wire_bytes": 0}
    if t.tp > 1:
        lp = t.use_loss_parallel(model.vocab_size)
        fwd_ar = bwd_ar = gather = 0
        for sid in owned:
            st = all_stages[sid]
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
        tp = {
            "kind": "all-reduce" + (" + all-gather of logits" if gather else ""),
            "forward_all_reduce_bytes": fwd_ar,
            "backward_all_reduce_bytes": bwd_ar,
            "logits_all_gather_bytes": gather,
            "payload_bytes": fwd_ar + bwd_ar + gather,
            "wire_bytes": ring_all_reduce_wire(fwd_ar + bwd_ar, t.tp) + ring_gather_wire(gather, t.tp),
        }

    send = recv = 0
    boundary = m * FLOAT * b * s * d
    for sid in owned:
        st = all_stages[sid]
        if not st.last and owner[sid + 1] != pp_rank:
            send += boundary  # activations to the next stage
            recv += boundary  # their gradients back
        if not st.first and owner[sid - 1] != pp_rank:
            recv += boundary
            send += boundary
    pp = {
        "kind": "point-to-point" if send else "none",
        "send_bytes": send,
        "recv_bytes": recv,
        "payload_bytes": send,
        "wire_bytes": send,
    }
    return {"dp": dp, "tp": tp, "pp": pp, "total_wire_bytes": dp["wire_bytes"] + tp["wire_bytes"] + pp["wire_bytes"]}
