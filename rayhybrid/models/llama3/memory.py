"""The planner's memory model of the Llama decoder (no torch): its parameters with the TP plan of
parallelize.py, and what autograd keeps for backward, counted from its operators the way the
GPT's is (rayhybrid/models/gpt/memory.py) and checked against the trainer's meter
(tests/test_llama.py).

Symbols: s sequence length, d model width, a attention width (heads x head_dim), k key/value
width (n_kv_heads x head_dim), h MLP width, H heads, V vocabulary, t tp.
"""

from __future__ import annotations

from rayhybrid.models.spec import ParamTensor, ceil_div

FLOAT = 4
BF16 = 2
INT64 = 8


class LlamaMemory:
    def param_tensors(self, model, seq_len: int, layers: range, first: bool, last: bool) -> list[ParamTensor]:
        d, a, k, h, v = model.d_model, model.attn_dim, model.kv_dim, model.hidden_dim, model.vocab_size
        out: list[ParamTensor] = []
        if first:
            out.append(ParamTensor("tok_embeddings.weight", (v, d), 0, model.tie_embeddings and last))
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
            if not (model.tie_embeddings and first):
                out.append(ParamTensor("output.weight", (v, d), 0, True))
        return out

    def block_bytes(self, cfg, tp: int, dtype: str) -> int:
        """float32: both RMSNorms' inputs (2 s d) and 1/rms (2 s); their outputs, kept by the
        linear layers that read them (2 s d: q, k and v share one, w1 and w3 the other); q and k
        after the rotation, v and the attention output (2 s a + 2 s k); the attention's
        log-sum-exp (H x s); w1's and w3's outputs, the SiLU and the product w2 reads (4 s h).
        Under tp a rank keeps 1/t of the heads and the hidden units; the norms are replicated.

        bfloat16 (autocast): the residual stream, the norms and the log-sum-exp stay float32;
        each linear keeps its own bfloat16 copy of its input (q, k, v, w1, w3: 5 s d x 2 bytes)
        and the rest is bfloat16."""
        m, s, t = cfg.model, cfg.data.seq_len, tp
        d, a, k, h = m.d_model, m.attn_dim, m.kv_dim, m.hidden_dim
        sharded = ceil_div(2 * s * a + 2 * s * k + 4 * s * h, t)
        lse = ceil_div(m.n_heads, t) * s
        if dtype == "bfloat16":
            return FLOAT * (2 * s * d + 2 * s + lse) + BF16 * (5 * s * d + sharded)
        return FLOAT * (4 * s * d + 2 * s + lse + sharded)

    def head_bytes(self, cfg, tp: int, dtype: str, vocab_local: int) -> int:
        """The final RMSNorm's input (s d) and 1/rms (s), its output (s d, bfloat16: the output
        projection's copy), the logits' log-softmax (s V / t with loss parallelism, float32) and
        the flattened targets (s int64)."""
        m, s, v = cfg.model, cfg.data.seq_len, vocab_local
        norm_out = BF16 if dtype == "bfloat16" else FLOAT
        return FLOAT * (s * m.d_model + s + s * v) + norm_out * s * m.d_model + INT64 * s

    def block_transient(self, cfg, tp: int, dtype: str) -> int:
        """The MLP's backward: the gradients of the product, of w1's and of w3's outputs."""
        act = BF16 if dtype == "bfloat16" else FLOAT
        return 3 * act * cfg.data.seq_len * ceil_div(cfg.model.hidden_dim, tp)

    def weight_transient(self, cfg, tp: int) -> int:
        return FLOAT * cfg.model.d_model * ceil_div(cfg.model.hidden_dim, tp)

    def w_outputs(self, cfg, tp: int) -> int:
        """q, k, v, wo, w1, w3, w2 and both RMSNorms' output gradients."""
        m = cfg.model
        return FLOAT * cfg.data.seq_len * (ceil_div(m.attn_dim + 2 * m.kv_dim + 2 * m.hidden_dim, tp) + 4 * m.d_model)


MEMORY = LlamaMemory()
