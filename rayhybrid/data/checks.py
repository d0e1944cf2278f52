"""The checks data=prepared must pass before a run starts, in two parts:

- `check_prepared_settings` (from `rayhybrid.data.sources.check_data_settings`): the settings
  alone, data.path or a data.mix of paths with usable weights, no data.val_fraction. Reads
  nothing, so a layout search runs it for every candidate.
- `check_prepared_datasets` (from `rayhybrid.data.sources.check_data_files`, once per command):
  every dataset is committed, its tokenizer fits the model and agrees with `model.init_from`'s,
  the datasets of a mixture share one tokenizer, and each stream the run reads holds a window.
  It reads each dataset's index and documents' lengths (small files), never the tokens.

Each failure is one ConfigError naming the setting. No torch.
"""

from __future__ import annotations

import hashlib
import json
import os

from rayhybrid.config.schema import Config
from rayhybrid.data.packing import BLOCK, Part, mixture_entries, training_documents
from rayhybrid.data.prepared import PreparedDataset, open_prepared, read_index
from rayhybrid.errors import ConfigError


def check_prepared_settings(cfg: Config) -> None:
    """data.path or data.mix (not both), each entry with a path and a usable weight, and no
    data.val_fraction (prepared datasets hold documents out when they are prepared)."""
    d = cfg.data
    if d.val_fraction:
        raise ConfigError(
            "data.val_fraction",
            "prepared datasets hold documents out when they are prepared: rerun python -m rayhybrid.prepare with "
            "val_fraction=0.01, or set data.val_path=<a prepared dataset>, and remove data.val_fraction",
        )
    if d.mix and d.path:
        raise ConfigError("data.mix", "give data.path (one dataset) or data.mix (a mixture), not both")
    if not d.mix and not d.path:
        raise ConfigError(
            "data.path", "data=prepared needs data.path=<prepared dataset URL> or data.mix=[{path:...,weight:...},...]"
        )
    entries = mixture_entries(d)
    total = sum(max(w, 0.0) for _, _, w in entries)
    for setting, url, weight in entries:
        if not url:
            raise ConfigError(setting, "each data.mix entry needs a path: {path:<prepared dataset URL>,weight:<w>}")
        if not weight > 0 or weight / total < 1 / BLOCK:
            raise ConfigError(
                setting.replace(".path", ".weight"),
                f"weight {weight:g} must be positive and at least 1/{BLOCK} of the total {total:g}; raise it or drop it",
            )


def check_prepared_datasets(cfg: Config) -> None:
    """The datasets the settings name (after `check_prepared_settings`): each opened once."""
    d = cfg.data
    datasets = [
        (setting, PreparedDataset(read_index(url, d.storage_options, setting), d.storage_options, setting))
        for setting, url, _ in mixture_entries(d)
    ]
    first = datasets[0][1]
    for setting, ds in datasets:
        _tokenizer_fits(cfg, setting, ds)
        if ds.tokenizer.get("sha256") != first.tokenizer.get("sha256"):
            raise ConfigError(
                setting,
                f"{ds.url} was prepared with another tokenizer than {first.url} ({ds.tokenizer.get('name')} vs "
                f"{first.tokenizer.get('name')}); prepare every dataset of the mixture with the same tokenizer",
            )
        train = Part(ds, training_documents(ds), d.seq_len)
        _holds_window(setting, ds.url, train.tokens, d.seq_len, "to train on")
    _held_out(cfg, datasets)


def _tokenizer_fits(cfg: Config, setting: str, ds: PreparedDataset) -> None:
    """The tokenizer's ids fit the model's vocabulary, and agree with model.init_from's."""
    tok, m = ds.tokenizer, cfg.model
    if tok["vocab_size"] > m.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"{ds.url} was prepared with tokenizer {tok.get('name')} of {tok['vocab_size']} ids, more than "
            f"model.vocab_size={m.vocab_size}; set model.vocab_size>={tok['vocab_size']} or prepare with the model's "
            "tokenizer",
        )
    if not m.init_from:
        return
    theirs = _checkpoint_tokenizer(m.init_from)
    ours = {"sha256": tok.get("sha256"), "eos_id": tok.get("eos_id"), "bos_id": tok.get("bos_id")}
    differ = [k for k, v in theirs.items() if v is not None and ours.get(k) is not None and v != ours[k]]
    if differ:
        raise ConfigError(
            setting,
            f"{ds.url} was prepared with tokenizer {tok.get('name')}, whose ids differ from model.init_from's "
            f"({', '.join(f'{k} {ours[k]} vs {theirs[k]}' for k in differ)}); prepare again with "
            f"tokenizer={m.init_from}",
        )


def _checkpoint_tokenizer(init_from: str) -> dict:
    """What a Hugging Face checkpoint directory says of its tokenizer: the sha256 of its
    tokenizer.json, and config.json's eos and bos ids (None where it says nothing)."""
    root = os.path.expanduser(init_from)
    out: dict = {"sha256": None, "eos_id": None, "bos_id": None}
    tokenizer_json = os.path.join(root, "tokenizer.json")
    if os.path.isfile(tokenizer_json):
        with open(tokenizer_json, "rb") as f:
            out["sha256"] = hashlib.sha256(f.read()).hexdigest()
    try:
        with open(os.path.join(root, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return out
    for ours, theirs in (("eos_id", "eos_token_id"), ("bos_id", "bos_token_id")):
        if isinstance(hf.get(theirs), int):
            out[ours] = hf[theirs]
    return out


def _holds_window(setting: str, url: str, tokens: int, seq_len: int, what: str) -> None:
    if tokens < seq_len + 1:
        raise ConfigError(
            setting,
            f"{url} holds {tokens} tokens {what}, fewer than one window (data.seq_len + 1 = {seq_len + 1}); "
            "give more data or lower data.seq_len",
        )


def _held_out(cfg: Config, datasets: list[tuple[str, PreparedDataset]]) -> None:
    """Evaluation reads data.val_path, else the documents each dataset held out."""
    d = cfg.data
    if d.val_path:
        ds = open_prepared(d.val_path, d.storage_options, "data.val_path")
        _tokenizer_fits(cfg, "data.val_path", ds)
        _holds_window("data.val_path", d.val_path, ds.num_tokens, d.seq_len, "held out")
        return
    if not cfg.eval.every:
        return
    for setting, ds in datasets:
        if len(ds.held_out) == 0:
            raise ConfigError(
                "eval.every",
                f"evaluation needs held-out data, and {ds.url} holds none out: prepare it with val_fraction=0.01, "
                "or set data.val_path=<a prepared dataset not trained on>, or eval.every=0",
            )
        held = Part(ds, ds.held_out, d.seq_len)
        _holds_window(setting, ds.url, held.tokens, d.seq_len, "held out")
