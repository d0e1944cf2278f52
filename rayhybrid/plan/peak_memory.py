"""Peak memory per rank of a training step, one function per term (as Megatron-LM's
theoretical_memory_usage.py splits its count): what each stage costs (`stage_cost`), the
parameters, gradients and optimizer state (`weight_and_optimizer_memory`), data parallelism's
unsharded copies (`data_parallel_copies`), bfloat16 autocast's copies (`autocast_weights`), the
batch (`batch_memory`), the pipeline's receive buffers (`receive_buffers`), what is alive at
each action of the schedule (`ScheduleWalk`) and the optimizer step
(`optimizer_step_memory`), activation offload's device and host shares
(`offload_activations`); `rank_memory` adds them up and keeps the peak.

Bytes are counted the way the trainer's meter counts them (see rayhybrid/plan/estimate.py, whose
formulas this module builds on). No torch, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayhybrid.config.schema import Config
from rayhybrid.config.topology import Layout
from rayhybrid.models.spec import ParamTensor
from rayhybrid.models.spec import ceil_div as _ceil
from rayhybrid.plan import allocator
from rayhybrid.plan.estimate import (
    BF16,
    FLOAT,
    INT64,
    MB,
    Stage,
    _microbatches,
    block_bytes,
    head_bytes,
    loss_chunk,
    memory_model,
    owned_stages,
    stage_owners,
    stages,
    vocab_local,
)
from rayhybrid.plan.schedule import rank_actions

CUBLAS_WORKSPACE = 32 * MB
"""cuBLAS's workspace per handle and stream on Hopper (torch's default, CUBLAS_WORKSPACE_CONFIG
:4096:8; cuBLASLt shares it), allocated through the caching allocator and kept: one for the
forward's thread, one for the autograd engine's (backward runs on its own thread, with its
own handle). On an H200 the measured peaks sat 64 MB above the tensor count, for the GPT and
Llama alike. Cards before Hopper take 8.125 MiB each (the plan is then 48 MB high)."""


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
    host: int = 0  # train.offload_activations: what the blocks save, in host memory per micro-batch


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
    workspace: int = 0  # CUDA: cuBLAS's workspaces, allocated once through the caching allocator
    reserved: int = 0  # CUDA: what the caching allocator holds at the peak (rayhybrid/plan/allocator.py)
    host_activations: int = 0  # train.offload_activations: most activation bytes in host memory

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
            + self.workspace
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
            "workspace",
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
            "reserved_mb": self.reserved / MB if self.reserved else None,
            "host_activations_mb": self.host_activations / MB,
            "notes": self.notes,
        }


# ------------------------------------------------------------------------------------------
# What one stage costs per micro-batch


def _bsd(cfg: Config) -> int:
    """b x s x d float32: the residual stream (float32 under autocast too), a stage boundary."""
    return FLOAT * cfg.train.micro_batch_size * cfg.data.seq_len * cfg.model.d_model


def _loss_parallel(cfg: Config) -> bool:
    t = cfg.topology
    return t.tp > 1 and t.use_loss_parallel(cfg.model.vocab_size)


def _device(cuda: bool) -> str:
    return "cuda" if cuda else "cpu"


def saved_activations(cfg: Config, stage: Stage, cuda: bool = False) -> tuple[int, int]:
    """(held, head): what one micro-batch saves for backward on `stage`, and the head's part of
    it (freed before the blocks' backward); `cuda`: as CUDA's kernels save it."""
    b, bsd = cfg.train.micro_batch_size, _bsd(cfg)
    block = b * block_bytes(cfg, device=_device(cuda))
    head = b * head_bytes(cfg, device=_device(cuda)) + _chunk_weight_grad(cfg) if stage.last else 0
    if cfg.train.activation_checkpointing:
        held = len(stage.layers) * bsd  # each block keeps only its input
    else:
        held = len(stage.layers) * block
    held += head if stage.last else bsd  # the head's, or the stage output kept for its backward
    if not stage.first:
        held -= bsd  # the first block's input is the receive buffer (counted there)
    return held, head


def _chunk_weight_grad(cfg: Config) -> int:
    """train.loss_chunk: the output weight's gradient (its local V / tp rows x d, float32) that
    the chunked loss makes in the forward and keeps for backward, per micro-batch; 0: whole."""
    return FLOAT * _ceil(cfg.model.vocab_size, cfg.topology.tp) * cfg.model.d_model if loss_chunk(cfg) else 0


def _logits_transient(cfg: Config, tokens: int, kept: bool) -> int:
    """The forward's short-lived logits of `tokens` tokens: the local logits before the gather
    (tp without loss parallel), the loss's float32 copy (bfloat16), and the logits themselves
    unless a pipeline keeps them (`kept`, counted as a buffer)."""
    t, m = cfg.topology, cfg.model
    bf16 = cfg.train.dtype == "bfloat16"
    act = BF16 if bf16 else FLOAT
    v_local = vocab_local(cfg)
    shard = act * tokens * _ceil(m.vocab_size, t.tp) if t.tp > 1 and not _loss_parallel(cfg) else 0
    return shard + (FLOAT * tokens * v_local if bf16 else 0) + (0 if kept else act * tokens * v_local)


def forward_transient(cfg: Config, stage: Stage) -> int:
    """The largest short-lived tensors of the stage's forward."""
    tr, m = cfg.train, cfg.model
    b, s = tr.micro_batch_size, cfg.data.seq_len
    if not stage.last:
        act = BF16 if tr.dtype == "bfloat16" else FLOAT
        return act * b * s * m.d_model  # the MLP output before the residual add
    if chunk := loss_chunk(cfg):
        # One chunk's logits, then its log-softmax kept through its backward (the loss's
        # gradients, `backward_transients`), then its new weight gradient before it is added.
        head_tr, _, _ = backward_transients(cfg, stage, tokens=chunk)
        log_softmax = FLOAT * chunk * vocab_local(cfg)
        return max(_logits_transient(cfg, chunk, kept=False), head_tr) + log_softmax + _chunk_weight_grad(cfg)
    # The logits (bfloat16: and the loss's float32 copy) exist until the log-softmax is made;
    # a pipeline keeps every micro-batch's logits anyway (counted as a buffer).
    return _logits_transient(cfg, b * s, kept=cfg.topology.pp > 1)


def backward_transients(cfg: Config, stage: Stage, tokens: int | None = None) -> tuple[int, int, int]:
    """(loss, output projection, token embedding): the short-lived tensors of the backward of
    the head's and the first stage's own operators (the loss's: of `tokens` tokens, default a
    micro-batch's). train.loss_chunk: the loss's backward scales the gradients its forward
    made (the hidden state's and the output weight's: a new copy of each), and the output
    projection has none of its own."""
    tp, m = cfg.topology.tp, cfg.model
    bsd = _bsd(cfg)
    v_local = vocab_local(cfg)
    if tokens is None and loss_chunk(cfg):
        return (bsd + _chunk_weight_grad(cfg) if stage.last else 0), 0, _embedding_transient(cfg, stage)
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len if tokens is None else tokens
    # The loss's backward: gradients of the log-softmax output and of the logits (float32); the
    # loss-parallel cross-entropy keeps one more (measured on torch 2.13).
    head_tr = (3 if _loss_parallel(cfg) else 2) * FLOAT * tokens * v_local if stage.last else 0
    # A new weight gradient is made whole before it is added to the accumulated one (or
    # becomes it): the output projection's (V x d), the token embedding's (V x d: DTensor makes
    # it replicated under tp), a block's w2 (d x h, in `block_transient`) while the MLP hidden
    # state's gradient lives.
    out_tr = bsd + FLOAT * _ceil(m.vocab_size, tp) * m.d_model if stage.last else 0
    return head_tr, out_tr, _embedding_transient(cfg, stage)


def _embedding_transient(cfg: Config, stage: Stage) -> int:
    return FLOAT * cfg.model.vocab_size * cfg.model.d_model + _bsd(cfg) if stage.first else 0


def block_transient(cfg: Config, stage: Stage, cuda: bool = False) -> int:
    """The short-lived tensors of one block's backward (with checkpointing: the block's
    activations, recomputed, too)."""
    tp, tr = cfg.topology.tp, cfg.train
    mem = memory_model(cfg)
    block_tr = tr.micro_batch_size * mem.block_transient(cfg, tp, tr.dtype) + mem.weight_transient(cfg, tp)
    if tr.activation_checkpointing:
        block_tr += tr.micro_batch_size * block_bytes(cfg, device=_device(cuda))  # one block's, recomputed
        if tr.dtype == "bfloat16" and len(stage.layers):
            # The recomputation casts the block's matrices to bfloat16 again (outside the
            # step's autocast cache).
            one = f"layers.{stage.layers.start}."
            block_tr += BF16 * sum(p.local_numel(tp) for p in stage.tensors if p.matmul and p.name.startswith(one))
    return block_tr


def zero_bubble_intermediates(cfg: Config, stage: Stage) -> int:
    """Zero-bubble schedules: the output gradients kept from the inputs' backward (I) to the
    weights' (W), per micro-batch."""
    t = cfg.topology
    if t.schedule not in ("interleaved_zb", "zbv") or t.pp == 1:
        return 0
    # Backward for the inputs (I) keeps, until the weights' backward (W), the gradients of
    # the outputs of every operator with weights: q, k, v, wo, w1, w2 and both LayerNorms
    # per block; the final LayerNorm and the logits in the head. The first stage has no
    # input gradient to compute: torch runs its whole backward in W.
    per_block = memory_model(cfg).w_outputs(cfg, t.tp)
    # In chunks (train.loss_chunk) the logits' is the loss's own gradient, a scalar.
    logits = 0 if loss_chunk(cfg) else vocab_local(cfg)
    head = FLOAT * cfg.data.seq_len * (cfg.model.d_model + logits) if stage.last else 0
    return cfg.train.micro_batch_size * (len(stage.layers) * per_block + head)


def offload_activations(cfg: Config, costs: dict[int, _StageCost], cuda: bool) -> str | None:
    """train.offload_activations (rayhybrid/parallel/offload.py): what each block saves (all of
    its activations, with checkpointing its input) goes to host memory per micro-batch
    (`_StageCost.host`; the walk keeps the most it holds). On CUDA it leaves the device's
    saved activations, all but the receive buffer (a later stage's first input, which stays),
    and the device holds what is in flight instead: the block computing and one copying (to
    the host in forward, back in backward, fetched ahead), added to the forward's and the
    blocks' backward transients. On a CPU device the host is the device: the copies sit in the
    same memory (the meter sees the blocks' saved bytes either way), the backward reads them
    where they are, and only the end of a block's forward holds one block's worth more: its
    own saved tensors beside their copies. Returns the plan's note."""
    if not cfg.train.offload_activations:
        return None
    bsd = _bsd(cfg)
    act = BF16 if cfg.train.dtype == "bfloat16" else FLOAT
    # What a block saves as this device's kernels save it (`saved_activations` counts the same,
    # so the device's share leaves exactly and never goes below zero).
    saved = block_bytes(cfg, device=_device(cuda))
    per_block = bsd if cfg.train.activation_checkpointing else cfg.train.micro_batch_size * saved
    for c in costs.values():
        c.host = len(c.stage.layers) * per_block
        if not c.host:
            continue
        # The end of a block's forward, before the head has saved anything: its saved tensors
        # (kept until then) beside their host copies, its MLP output; on CUDA the previous
        # block's copy may still be in flight, and the last block's during the head's forward.
        block_end = (
            per_block * (2 if cuda else 1) + act * cfg.train.micro_batch_size * cfg.data.seq_len * cfg.model.d_model
        )
        c.fwd_transient = max(c.fwd_transient + (per_block if cuda else 0), block_end - c.head_saved)
        if cuda:
            c.held += (0 if c.stage.first else bsd) - c.host
            c.block_transient += 2 * per_block
    if cuda:
        return "activation offload: the blocks' saved activations in host memory; two blocks' worth in flight on the device"
    return "activation offload: the blocks' saved activations in host memory (on a CPU device, the same memory)"


def gradient_extra(cfg: Config, stage: Stage) -> int:
    """Gradient bytes beyond the parameters' own: torch 2.13's DTensor gives the vocab-sharded
    token embedding a replicated (full V x d) gradient on every tp rank."""
    if not stage.first or cfg.topology.tp == 1:
        return 0
    emb = stage.tensors[0]
    return FLOAT * (emb.numel - emb.local_numel(cfg.topology.tp))


def stage_cost(cfg: Config, stage: Stage, remote_prev: bool, remote_next: bool, cuda: bool = False) -> _StageCost:
    """What `stage` costs per micro-batch; `remote_prev`/`remote_next`: its neighbours run on
    another pipeline rank (their boundaries are sent); `cuda`: saved as CUDA's kernels save."""
    tr = cfg.train
    bsd = _bsd(cfg)
    act = BF16 if tr.dtype == "bfloat16" else FLOAT
    held, head = saved_activations(cfg, stage, cuda)
    head_tr, out_tr, emb_tr = backward_transients(cfg, stage)
    kept_logits = stage.last and cfg.topology.pp > 1
    return _StageCost(
        stage=stage,
        held=held,
        head_saved=head,
        fwd_transient=forward_transient(cfg, stage),
        head_transient=head_tr,
        output_transient=out_tr,
        block_transient=block_transient(cfg, stage, cuda),
        embedding_transient=emb_tr,
        w_intermediates=zero_bubble_intermediates(cfg, stage),
        # In chunks (train.loss_chunk) the last stage's output is its hidden state (float32).
        logits=(bsd if loss_chunk(cfg) else tr.micro_batch_size * cfg.data.seq_len * vocab_local(cfg) * act)
        if kept_logits
        else 0,
        out_send=bsd if remote_next else 0,
        grad_send=bsd if remote_prev else 0,
        grad_extra=gradient_extra(cfg, stage),
    )


def stage_costs(cfg: Config, pp_rank: int, all_stages: list[Stage], cuda: bool = False) -> dict[int, _StageCost]:
    """The cost of every stage pipeline rank `pp_rank` holds, by global stage id."""
    owner = stage_owners(cfg)
    costs = {}
    for sid in owned_stages(cfg, pp_rank):
        st = all_stages[sid]
        remote_prev = not st.first and owner[sid - 1] != pp_rank
        remote_next = not st.last and owner[sid + 1] != pp_rank
        costs[sid] = stage_cost(cfg, st, remote_prev, remote_next, cuda)
    return costs


# ------------------------------------------------------------------------------------------
# What a rank holds for the whole step


def _fsdp_divisor(cfg: Config) -> int:
    """The dp ranks FSDP2 shards the parameters over (1: replicated or no dp; N with HSDP)."""
    return cfg.topology.shard_group


@dataclass
class WeightsAndOptimizer:
    tensors: list[ParamTensor]  # the rank's parameters (every stage it holds)
    params: int
    optimizer: int
    grads_final: int  # the gradients at the optimizer step
    grads_during: dict[int, int]  # per stage: its gradients from its first backward on


def weight_and_optimizer_memory(cfg: Config, costs: dict[int, _StageCost]) -> WeightsAndOptimizer:
    """Parameters, gradients and optimizer state (AdamW: exp_avg, exp_avg_sq, one float32 step
    per tensor) of the stages in `costs`."""
    t = cfg.topology
    m = _microbatches(cfg)
    dp_div = _fsdp_divisor(cfg)
    shard = dp_div > 1
    tensors = [p for c in costs.values() for p in c.stage.tensors]
    params = FLOAT * sum(p.local_numel(t.tp, dp_div) for p in tensors)
    grad_extra = sum(c.grad_extra for c in costs.values())
    # FSDP2 accumulates micro-batches' gradients unsharded (no reduce-scatter until the last
    # one; a pipeline holds them to the end of the step).
    during_div = 1 if (shard and (m > 1 or t.pp > 1)) else dp_div
    grads_during = {
        sid: FLOAT * sum(p.local_numel(t.tp, during_div) for p in c.stage.tensors) + c.grad_extra
        for sid, c in costs.items()
    }
    return WeightsAndOptimizer(
        tensors=tensors,
        params=params,
        optimizer=2 * params + FLOAT * len(tensors),
        grads_final=params + (grad_extra if not shard else 0),
        grads_during=grads_during,
    )


@dataclass
class DataParallelCopies:
    bytes: int
    head_sees_copies: bool  # the copies are still alive during the loss's backward
    notes: list[str]


def data_parallel_copies(cfg: Config, tensors: list[ParamTensor]) -> DataParallelCopies:
    """Unsharded parameter copies that data parallelism holds while forward and backward run."""
    t = cfg.topology
    shard = t.shard_group > 1  # FSDP2 or HSDP: the same gathers, within the shard group
    unsharded = FLOAT * sum(p.local_numel(t.tp) for p in tensors)
    out = DataParallelCopies(0, True, [])
    if t.dp > 1 and not shard:
        out.bytes = unsharded  # `replicate` computes with unsharded copies of every parameter
        out.notes.append("replicate (dp): forward/backward use unsharded copies of the parameters (+1x params)")
    elif shard:
        if t.pp > 1:
            out.bytes = unsharded  # reshard_after_forward=False in a pipeline: all gathered
            out.notes.append("FSDP2 in a pipeline gathers the stage's parameters once and keeps them to the step's end")
        else:
            root = [p for p in tensors if not p.name.startswith("layers.")]
            per_block: dict[str, int] = {}
            for p in tensors:
                if p.name.startswith("layers."):
                    key = p.name.split(".")[1]
                    per_block[key] = per_block.get(key, 0) + FLOAT * p.local_numel(t.tp)
            out.bytes = FLOAT * sum(p.local_numel(t.tp) for p in root) + max(per_block.values(), default=0)
            out.head_sees_copies = False  # the root's parameters are gathered again after the loss's backward
            out.notes.append("FSDP2: the root's parameters and one block's are gathered at a time")
        if _microbatches(cfg) > 1 or t.pp > 1:
            out.notes.append("FSDP2 accumulates gradients unsharded until the last micro-batch's reduce-scatter")
    return out


def autocast_weights(cfg: Config, tensors: list[ParamTensor]) -> int:
    """bfloat16 autocast's copy of every matrix, kept for the step (0 in float32)."""
    if cfg.train.dtype != "bfloat16":
        return 0
    return BF16 * sum(p.local_numel(cfg.topology.tp) for p in tensors if p.matmul)


def batch_memory(cfg: Config, owned: list[Stage]) -> int:
    """The step's int64 inputs and targets, on ranks with the first or the last stage."""
    t = cfg.topology
    if not any(st.first or st.last for st in owned):
        return 0
    return 2 * INT64 * (cfg.train.global_batch_size // t.dp) * cfg.data.seq_len


def receive_buffers(cfg: Config, costs: dict[int, _StageCost]) -> int:
    """One receive buffer per micro-batch and stage boundary direction, allocated once."""
    m, bsd = _microbatches(cfg), _bsd(cfg)
    recv = 0
    local_boundary = False
    for c in costs.values():
        st = c.stage
        if not st.first:
            recv += m * bsd if c.grad_send else 0
            local_boundary |= not c.grad_send
        if not st.last:
            recv += m * bsd if c.out_send else 0
            local_boundary |= not c.out_send
    if local_boundary:
        recv += m * bsd  # a V's turn (same rank): measured one set of buffers for both directions
    return recv


# ------------------------------------------------------------------------------------------
# The schedule, action by action


@dataclass
class Resident:
    """What stays allocated through forward and backward, whatever the schedule is doing."""

    params: int
    optimizer: int
    receive_buffers: int
    batch: int
    dp_copies: DataParallelCopies
    autocast_weights: int
    workspace: int = 0


_ACTION_NAMES = {"F": "forward", "B": "backward", "I": "backward (inputs)", "W": "backward (weights)"}


class ScheduleWalk:
    """Replays pipeline rank `pp_rank`'s actions (rayhybrid/plan/schedule.py), keeping what each
    leaves alive, and, before each, what is alive during it: the largest is the `peak`."""

    def __init__(
        self, cfg: Config, pp_rank: int, costs: dict[int, _StageCost], state: WeightsAndOptimizer, resident: Resident
    ) -> None:
        self.cfg, self.pp_rank, self.costs = cfg, pp_rank, costs
        self.state, self.resident = state, resident
        self.held = {sid: 0 for sid in costs}  # micro-batches in flight per stage
        self.grads_on: set[int] = set()  # stages whose first backward has run
        self.kept_logits = self.kept_sends = self.intermediates = 0
        # From its first backward on, torch's 1F1B keeps one more b x s x d alive: the stage
        # output (first stages) or input gradient (others) of a finished micro-batch, referenced
        # by the last send it made.
        self.stale = 0
        self.peak: RankMemory | None = None
        self.saved_peak, self.max_in_flight = 0, dict(self.held)
        self.host = 0  # most activation bytes in host memory (train.offload_activations)

    def run(self) -> RankMemory:
        t = self.cfg.topology
        m, v = _microbatches(self.cfg), Layout.of(self.cfg).virtual_stages
        for kind, sid, mb in rank_actions(t.schedule, t.pp, self.pp_rank, m, v):
            self.step(kind, sid, mb)
        if any(c.stage.last for c in self.costs.values()) and t.pp > 1:
            # After the last backward, torch's schedule concatenates every micro-batch's logits
            # into the step's output (the trainer drops it): twice the kept logits for a moment.
            self.consider("merge of the micro-batches' logits after the last backward", self.kept_logits)
            # (`consider` counts the kept logits once already; gradients are all there by now.)
        assert self.peak is not None
        return self.peak

    def consider(self, where: str, transient: int) -> None:
        """What is alive during `where`, with `transient` bytes of its own: the peak if highest."""
        saved = sum(self.costs[sid].held * n for sid, n in self.held.items()) + self.intermediates
        self.saved_peak = max(self.saved_peak, saved + self.kept_logits)
        self.host = max(self.host, sum(self.costs[sid].host * n for sid, n in self.held.items()))
        for sid, n in self.held.items():
            self.max_in_flight[sid] = max(self.max_in_flight[sid], n)
        res = self.resident
        now = RankMemory(
            pp_rank=self.pp_rank,
            stages=list(self.costs),
            params=res.params,
            grads=sum(self.state.grads_during[sid] for sid in self.grads_on),
            optimizer=res.optimizer,
            activations=saved,
            pipeline_buffers=res.receive_buffers + self.kept_logits + self.kept_sends + self.stale,
            transient=transient,
            batch=res.batch,
            dp_buffers=res.dp_copies.bytes,
            autocast_weights=res.autocast_weights,
            workspace=res.workspace,
            peak_at=where,
            in_flight=dict(self.held),
        )
        if self.peak is None or now.total > self.peak.total:
            self.peak = now

    def step(self, kind: str, sid: int, mb: int) -> None:
        """One action: F(orward), B(ackward), or a zero-bubble schedule's I(nputs) and W(eights)."""
        c = self.costs[sid]
        where = f"{_ACTION_NAMES[kind]} of stage {sid}, micro-batch {mb}"
        if kind == "F":
            self.held[sid] += 1
            self.kept_logits += c.logits
            self.consider(where, c.fwd_transient)
        elif kind == "I" and c.stage.first:
            return  # nothing to do: W runs the first stage's whole backward
        elif kind == "B" or (kind == "W" and c.stage.first):
            # Relative to everything the micro-batch saved: the loss's gradients first, then the
            # output projection's, the blocks' (the head's activations gone), and at the end the
            # embedding's (the whole micro-batch's gone).
            candidates = [c.block_transient - c.head_saved, c.embedding_transient - c.held]
            if c.stage.last:
                extra = 0 if self.resident.dp_copies.head_sees_copies else self.resident.dp_copies.bytes
                candidates += [c.head_transient - extra, c.head_transient // 2, c.output_transient]
            self.consider(where, max(candidates))
            self.held[sid] -= 1
            self.grads_on.add(sid)
            if self.cfg.topology.schedule == "1f1b":
                self.stale = _bsd(self.cfg) if self.cfg.topology.pp > 1 else 0
            else:
                self.kept_sends += c.grad_send + c.out_send
        elif kind == "I":
            # The loss's gradients at first; then the kept output gradients plus a block's.
            self.consider(where, max(c.head_transient, c.w_intermediates + c.block_transient))
            self.intermediates += c.w_intermediates
            self.kept_sends += c.grad_send
        else:  # W
            self.consider(where, 0)
            self.intermediates -= c.w_intermediates
            self.held[sid] -= 1
            self.grads_on.add(sid)
            self.kept_sends += c.out_send


# ------------------------------------------------------------------------------------------
# The optimizer step, and the sum


def optimizer_step_memory(
    cfg: Config, pp_rank: int, state: WeightsAndOptimizer, pipeline_buffers: int, cuda: bool, workspace: int = 0
) -> RankMemory:
    """What is alive during the optimizer step: final gradients, the buffers still kept
    (`pipeline_buffers`), AdamW's temporaries. On CPU torch runs AdamW tensor by tensor:
    measured twice the largest tensor plus one MLP matrix (the largest matrix of a block,
    whatever the model names it). On CUDA the foreach implementation makes the square roots of
    all exp_avg_sq at once: about one copy of the parameters."""
    tp, dp_div = cfg.topology.tp, _fsdp_divisor(cfg)
    sizes = sorted(FLOAT * p.local_numel(tp, dp_div) for p in state.tensors)
    mlp = max((FLOAT * p.local_numel(tp, dp_div) for p in state.tensors if p.name.startswith("layers.")), default=0)
    owned = list(state.grads_during)
    return RankMemory(
        pp_rank=pp_rank,
        stages=owned,
        params=state.params,
        grads=state.grads_final,
        optimizer=state.optimizer,
        activations=0,
        pipeline_buffers=pipeline_buffers,
        transient=state.params if cuda else 2 * sizes[-1] + mlp,
        batch=0,
        dp_buffers=0,
        autocast_weights=0,
        peak_at="optimizer step",
        in_flight={sid: 0 for sid in owned},
        workspace=workspace,
    )


def resident_tensors(cfg: Config, state: WeightsAndOptimizer) -> list[int]:
    """The sizes of the tensors allocated for the whole step: each parameter, its gradient, its
    two AdamW moments (float32), and autocast's bfloat16 copy of each matrix."""
    tp, dp_div = cfg.topology.tp, _fsdp_divisor(cfg)
    sizes = []
    for p in state.tensors:
        sizes += [FLOAT * p.local_numel(tp, dp_div)] * 4
        if p.matmul and cfg.train.dtype == "bfloat16":
            sizes.append(BF16 * p.local_numel(tp))
    return sizes


def largest_allocation(cfg: Config, costs: dict[int, _StageCost], state: WeightsAndOptimizer) -> int:
    """The step's largest single tensor: a parameter's (float32, or its gradient made whole),
    the float32 logits of the loss and their gradients (last stage; one chunk's with
    train.loss_chunk), the MLP's hidden state."""
    tp, b, s = cfg.topology.tp, cfg.train.micro_batch_size, cfg.data.seq_len
    act = BF16 if cfg.train.dtype == "bfloat16" else FLOAT
    sizes = [FLOAT * p.numel for p in state.tensors]
    sizes.append(act * b * s * _ceil(cfg.model.hidden_dim, tp))
    if any(c.stage.last for c in costs.values()):
        sizes.append(FLOAT * (loss_chunk(cfg) or b * s) * vocab_local(cfg))
    return max(sizes)


def rank_memory(cfg: Config, pp_rank: int, cuda: bool = False) -> RankMemory:
    """Peak memory of every rank of pipeline rank `pp_rank` (its dp and tp ranks hold the same).

    Walks the schedule's actions (rayhybrid/plan/schedule.py) and adds up, at each forward and
    backward, what is alive:
    - parameters; optimizer state (AdamW: 2 x parameters + one float32 step per tensor); the
      gradients of the stages whose first backward has run (FSDP2: unsharded while the
      micro-batches accumulate);
    - activations: what autograd saves for each micro-batch in flight (`block_bytes`,
      `head_bytes`; with checkpointing each block's input only); zero bubble: plus the output
      gradients kept from I to W; with train.offload_activations on CUDA, the blocks' share in
      host memory (`host_activations`) and two blocks' worth in flight instead;
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

    `cuda` also counts what CUDA's kernels save (`estimate.cuda_not_saved`: fused
    normalisations keep less), cuBLAS's workspaces (`CUBLAS_WORKSPACE`), and the peak's
    `reserved` bytes: the caching allocator's rounding and fragmentation on top of the live
    bytes (rayhybrid/plan/allocator.py), what decides whether the step fits a GPU.
    """
    t = cfg.topology
    costs = stage_costs(cfg, pp_rank, stages(cfg), cuda)
    offload = offload_activations(cfg, costs, cuda)
    state = weight_and_optimizer_memory(cfg, costs)
    copies = data_parallel_copies(cfg, state.tensors)
    autocast = autocast_weights(cfg, state.tensors)
    notes = list(copies.notes) + ([offload] if offload else [])
    if cfg.train.dtype == "bfloat16":
        notes.append("bfloat16 autocast keeps a bfloat16 copy of every matrix for the step")
    recv = receive_buffers(cfg, costs)
    batch = batch_memory(cfg, [c.stage for c in costs.values()])
    workspace = 2 * CUBLAS_WORKSPACE if cuda else 0
    resident = Resident(state.params, state.optimizer, recv, batch, copies, autocast, workspace)
    walk = ScheduleWalk(cfg, pp_rank, costs, state, resident)
    peak = walk.run()
    step = optimizer_step_memory(cfg, pp_rank, state, recv + walk.kept_logits, cuda, workspace)
    if step.total > peak.total:
        peak = step
    if t.schedule == "gpipe" and t.pp > 1 and not peak.grads:
        notes.append("GPipe peaks before the first backward ends: no gradients exist yet at the peak")
    peak.notes, peak.saved_peak, peak.max_in_flight = notes, walk.saved_peak, walk.max_in_flight
    peak.host_activations = walk.host
    if cuda:
        largest = largest_allocation(cfg, costs, state)
        peak.reserved = allocator.reserved_bytes(peak.total, resident_tensors(cfg, state), largest)
    return peak
