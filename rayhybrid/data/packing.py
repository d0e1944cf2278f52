"""Where sample i of prepared data comes from: which dataset, which epoch, which window.

    part = Part(dataset, documents, seq_len)    # a dataset's training (or held-out) documents, packed
    mix = Mixture([0.7, 0.3])                   # deterministic interleave in proportion to the weights
    d, j = mix.locate(i)                        # sample i is dataset d's j-th sample
    epoch, start = parts[d].window(j, seed_key) # in epoch j // windows, at token `start` of the part

Packing: a part's documents, in order and joined (each ends with EOS), form one token stream;
window w is its tokens [w * seq_len, w * seq_len + seq_len + 1), so consecutive windows share one
token (the last target of one is the first input of the next) and none is dropped but the tail.
An epoch reads every window once, in a seeded permutation drawn anew for each epoch.

Mixing: blocks of `BLOCK` samples, dataset d taking exactly `quota[d]` slots of each block (the
largest-remainder rounding of its weight), spread evenly through the block. Every block is the
same, so `locate` is O(1), and any run of samples holds each dataset within one block's
rounding of its weight. Each dataset runs through its own epochs at its own pace.

All of it is a function of (datasets, weights, seed, seq_len, i) alone: docs/design.md,
invariant 4. No torch, no I/O beyond the documents' lengths.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from rayhybrid.data.prepared import PreparedDataset

BLOCK = 1 << 14
"""Samples per mixing block: the smallest weight a mixture can give a dataset is 1 / BLOCK."""
EPOCH_KEY = 0xE90C


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
        self._orders: OrderedDict[tuple, np.ndarray] = OrderedDict()

    def window(self, j: int, key: tuple[int, ...]) -> tuple[int, int]:
        """(epoch, first token in this part) of the part's j-th sample under seed `key`."""
        epoch, position = divmod(j, self.windows)
        return epoch, int(self.order(key, epoch)[position]) * self.seq_len

    def order(self, key: tuple[int, ...], epoch: int) -> np.ndarray:
        """The windows of one epoch in the order they are read: a permutation seeded by `key`
        and the epoch (the last two epochs asked for are kept)."""
        k = (*key, epoch)
        if k not in self._orders:
            self._orders[k] = np.random.default_rng([*key, EPOCH_KEY, epoch]).permutation(self.windows)
            while len(self._orders) > 2:
                self._orders.popitem(last=False)
        return self._orders[k]

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
