"""Hugging Face checkpoints in and out, for any model whose spec has an `HFAdapter` (no torch here).

- In: `model.init_from=<dir>` (config.json + safetensors, what `save_pretrained` writes). Its
  config.json sets the model's shape (`resolve_init_from`, at composition); each rank then reads
  only its own shards of the safetensors through DCP's `HuggingFaceStorageReader`
  (rayhybrid/trainer/hf_load.py).
- Out: `python -m rayhybrid.export` (rayhybrid/export.py).
"""

from __future__ import annotations


class HFAdapter:
    """Names and config fields of one model family, to and from Hugging Face's."""

    architectures: tuple[str, ...] = ()
    model_type: str = ""

    def to_hf(self, name: str) -> str:
        """Hugging Face's name of our parameter `name` (full model name)."""
        raise NotImplementedError

    def from_hf(self, name: str) -> str | None:
        """Our name of Hugging Face's parameter `name`; None: not a parameter of ours (buffers)."""
        raise NotImplementedError

    def config_from_hf(self, hf: dict) -> dict:
        """ModelConfig fields from config.json; ValueError for what the model cannot represent."""
        raise NotImplementedError

    def config_to_hf(self, model, seq_len: int) -> dict:
        """config.json for `model` (a ModelConfig)."""
        raise NotImplementedError
