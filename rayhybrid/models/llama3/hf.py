"""Llama <-> Hugging Face's LlamaForCausalLM: parameter names and config.json fields (no torch).

The rotary embeddings are in Hugging Face's rotate-half layout already, so weights map one to
one: no permutation of q and k (torchtitan's interleaved RoPE needs one).
"""

from __future__ import annotations

import re

from rayhybrid.models.hf import HFAdapter
from rayhybrid.models.llama3.settings import kv_heads, settings

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_OURS = re.compile(r"layers\.(\d+)\.(.+)")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.(.+)")

# config.json key -> ModelConfig field, or LlamaSettings field (n_kv_heads, norm_eps, tie_embeddings)
_FIELDS = {
    "num_hidden_layers": "n_layers",
    "hidden_size": "d_model",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "intermediate_size": "ffn_dim",
    "vocab_size": "vocab_size",
    "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_embeddings",
    "max_position_embeddings": "max_positions",
    "head_dim": "head_dim",
}


# transformers' LlamaConfig defaults: what a config.json that leaves a key out means.
HF_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
}


_KEY_OF = {field: key for key, field in _FIELDS.items()} | {"rope_theta": "rope_theta", "rope_scaling": "rope_scaling"}
"""ModelConfig or LlamaSettings field -> the config.json key that sets it."""


class LlamaHF(HFAdapter):
    architectures = ("LlamaForCausalLM",)
    model_type = "llama"

    def hf_key(self, field: str) -> str:
        return _KEY_OF.get(field, field)

    def to_hf(self, name: str) -> str:
        if name in _TOP:
            return _TOP[name]
        match = _OURS.fullmatch(name)
        if match is None or match.group(2) not in _LAYER:
            raise KeyError(f"no Hugging Face name for parameter {name!r}")
        return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}"

    def from_hf(self, name: str) -> str | None:
        if name in _TOP_BACK:
            return _TOP_BACK[name]
        match = _THEIRS.fullmatch(name)
        if match is None:
            return None
        rest = _LAYER_BACK.get(match.group(2))
        return None if rest is None else f"layers.{match.group(1)}.{rest}"

    def tied(self, model) -> bool:
        return settings(model).tie_embeddings

    def config_from_hf(self, hf: dict) -> dict:
        """ModelConfig and LlamaSettings fields (flat) from a config.json (transformers 4.x or 5.x layout); a key it leaves
        out means transformers' default, as it would for LlamaForCausalLM."""
        hf = {**HF_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
        hf.setdefault("num_key_value_heads", hf["num_attention_heads"])
        out = {field: hf[key] for key, field in _FIELDS.items() if key in hf and hf[key] is not None}
        rope = dict(hf.get("rope_parameters") or {})
        scaling = dict(hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or hf.get("rope_theta")
        if theta is not None:
            out["rope_theta"] = float(theta)
        params = {**scaling, **rope}
        rope_type = params.pop("rope_type", params.pop("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope type {rope_type!r} (only default and llama3 are supported)")
        if rope_type == "llama3":
            out["rope_scaling"] = {
                k: params[k]
                for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                if k in params
            }
        else:
            out["rope_scaling"] = {}
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError("attention_bias/mlp_bias (rayhybrid's Llama has no biases)")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} (rayhybrid's Llama uses silu)")
        if "head_dim" in out and out["head_dim"] == out.get("d_model", 0) // max(1, out.get("n_heads", 1)):
            out["head_dim"] = 0  # the default width: keep the config minimal
        return out

    def config_to_hf(self, model, seq_len: int) -> dict:
        s = settings(model)
        rope = {"rope_type": "default", "rope_theta": float(s.rope_theta)}
        if s.rope_scaling:
            rope = {"rope_type": "llama3", "rope_theta": float(s.rope_theta), **dict(s.rope_scaling)}
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": model.vocab_size,
            "hidden_size": model.d_model,
            "intermediate_size": model.hidden_dim,
            "num_hidden_layers": model.n_layers,
            "num_attention_heads": model.n_heads,
            "num_key_value_heads": kv_heads(model, s),
            "head_dim": model.head_width,
            "hidden_act": "silu",
            "max_position_embeddings": model.max_positions or seq_len,
            "rms_norm_eps": float(s.norm_eps),
            "rope_parameters": rope,
            "tie_word_embeddings": bool(s.tie_embeddings),
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": "float32",
        }


HF = LlamaHF()
