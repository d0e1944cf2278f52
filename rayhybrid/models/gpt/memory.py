"""The planner's memory model of the GPT (no torch): its parameters with their TP split, and what
autograd keeps for backward, counted from its operators and checked against the trainer's meter
(tests/test_memory.py, tests/test_plan.py).

Symbols: s sequence length, d model width, a attention width (heads x head_dim), h MLP width,
H heads, V vocabulary, t tp.
"""

from __future__ import annotations

from rayhybrid.models.spec import ParamTensor, ceil_div

FLOAT = 4  # float32: the residual stream, LayerNorm statistics, the loss
BF16 = 2
INT64 = 8  # token ids


class GPTMemory:
    def param_tensors(self, model, seq_len: int, layers: range, first: bool, last: bool) -> list[ParamTensor]:
        """The TP plan of rayhybrid/models/gpt/parallelize.py: token embedding RowwiseParallel
        (vocab rows), q/k/v and w1 ColwiseParallel (output rows), wo and w2 RowwiseParallel
        (input columns), output ColwiseParallel (vocab rows); LayerNorms and position embeddings
        are plain replicated tensors."""
        d, a, h, v = model.d_model, model.attn_dim, model.hidden_dim, model.vocab_size
        out: list[ParamTensor] = []
        if first:
            out += [
                ParamTensor("tok_embeddings.weight", (v, d), 0),
                ParamTensor("pos_embeddings.weight", (seq_len, d), None),
            ]
        for i in layers:
            p = f"layers.{i}."
            out += [
                ParamTensor(p + "attn_norm.weight", (d,), None),
                ParamTensor(p + "attn_norm.bias", (d,), None),
                ParamTensor(p + "attn.wq.weight", (a, d), 0, True),
                ParamTensor(p + "attn.wk.weight", (a, d), 0, True),
                ParamTensor(p + "attn.wv.weight", (a, d), 0, True),
                ParamTensor(p + "attn.wo.weight", (d, a), 1, True),
                ParamTensor(p + "mlp_norm.weight", (d,), None),
                ParamTensor(p + "mlp_norm.bias", (d,), None),
                ParamTensor(p + "mlp.w1.weight", (h, d), 0, True),
                ParamTensor(p + "mlp.w2.weight", (d, h), 1, True),
            ]
        if last:
            out += [
                ParamTensor("norm.weight", (d,), None),
                ParamTensor("norm.bias", (d,), None),
                ParamTensor("output.weight", (v, d), 0, True),
            ]
        return out

    def block_bytes(self, cfg, tp: int, dtype: str) -> int:
        """What autograd keeps for backward per sample in one block, counted from its operators.

        float32: the inputs of the two LayerNorms (2 s d) and their mean and rstd (4 s); their
        outputs, kept by the linear layers that read them (2 s d; under tp the attention's input
        is one replicated tensor that q, k and v share); q, k, v (3 s a) and the attention output
        that `wo` reads (s a); the attention's log-sum-exp (H x s); the MLP's first linear output
        and its GELU (2 s h). The residual adds keep nothing. Under tp a rank keeps 1/t of q/k/v,
        the attention output, the log-sum-exp and the MLP hidden state; the LayerNorm inputs and
        outputs are replicated.

        bfloat16 (autocast): the residual stream, the LayerNorm inputs and statistics and the
        log-sum-exp stay float32; each linear keeps its own bfloat16 copy of its input (q, k, v
        and w1 each cast the LayerNorm output: 4 s d x 2 bytes); q, k, v, the attention output
        and the MLP hidden states are bfloat16.
        """
        m, s, t = cfg.model, cfg.data.seq_len, tp
        d, a, h, heads = m.d_model, m.attn_dim, m.hidden_dim, m.n_heads
        sharded = ceil_div(4 * s * a + 2 * s * h, t)
        if dtype == "bfloat16":
            return FLOAT * (2 * s * d + 4 * s + ceil_div(heads, t) * s) + BF16 * (4 * s * d + sharded)
        return FLOAT * (s * (4 * d + 4) + sharded + ceil_div(heads, t) * s)

    def head_bytes(self, cfg, tp: int, dtype: str, vocab_local: int, chunked: bool = False) -> int:
        """Per sample after the blocks: the final LayerNorm's input and output (2 s d) and stats
        (2 s); the log-softmax of the logits (s V, float32 whatever the dtype: the loss casts the
        logits; s V / t with loss parallelism); the targets, flattened into a copy (s int64: they
        are a strided slice of the token stream). bfloat16: the LayerNorm output is kept as the
        output projection's bfloat16 copy. `chunked` (train.loss_chunk): the LayerNorm's input
        and stats, and the loss's gradient to the hidden state (s d float32) in place of the rest."""
        m, s, v = cfg.model, cfg.data.seq_len, vocab_local
        if chunked:
            return FLOAT * (2 * s * m.d_model + 2 * s)
        if dtype == "bfloat16":
            return FLOAT * (s * m.d_model + 2 * s + s * v) + BF16 * s * m.d_model + INT64 * s
        return FLOAT * (2 * s * m.d_model + 2 * s + s * v) + INT64 * s

    def cuda_not_saved(self, cfg, tp: int, dtype: str) -> tuple[int, int]:
        """Nothing: `nn.LayerNorm` is one kernel on CPU and CUDA alike (input, mean and rstd
        kept), and on an H200 the GPT's peaks grew by what the CPU count gives per sample."""
        return 0, 0

    def block_transient(self, cfg, tp: int, dtype: str) -> int:
        """The MLP hidden state's gradient, per sample."""
        act = BF16 if dtype == "bfloat16" else FLOAT
        return act * cfg.data.seq_len * ceil_div(cfg.model.hidden_dim, tp)

    def weight_transient(self, cfg, tp: int) -> int:
        """w2's gradient (d x h / t), made whole while the MLP hidden state's gradient lives."""
        return FLOAT * cfg.model.d_model * ceil_div(cfg.model.hidden_dim, tp)

    def w_outputs(self, cfg, tp: int) -> int:
        """q, k, v, wo, w1, w2 and both LayerNorms' output gradients."""
        m = cfg.model
        return FLOAT * cfg.data.seq_len * (ceil_div(3 * m.attn_dim + m.hidden_dim, tp) + 4 * m.d_model)


MEMORY = GPTMemory()
