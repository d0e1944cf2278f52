"""One deterministic sample stream addressed by global sample index (docs/design.md, invariant 4).

Sample `i` is a function of (data config, seed, i) alone, so step k reads global samples
``[k*G, (k+1)*G)`` and dp rank r reads its contiguous share, whatever dp is. Resume, restart
and resize need only `consumed_samples`.

Here: the streams of generated, text and token data, and `build_stream` / `build_held_out`,
which pick each kind's stream (prepared data's is `reader.PreparedStream`). Their base class is
`samples.SampleStream`, which the prepared reader builds on too.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rayhybrid.config.schema import DataConfig
from rayhybrid.data.chain import successors, walk
from rayhybrid.data.reader import PreparedStream
from rayhybrid.data.samples import SampleStream
from rayhybrid.data.seeds import HELD_OUT
from rayhybrid.data.sources import KINDS, DataKind, split_point, text_files


def _rng(seed: int, index: int, key: tuple[int, ...] = ()) -> np.random.Generator:
    return np.random.default_rng([seed, *key, index])


class MarkovStream(SampleStream):
    """Token sequences from a random sparse Markov chain: each token has `branching`
    successors with Dirichlet-drawn probabilities. Sequences start from the stationary
    distribution, so the optimal loss is the chain's entropy rate at every position."""

    def __init__(self, vocab_size: int, seq_len: int, branching: int, seed: int) -> None:
        rng = np.random.default_rng([seed, 0x5EED])
        self.seq_len = seq_len
        self.seed = seed
        self.key: tuple[int, ...] = ()  # (HELD_OUT,): the held-out stream of the same chain
        k = min(branching, vocab_size)
        self.successors = successors(rng, vocab_size, k)  # rng.choice(vocab_size, k, replace=False) per row
        probs = rng.dirichlet(np.ones(k), size=vocab_size)
        self.cdf = np.cumsum(probs, axis=1)
        self.cdf[:, -1] = 1.0
        self.stationary = _stationary(self.successors, probs)
        self.stationary_cdf = np.cumsum(self.stationary)
        self.stationary_cdf[-1] = 1.0
        entropy = -(probs * np.log(np.clip(probs, 1e-300, None))).sum(axis=1)
        self.loss_floor = float(self.stationary @ entropy)

    def held_out(self) -> MarkovStream:
        """The same chain, sampled from an independent seeded stream: sequences training never
        reads (sample i of each comes from its own generator)."""
        other = copy.copy(self)
        other.key = (HELD_OUT,)
        other._pool = other._ahead = None  # its own read-ahead, never the training stream's
        return other

    def rows(self, start: int, count: int) -> np.ndarray:
        """Samples [start, start + count), walked side by side (`chain.walk`); sample i's
        uniforms come from its own generator, seeded by (seed, key, i)."""
        u = np.array([_rng(self.seed, i, self.key).random(self.seq_len + 1) for i in range(start, start + count)])
        return walk(u.reshape(count, self.seq_len + 1), self.successors, self.cdf, self.stationary_cdf)


def _stationary(successors: np.ndarray, probs: np.ndarray, iters: int = 2000) -> np.ndarray:
    """Stationary distribution by power iteration, started from uniform (lazy chain for
    periodic components). The chain is kept sparse (`successors[i]` with `probs[i]`): a step
    costs vocab x branching, not vocab squared (a dense 50304-token chain would take 20 GB)."""
    n = successors.shape[0]
    flat = successors.ravel()
    pi = np.full(n, 1.0 / n)
    for _ in range(iters):
        moved = np.bincount(flat, weights=(pi[:, None] * probs).ravel(), minlength=n)
        nxt = 0.5 * (pi + moved)
        if np.abs(nxt - pi).sum() < 1e-13:
            break
        pi = nxt
    return pi / pi.sum()


class WindowStream(SampleStream):
    """Random windows of seq_len+1 tokens from one long token array (text bytes or token ids).
    Window start of sample i is drawn from a generator seeded by (seed, i)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, source: str, setting: str = "data.path") -> None:
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"{setting}: {source!r} holds {len(tokens)} tokens, fewer than data.seq_len + 1 = "
                f"{seq_len + 1}; give more data or lower data.seq_len"
            )
        self.tokens, self.seq_len, self.seed, self.source = tokens, seq_len, seed, source

    def start(self, index: int) -> int:
        return int(_rng(self.seed, index).integers(0, len(self.tokens) - self.seq_len))  # last start included

    def sample(self, index: int) -> np.ndarray:
        start = self.start(index)
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def provenance(self, index: int) -> tuple[str, int, int | None]:
        return self.source, 0, self.start(index)


def build_stream(cfg: DataConfig, vocab_size: int, seed: int) -> SampleStream:
    """The training stream. With data.val_fraction, text and token data train on the head of
    data.path's tokens only (the tail is `build_held_out`'s)."""
    if not data_kind(cfg).reads_path:
        return MarkovStream(vocab_size, cfg.seq_len, cfg.branching, seed)
    if cfg.name == "prepared":
        return PreparedStream.open(cfg, seed)
    tokens = _tokens(cfg, cfg.path, "data.path")
    if cfg.val_path or cfg.val_fraction <= 0:
        return WindowStream(tokens, cfg.seq_len, seed, cfg.path)
    stream = WindowStream(tokens[: split_point(len(tokens), cfg.val_fraction)], cfg.seq_len, seed, cfg.path)
    stream.whole = tokens  # the held-out tail is sliced from it, not read a second time
    return stream


def build_held_out(cfg: DataConfig, vocab_size: int, seed: int, train: SampleStream | None = None) -> SampleStream:
    """The held-out stream evaluation reads: synthetic data's independent stream of the same
    chain (`train`'s, when given: no second chain to build), data.val_path's tokens, or the tail
    data.val_fraction of data.path's."""
    if not data_kind(cfg).reads_path:
        chain = train if isinstance(train, MarkovStream) else MarkovStream(vocab_size, cfg.seq_len, cfg.branching, seed)
        return chain.held_out()
    if cfg.name == "prepared":
        return PreparedStream.held_out(cfg, seed)
    if cfg.val_path:
        tokens = _tokens(cfg, cfg.val_path, "data.val_path")
        return WindowStream(tokens, cfg.seq_len, seed, cfg.val_path, setting="data.val_path")
    if cfg.val_fraction <= 0:
        raise ValueError(f"data={cfg.name} has no held-out data; set data.val_path or data.val_fraction")
    tokens = getattr(train, "whole", None)
    if tokens is None:
        tokens = _tokens(cfg, cfg.path, "data.path")
    tail = tokens[split_point(len(tokens), cfg.val_fraction) :]
    return WindowStream(tail, cfg.seq_len, seed, f"the last {cfg.val_fraction:g} of {cfg.path}", "data.val_fraction")


def _tokens(cfg: DataConfig, path: str, setting: str) -> np.ndarray:
    """`path` (data.path or data.val_path, named by `setting`) as one token array: text as
    bytes, tokens as ids."""
    data_kind(cfg)
    return READERS[cfg.name](cfg, path, setting)


def data_kind(cfg: DataConfig) -> DataKind:
    """data.name's entry of `KINDS`; ValueError for a name that has none."""
    if cfg.name not in KINDS:
        raise ValueError(f"data.name={cfg.name!r} is unknown; use {', '.join(KINDS)}")
    return KINDS[cfg.name]


def _text_bytes(cfg: DataConfig, path: str, setting: str) -> np.ndarray:
    files = text_files(path)
    if not files:
        raise ValueError(f"{setting}={path!r} matches no text file; point it at a file, a directory of *.txt or a glob")
    blob = b"\n".join(Path(f).read_bytes() for f in files)
    return np.frombuffer(blob, dtype=np.uint8)


def _token_ids(cfg: DataConfig, path: str, setting: str) -> np.ndarray:
    if path.endswith(".npy"):
        return np.load(os.path.expanduser(path), mmap_mode="r")
    return np.memmap(os.path.expanduser(path), dtype=np.dtype(cfg.token_dtype), mode="r")


READERS = {"text": _text_bytes, "tokens": _token_ids}
"""How each kind of `KINDS` that reads data.path turns a path into token ids."""


@dataclass(frozen=True)
class Shard:
    """Which global samples one dp rank reads at one step."""

    start: int
    count: int


def replica_shard(consumed_samples: int, global_batch_size: int, dp: int, dp_rank: int) -> Shard:
    """Samples dp rank `dp_rank` reads in the step that starts at `consumed_samples`."""
    per_replica = global_batch_size // dp
    return Shard(start=consumed_samples + dp_rank * per_replica, count=per_replica)


def trace_rows(stream: SampleStream, step: int, shard: Shard) -> list[dict]:
    """data.trace: one row per sample of `shard`, read in step `step`: where it came from
    (`provenance`, a function of the data, the seed and the sample alone)."""
    rows = []
    for i in range(shard.start, shard.start + shard.count):
        name, epoch, start = stream.provenance(i)
        rows.append({"step": step, "sample": i, "dataset": name, "epoch": epoch, "start": start})
    return rows


def uniform_loss(vocab_size: int) -> float:
    return math.log(vocab_size)
