"""What can be known of a data source without reading it, and without torch: the files a path
names, how many tokens they hold, where the held-out tail begins, and the checks a config's
data settings must pass before a run starts (`validate_data`, called by `rayhybrid.preflight`).

The streams (`streams.py`) read the same files through the same functions, so a path the
checks accept is the path the ranks read.
"""

from __future__ import annotations

import glob
import os

from rayhybrid.config.schema import Config, DataConfig
from rayhybrid.errors import ConfigError

FILE_KINDS = ("text", "tokens")
"""The data kinds read from data.path (synthetic data is generated)."""


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
    if d.name == "text":
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


def validate_data(cfg: Config) -> None:
    """The data files exist and fit the model; each stream the run reads holds a window."""
    d, m = cfg.data, cfg.model
    if d.name == "text" and m.vocab_size < 256:
        raise ConfigError(
            "model.vocab_size", f"text data is byte-level and needs model.vocab_size>=256, got {m.vocab_size}"
        )
    if d.name in FILE_KINDS:
        if not d.path:
            raise ConfigError("data.path", f"data={d.name} needs data.path=<file, directory or glob>")
        if d.name == "tokens" and not os.path.isfile(os.path.expanduser(d.path)):
            raise ConfigError("data.path", f"token file {d.path!r} does not exist")
        if d.name == "text" and not text_files(d.path):
            raise ConfigError(
                "data.path", f"{d.path!r} matches no text file; give a file, a directory of *.txt or a glob"
            )
        if d.val_path or d.val_fraction:
            _windows(d)


def _windows(d: DataConfig) -> None:
    """Enough tokens for one window (data.seq_len + 1) in data.path's training part and in the
    held-out data."""
    need = d.seq_len + 1
    train = token_count(d, d.path)
    if d.val_path:
        held = token_count(d, d.val_path)
        if held is None:
            what = "no text file" if d.name == "text" else "no file"
            raise ConfigError("data.val_path", f"{d.val_path!r} matches {what}; give held-out data like data.path's")
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
