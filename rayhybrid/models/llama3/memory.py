"""The planner's memory model of the Llama decoder (no torch): its parameters with the TP plan of
parallelize.py, and what autograd keeps for backward, counted from its operators the way the
GPT's is (rayhybrid/models/gpt/memory.py) and checked against the trainer's meter on CPU with
torch 2.13 (tests/test_llama_plan.py). On llama3_debug the predicted per-rank peaks came within
0.1% of the measured ones for dp1, tp2, pp2 (1F1B and interleaved 1F1B), pp2_tp2, dp2 replicate,
dp4 FSDP2, a tied output on one tp rank and float32 checkpointing (in bfloat16 too where it was
run: dp1, tp2, pp2_tp2); dp2_pp2_tp2 -0.5%, a tied output under tp2 +0.6%, dp2 FSDP2 +0.7%, ZB-V
+0.3% / +1.1%, bfloat16 checkpointing -0.4% to +1.7% (and see `weight_transient`).

What torch 2.13 saves, found by listing the saved tensors of a block and by the meter:

- `nn.RMSNorm` is not one fused kernel on CPU: it runs as pow, mean, add, rsqrt, mul, mul and
  keeps its input, 1/rms (s) and the normalised input x/rms (s x d, for the weight's gradient),
  all float32 (the residual stream's dtype, under autocast too); its output is kept by the
  linear layers that read it.
- `scaled_dot_product_attention` with `enable_gqa=True` takes the CPU flash kernel
  (`_scaled_dot_product_flash_attention_for_cpu`), which reads the n_kv_heads keys and values
  as they are: it keeps q (s x a), k and v (s x k each, not repeated to n_heads), its output and
  its log-sum-exp (H x s, float32), never an s x s attention matrix.
- The rotary cos and sin (s x head_dim each, in the activation dtype) are recomputed by every
  block's forward and kept by the rotation's multiplications: one pair per block and micro-batch,
  whatever the micro-batch size (not per sample).
- The SwiGLU MLP keeps w1's and w3's outputs, the SiLU and the product w2 reads (4 s x h).

Symbols: s sequence length, d model width, a attention width (heads x head_dim), k key/value
width (n_kv_heads x head_dim), h MLP width, H heads, V vocabulary, t tp, b micro-batch.
"""

from __future__ import annotations

from rayhybrid.models.llama3.settings import kv_dim, settings
from rayhybrid.models.spec import ParamTensor, ceil_div

FLOAT = 4  # float32: the residual stream, the RMSNorms, the log-sum-exp, the loss
BF16 = 2
INT64 = 8  # token ids


class LlamaMemory:
    def param_tensors(self, model, seq_len: int, layers: range, first: bool, last: bool) -> list[ParamTensor]:
        """The TP plan of rayhybrid/models/llama3/parallelize.py: token embedding RowwiseParallel
        (vocab rows), wq, wk, wv, w1 and w3 ColwiseParallel (output rows: heads, KV heads,
        hidden units), wo and w2 RowwiseParallel (input columns), output ColwiseParallel (vocab
        rows); the RMSNorm weights replicated. Rotary embeddings have no parameters. A tied
        output (stage with both ends) is the token embedding itself: one tensor, read by a
        linear layer (autocast keeps a bfloat16 copy of it)."""
        s = settings(model)
        d, a, k, h, v = model.d_model, model.attn_dim, kv_dim(model, s), model.hidden_dim, model.vocab_size
        out: list[ParamTensor] = []
        if first:
            out.append(ParamTensor("tok_embeddings.weight", (v, d), 0, s.tie_embeddings and last))
        for i in layers:
            p = f"layers.{i}."
            out += [
                ParamTensor(p + "attention_norm.weight", (d,), None),
                ParamTensor(p + "attention.wq.weight", (a, d), 0, True),
                ParamTensor(p + "attention.wk.weight", (k, d), 0, True),
                ParamTensor(p + "attention.wv.weight", (k, d), 0, True),
                ParamTensor(p + "attention.wo.weight", (d, a), 1, True),
                ParamTensor(p + "ffn_norm.weight", (d,), None),
                ParamTensor(p + "feed_forward.w1.weight", (h, d), 0, True),
                ParamTensor(p + "feed_forward.w2.weight", (d, h), 1, True),
                ParamTensor(p + "feed_forward.w3.weight", (h, d), 0, True),
            ]
        if last:
            out.append(ParamTensor("norm.weight", (d,), None))
            if not (s.tie_embeddings and first):
                out.append(ParamTensor("output.weight", (v, d), 0, True))
        return out

    def block_bytes(self, cfg, tp: int, dtype: str) -> int:
        """What autograd keeps for backward per sample in one block, counted from its operators
        (and equal to the meter's count: tests/test_llama_plan.py).

        float32: both RMSNorms' inputs, their x/rms and their outputs (6 s d: q, k and v share
        one output, w1 and w3 the other; under tp it is one replicated tensor) and 1/rms
        (2 s); q and k after the rotation, v, and the attention output that wo reads
        (2 s a + 2 s k); the log-sum-exp (H s); w1's and w3's outputs, the SiLU and the product
        (4 s h). Under tp a rank keeps 1/t of the heads, KV heads and hidden units; the norms
        are replicated.

        bfloat16 (autocast): the RMSNorms run in float32 and keep their inputs, x/rms and 1/rms
        in float32 (4 s d + 2 s), and so is the log-sum-exp; their float32 outputs are not kept:
        each linear keeps its own bfloat16 copy of its input instead (wq, wk, wv, w1, w3:
        5 s d x 2 bytes); q, k, v, the attention output and the MLP's four are bfloat16.

        Plus the rotary cos and sin (2 s x head_dim in the activation dtype, replicated under
        tp), which do not grow with the batch: a micro-batch of b keeps one pair per block, so
        this returns their share per sample, ceil(pair / b), and b x block_bytes is the
        micro-batch's exact count."""
        m, s, t = cfg.model, cfg.data.seq_len, tp
        d, a, k, h = m.d_model, m.attn_dim, kv_dim(m), m.hidden_dim
        sharded = ceil_div(2 * s * a + 2 * s * k + 4 * s * h, t)
        lse = ceil_div(m.n_heads, t) * s
        act = BF16 if dtype == "bfloat16" else FLOAT
        rope = ceil_div(act * 2 * s * m.head_width, max(1, cfg.train.micro_batch_size))
        if dtype == "bfloat16":
            return FLOAT * (4 * s * d + 2 * s + lse) + BF16 * (5 * s * d + sharded) + rope
        return FLOAT * (6 * s * d + 2 * s + lse + sharded) + rope

    def head_bytes(self, cfg, tp: int, dtype: str, vocab_local: int, chunked: bool = False) -> int:
        """Per sample after the blocks: the final RMSNorm's input, x/rms and 1/rms (2 s d + s,
        float32) and its output, kept by the output projection (s d float32; bfloat16: the
        projection's own bfloat16 copy); the log-softmax of the logits (s V, float32 whatever
        the dtype: the loss casts the logits; s V / t with loss parallelism); the targets,
        flattened into a copy (s int64). `chunked` (train.loss_chunk): the norm's, and the
        loss's gradient to the hidden state (s d float32) in place of the rest."""
        m, s, v = cfg.model, cfg.data.seq_len, vocab_local
        if chunked:
            return FLOAT * (3 * s * m.d_model + s)
        if dtype == "bfloat16":
            return FLOAT * (2 * s * m.d_model + s + s * v) + BF16 * s * m.d_model + INT64 * s
        return FLOAT * (3 * s * m.d_model + s + s * v) + INT64 * s

    def cuda_not_saved(self, cfg, tp: int, dtype: str) -> tuple[int, int]:
        """On CUDA `nn.RMSNorm` is one fused kernel (torch's `rms_norm` calls
        `_fused_rms_norm`, which has a CUDA kernel; on CPU it is the composite of pow, mean,
        rsqrt and muls counted above): its backward, `_fused_rms_norm_backward(grad, input,
        normalized_shape, rstd, weight)`, keeps the input and 1/rms, not x/rms. So a block keeps
        2 s d float32 fewer (both norms), the head s d fewer (the final norm), whatever the
        dtype (the norms run in float32 under autocast too; replicated under tp). Measured on
        an H200 (Llama 3.2 1B, seq 2048, bfloat16): the peaks grew 6,554 MB per sample where
        the CPU count gives 7,082: 528 MB = (16 x 2 + 1) x 2048 x 2048 x 4 B."""
        sd = FLOAT * cfg.data.seq_len * cfg.model.d_model
        return 2 * sd, sd

    def block_transient(self, cfg, tp: int, dtype: str) -> int:
        """The MLP's backward, per sample: two s x h gradients at once (of the SiLU and of w3's
        output, while the product's saved tensor is freed), in the activation dtype. Exact in
        float32 (checkpointed runs, where a block's backward is the peak, match the meter to
        the byte); in bfloat16 an approximation, the order in which torch frees and casts
        differing from float32's (whole-step peaks with checkpointing -0.4% to +1.7%)."""
        act = BF16 if dtype == "bfloat16" else FLOAT
        return 2 * act * cfg.data.seq_len * ceil_div(cfg.model.hidden_dim, tp)

    def weight_transient(self, cfg, tp: int) -> int:
        """w2's new gradient (d x h / t) while the product's gradient lives. float32: it is
        added to the accumulated one before the SiLU's backward, so it only counts where
        d > b x s (b s h + d h above the 2 b s h of `block_transient`). bfloat16: its
        bfloat16 gradient waits for the autocast copy's cast back to float32 (below), d h x 2
        bytes.

        Not modelled (rayhybrid/plan/peak_memory.py's walk, the same for every model): in a step's
        second and later micro-batches, torch accumulates the gradients of autocast's cached
        bfloat16 weight copies only at the end of the backward (their cast's backward node was
        made by the first micro-batch's forward and runs last), so up to one bfloat16 copy of
        the stage's matrices is alive late in each backward; with activation checkpointing and
        small activations this can be the peak (b=1, s=32 on llama3_debug: measured 4.4% above
        the prediction)."""
        h = ceil_div(cfg.model.hidden_dim, tp)
        if cfg.train.dtype == "bfloat16":
            return BF16 * cfg.model.d_model * h
        b, s = max(1, cfg.train.micro_batch_size), cfg.data.seq_len
        return max(0, FLOAT * cfg.model.d_model * h - FLOAT * b * s * h)

    def w_outputs(self, cfg, tp: int) -> int:
        """The gradients of the outputs of every operator with weights, kept from a zero-bubble
        schedule's input backward to its weight backward, per sample: q, k, v, w1, w3 (s (a +
        2 k + 2 h) / t) and wo, w2 (2 s d, the all-reduced outputs), in the activation dtype;
        the two RMSNorms' weight multiplications (2 s d, float32). Measured: within 1.1% for
        float32 ZB-V on llama3_debug (the walk keeps them a little longer than torch does);
        bfloat16 less exact (-3.5% to +4.3% on ZB-V and interleaved ZB)."""
        m, s = cfg.model, cfg.data.seq_len
        act = BF16 if cfg.train.dtype == "bfloat16" else FLOAT
        linear = act * s * (ceil_div(m.attn_dim + 2 * kv_dim(m) + 2 * m.hidden_dim, tp) + 2 * m.d_model)
        return linear + FLOAT * s * 2 * m.d_model


MEMORY = LlamaMemory()
