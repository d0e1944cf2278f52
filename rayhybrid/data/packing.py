"""Where sample i of prepared data comes from: which dataset, which epoch, which window.

    part = Part(dataset, documents, seq_len)    # a dataset's training (or held-out) documents, packed
    mix = Mixture([0.7, 0.3])                   # deterministic interleave in proportion to the weights
    d, j = mix.locate(i)                        # sample i is dataset d's j-th sample
    epoch, start = parts[d].window(j, seed_key) # in epoch j // windows, at token `start` of the part

Packing: a part's documents, in order and joined (each ends with EOS), form one token stream;
window w is its tokens [w * seq_len, w * seq_len + seq_len + 1), so consecutive windows share one
token (the last target of one is the first input of the next) and none is dropped but the tail.
An epoch reads every window once, in a seeded order drawn anew for each epoch: a keyed
bijection of the window numbers (`shuffled`), computed per sample, so nothing is held per epoch
whatever the size of the data, and no state is shared between the threads that read.

Mixing: blocks of `BLOCK` samples, dataset d taking exactly `quota[d]` slots of each block (the
largest-remainder rounding of its weight), spread evenly through the block. Every block is the
same, so `locate` is O(1), and any run of samples holds each dataset within one block's
rounding of its weight. Each dataset runs through its own epochs at its own pace.

All of it is a function of (datasets, weights, seed, seq_len, i) alone: docs/design.md,
invariant 4. No torch, no I/O beyond the documents' lengths.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from rayhybrid.data.prepared import PreparedDataset

BLOCK = 1 << 14
"""Samples per mixing block: the smallest weight a mixture can give a dataset is 1 / BLOCK."""
EPOCH_KEY = 0xE90C
ORDER = 2
"""Which epoch order `shuffled` draws, recorded in checkpoints with the data's identity (a
resume under another order would read other samples). 1 was a full permutation per epoch."""
ROUNDS = 6
"""Feistel rounds of the epoch order."""
_MASK64 = (1 << 64) - 1
_MULTIPLIER = 0x9E3779B97F4A7C15  # odd: 2**64 / golden ratio


class Part:
    """Some of a dataset's documents (all but the held-out ones, or only those), in order, as
    one token stream cut into windows of seq_len + 1 tokens."""

    def __init__(self, dataset: PreparedDataset, documents: np.ndarray | None, seq_len: int) -> None:
        self.dataset, self.seq_len = dataset, seq_len
        offsets = dataset.offsets
        if documents is None:
            firsts, lasts = np.array([0]), np.array([dataset.num_documents])
        else:  # runs of consecutive document ids: each is one contiguous range of the stream
            documents = np.asarray(documents, dtype=np.int64)
            breaks = np.flatnonzero(np.diff(documents) != 1) + 1
            firsts = documents[np.concatenate([[0], breaks])] if len(documents) else np.zeros(0, np.int64)
            lasts = documents[np.concatenate([breaks - 1, [len(documents) - 1]])] + 1 if len(documents) else firsts
        self.seg_start = offsets[firsts].astype(np.int64)  # where each run begins in the dataset's stream
        seg_len = offsets[lasts] - offsets[firsts]
        self.seg_virtual = np.concatenate([[0], np.cumsum(seg_len)]).astype(np.int64)  # ... and in this part's
        self.tokens = int(self.seg_virtual[-1])
        self.windows = max(0, (self.tokens - 1) // seq_len)

    def window(self, j: int, key: tuple[int, ...]) -> tuple[int, int]:
        """(epoch, first token in this part) of the part's j-th sample under seed `key`: epoch
        j // windows reads window `shuffled(j % windows, windows, round_keys(key, epoch))`."""
        epoch, position = divmod(int(j), self.windows)
        return epoch, shuffled(position, self.windows, round_keys(tuple(key), epoch)) * self.seq_len

    def ranges(self, start: int, stop: int) -> list[tuple[int, int]]:
        """This part's tokens [start, stop) as ranges of the dataset's stream (a window that
        spans a held-out document skips it)."""
        out = []
        seg = int(np.searchsorted(self.seg_virtual, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self.seg_virtual[seg + 1]))
            if end > start:
                base = int(self.seg_start[seg]) - int(self.seg_virtual[seg])
                out.append((base + start, base + end))
            start, seg = end, seg + 1
        return out


@lru_cache(maxsize=256)
def round_keys(key: tuple[int, ...], epoch: int) -> tuple[int, ...]:
    """The Feistel keys of one epoch's order under seed `key` (non-negative integers): drawn by
    numpy's SeedSequence from (key, EPOCH_KEY, epoch), the same in every process. Kept for the
    last epochs asked for (functools' cache: safe across threads, and only a speed-up)."""
    state = np.random.SeedSequence([*key, EPOCH_KEY, epoch]).generate_state(ROUNDS, np.uint64)
    return tuple(int(k) for k in state)


def shuffled(position: int, windows: int, keys: tuple[int, ...]) -> int:
    """The window an epoch of `windows` windows reads at `position`: a permutation of
    range(windows) keyed by `keys`, computed for this position alone in O(1) memory.

    A Feistel network over [0, 2**bits), the smallest power of two above the last window, cut
    into a high and a low half: each round keeps the low half, moved to the top, and xors a keyed
    hash of it (the top bits of a 64-bit multiply) into the high one, which is a bijection
    whatever the key. Cycle-walking makes it one of range(windows): a value past the last window
    goes through the network again until it lands inside (at most two passes on average,
    as 2**bits <= 2 * windows)."""
    bits = max(1, (windows - 1).bit_length())
    low = bits >> 1
    high = bits - low
    low_mask, high_mask, shift = (1 << low) - 1, (1 << high) - 1, 64 - high
    x = position
    while True:
        for k in keys:
            lo = x & low_mask
            x = (lo << high) | (((x >> low) ^ (((lo ^ k) * _MULTIPLIER & _MASK64) >> shift)) & high_mask)
        if x < windows:
            return x


def mixture_entries(data) -> list[tuple[str, str, float]]:
    """(setting, URL, weight) of each dataset data=prepared reads: data.mix's entries (config
    MixEntry values, or dicts from Python callers), else data.path alone with weight 1."""
    if not data.mix:
        return [("data.path", data.path, 1.0)]
    out = []
    for i, m in enumerate(data.mix):
        path, weight = (m.get("path", ""), m.get("weight", 1.0)) if isinstance(m, dict) else (m.path, m.weight)
        out.append((f"data.mix[{i}].path", path, float(weight)))
    return out


def prepared_sources(data) -> list[tuple[str, str]]:
    """(setting, URL) of every prepared dataset `data` names: `mixture_entries`' and
    data.val_path; none unless data=prepared."""
    if data.name != "prepared":
        return []
    named = [(setting, url) for setting, url, _ in mixture_entries(data)] + [("data.val_path", data.val_path)]
    return [(setting, url) for setting, url in named if url]


def training_documents(dataset: PreparedDataset) -> np.ndarray | None:
    """The documents training reads: every one but the held-out ones (None: all of them)."""
    held = dataset.held_out
    return None if len(held) == 0 else np.setdiff1d(np.arange(dataset.num_documents), held)


class Mixture:
    """Sample i -> (dataset, that dataset's sample number): blocks of `BLOCK` samples, each
    dataset taking its quota of every block, its slots spread evenly through the block."""

    def __init__(self, weights: list[float]) -> None:
        w = np.asarray(weights, dtype=np.float64)
        if len(w) == 0 or (w <= 0).any() or not np.isfinite(w).all():
            raise ValueError(f"mixture weights must be positive, got {list(weights)}")
        self.weights = w / w.sum()
        self.quota = _largest_remainder(self.weights, BLOCK)
        if (self.quota == 0).any():
            raise ValueError(f"a mixture weight below 1/{BLOCK} of the total gets no sample; raise it or drop it")
        datasets = np.repeat(np.arange(len(w)), self.quota)
        rank = np.concatenate([np.arange(q) for q in self.quota])
        place = (rank + 0.5) / self.quota[datasets]  # where in the block each slot belongs
        order = np.lexsort((datasets, place))
        self.dataset_of = datasets[order]
        self.rank_of = rank[order]

    def locate(self, i: int) -> tuple[int, int]:
        block, slot = divmod(i, BLOCK)
        d = int(self.dataset_of[slot])
        return d, block * int(self.quota[d]) + int(self.rank_of[slot])


def _largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    """Integers summing to `total` in proportion to `weights` (normalised), each within one of
    its share."""
    exact = weights * total
    quota = np.floor(exact).astype(np.int64)
    short = total - int(quota.sum())
    quota[np.argsort(-(exact - quota), kind="stable")[:short]] += 1
    return quota
