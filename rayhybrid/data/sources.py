"""What can be known of a data source without reading it, and without torch: the files a path
names, how many tokens they hold, where the held-out tail begins, and the checks of a config's
data settings before a run starts, in two parts (both called by `rayhybrid.preflight`):
`check_data_settings`, the settings alone (no file is read: a layout search runs it for every
candidate), and `check_data_files`, what the settings name (files, prepared datasets: once per
command).

The streams (`streams.py`) read the same files through the same functions, so a path the
checks accept is the path the ranks read.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

from rayhybrid.config.schema import Config, DataConfig
from rayhybrid.errors import ConfigError


@dataclass(frozen=True)
class DataKind:
    """What the checks and the streams need to know of one `data.name`."""

    reads_path: bool
    """data.path names the data to read (else the data is generated, with a held-out stream
    of its own)."""
    byte_level: bool = False
    """Token ids are bytes: the model needs model.vocab_size >= 256."""
    matches: str = "file"
    """What data.path and data.val_path must match, for the messages."""


BYTE_VOCAB_MAX = 512
"""The largest model.vocab_size byte-level data trains (256 bytes and room for a few specials):
a larger one is a tokenizer's, and its model would learn the wrong ids from bytes."""

KINDS = {
    "synthetic": DataKind(reads_path=False),
    "text": DataKind(reads_path=True, byte_level=True, matches="text file"),
    "tokens": DataKind(reads_path=True),
    "prepared": DataKind(reads_path=True, matches="prepared dataset"),
}
"""The one registry of data kinds (`data.name`); `streams.py` reads each the way it says."""


def text_files(path: str) -> list[str]:
    """`path` as a list of files: a file, a directory (its *.txt, recursively) or a glob."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        return sorted(glob.glob(os.path.join(path, "**", "*.txt"), recursive=True))
    if any(ch in path for ch in "*?["):
        return sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    return [path] if os.path.isfile(path) else []


def split_point(n_tokens: int, val_fraction: float) -> int:
    """Where data.val_fraction's tail begins: training reads tokens [0, split), evaluation
    [split, n). Whole windows never straddle it: each stream windows its own part."""
    return n_tokens - round(n_tokens * val_fraction)


def token_count(d: DataConfig, path: str) -> int | None:
    """Tokens in `path` as data.name reads it (text: bytes, with a separator between files);
    None when there is nothing there, or nothing readable (the workers say what is wrong when
    they open it). Counted without reading the data: file sizes, a .npy header."""
    if KINDS[d.name].byte_level:
        files = text_files(path)
        return sum(os.path.getsize(f) for f in files) + len(files) - 1 if files else None
    import numpy as np

    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        return None
    try:
        if path.endswith(".npy"):
            return int(np.load(path, mmap_mode="r").size)
        return os.path.getsize(path) // np.dtype(d.token_dtype).itemsize
    except (OSError, ValueError, TypeError):
        return None


def check_data_settings(cfg: Config) -> None:
    """data.name is known, the data fits the model, data.path is given where the kind reads it,
    and the held-out settings agree. Reads no file."""
    d, m = cfg.data, cfg.model
    if d.name not in KINDS:
        raise ConfigError("data.name", f"unknown value {d.name!r}; choose one of: {', '.join(KINDS)}")
    kind = KINDS[d.name]
    if d.mix and d.name != "prepared":
        raise ConfigError("data.mix", f"mixtures are of prepared datasets: set data=prepared, not data={d.name}")
    if d.name == "prepared":
        from rayhybrid.data.checks import check_prepared_settings

        return check_prepared_settings(cfg)
    if kind.byte_level and m.vocab_size < 256:
        raise ConfigError(
            "model.vocab_size", f"{d.name} data is byte-level and needs model.vocab_size>=256, got {m.vocab_size}"
        )
    if kind.byte_level and (m.init_from or m.vocab_size > BYTE_VOCAB_MAX):
        why = f"model.init_from={m.init_from}'s" if m.init_from else f"model.vocab_size={m.vocab_size} is a tokenizer's"
        raise ConfigError(
            "data.name",
            f"data={d.name} trains on bytes (ids 0-255), but {why} vocabulary is not bytes; tokenize once with "
            "python -m rayhybrid.prepare input=... output=... tokenizer=<its tokenizer> and train with "
            "data=prepared data.path=<output> (docs/data.md)",
        )
    if kind.reads_path and not d.path:
        raise ConfigError("data.path", f"data={d.name} needs data.path=<file, directory or glob>")
    _held_out(cfg, kind)


def check_data_files(cfg: Config) -> None:
    """What the data settings name is there (after `check_data_settings`): the data files, and
    each stream the run reads holds a window; for data=prepared, the datasets themselves
    (`check_prepared_datasets`: their index.json, read once per command)."""
    d = cfg.data
    if d.name == "prepared":
        from rayhybrid.data.checks import check_prepared_datasets

        return check_prepared_datasets(cfg)
    kind = KINDS[d.name]
    if not kind.reads_path:
        return
    if not kind.byte_level and not os.path.isfile(os.path.expanduser(d.path)):
        raise ConfigError("data.path", f"token file {d.path!r} does not exist")
    if kind.byte_level and not text_files(d.path):
        raise ConfigError("data.path", f"{d.path!r} matches no text file; give a file, a directory of *.txt or a glob")
    if d.val_path or d.val_fraction:
        _windows(d)


def _held_out(cfg: Config, kind: DataKind) -> None:
    """Generated data holds out a stream of its own; data read from data.path needs held-out
    data of one kind (data.val_path or data.val_fraction) when the run evaluates."""
    d = cfg.data
    if not kind.reads_path:
        for name, value in (("val_path", d.val_path), ("val_fraction", d.val_fraction)):
            if value:
                raise ConfigError(
                    f"data.{name}",
                    f"{d.name} data holds out a stream of its own (an independent seed); remove data.{name}",
                )
    elif d.val_path and d.val_fraction:
        raise ConfigError(
            "data.val_fraction", "data.val_path is the held-out data already; set data.val_path or data.val_fraction"
        )
    elif cfg.eval.every and not (d.val_path or d.val_fraction):
        raise ConfigError(
            "eval.every",
            f"evaluation needs held-out data for data={d.name}: set data.val_path=<{d.name} not trained on> "
            "or data.val_fraction=0.01 (the tail of data.path), or eval.every=0",
        )


def _windows(d: DataConfig) -> None:
    """Enough tokens for one window (data.seq_len + 1) in data.path's training part and in the
    held-out data."""
    need = d.seq_len + 1
    train = token_count(d, d.path)
    if d.val_path:
        held = token_count(d, d.val_path)
        if held is None:
            what = KINDS[d.name].matches
            raise ConfigError("data.val_path", f"{d.val_path!r} matches no {what}; give held-out data like data.path's")
        if held < need:
            raise ConfigError(
                "data.val_path",
                f"{d.val_path!r} holds {held} tokens, fewer than data.seq_len + 1 = {need}; give more held-out data",
            )
    elif d.val_fraction and train is not None:
        cut = split_point(train, d.val_fraction)
        if train - cut < need or cut < need:
            raise ConfigError(
                "data.val_fraction",
                f"{d.val_fraction:g} of {train} tokens leaves {train - cut} held out and {cut} to train on; "
                f"each needs data.seq_len + 1 = {need}: change data.val_fraction or give data.val_path",
            )
