"""Training and evaluation samples from prepared datasets (data=prepared), read straight from
their store.

    stream = PreparedStream.open(cfg.data, seed)          # data.path or data.mix
    inputs, targets = stream.batch(start, count)          # samples [start, start + count)
    stream.prefetch(next_start, count)                    # read the next step's in the background
    stream.provenance(i)                                  # (dataset, epoch, first token) of sample i

Only the byte ranges a batch's windows cover are read: all of a batch's ranges of one dataset
in one `cat_ranges` call (concurrent ranged GETs on object stores). `data.cache_dir` keeps
what was read on the node's disk, in aligned chunks of the dataset's token stream (not of its
shards, which another prepare of the same data cuts elsewhere), each written whole (a temporary
file renamed) and used only at its full size, so ranks of one node share it safely and a later
epoch or a restarted rank reads it locally.
`data.read_ahead` steps are fetched by a background thread while the current step trains, as
for every kind of data (`SampleStream.prefetch`).

Where each sample comes from is rayhybrid/data/packing.py's; this module only reads.
"""

from __future__ import annotations

import os
import uuid

import numpy as np

from rayhybrid.config.schema import DataConfig
from rayhybrid.data.identity import prepared_identity
from rayhybrid.data.packing import Mixture, Part, mixture_entries, training_documents
from rayhybrid.data.prepared import INDEX, PreparedDataset, open_prepared
from rayhybrid.data.samples import SampleStream
from rayhybrid.data.seeds import HELD_OUT

CACHE_CHUNK = 1 << 20
"""Bytes per cached chunk of a shard (data.cache_dir)."""


class PreparedStream(SampleStream):
    """Samples of one or more prepared datasets (a weighted mixture), packed into windows of
    seq_len + 1 tokens; `batch(start, count)` -> (inputs, targets), each [count, seq_len] int64."""

    loss_floor = None

    def __init__(self, parts: list[Part], names: list[str], weights: list[float], cfg: DataConfig, key: tuple) -> None:
        self.parts, self.names, self.seq_len, self.key = parts, names, cfg.seq_len, key
        self.mixture = Mixture(weights)
        self.cache_dir = os.path.expanduser(cfg.cache_dir) if cfg.cache_dir else ""

    @classmethod
    def open(cls, cfg: DataConfig, seed: int) -> PreparedStream:
        """The training stream: every dataset's documents but its held-out ones."""
        return cls._mixed(cfg, (seed,), training_documents)

    @classmethod
    def held_out(cls, cfg: DataConfig, seed: int) -> PreparedStream:
        """Evaluation's stream (seeded apart with seeds.HELD_OUT): data.val_path's documents,
        else every dataset's held-out ones, mixed with the same weights."""
        if cfg.val_path:
            part = Part(open_prepared(cfg.val_path, cfg.storage_options, "data.val_path"), None, cfg.seq_len)
            return cls([part], [cfg.val_path], [1.0], cfg, (seed, HELD_OUT))
        return cls._mixed(cfg, (seed, HELD_OUT), lambda ds: ds.held_out)

    @classmethod
    def _mixed(cls, cfg: DataConfig, key: tuple, documents) -> PreparedStream:
        """data.mix (or data.path alone), each dataset's `documents(dataset)` packed."""
        entries = mixture_entries(cfg)
        datasets = [open_prepared(url, cfg.storage_options, setting) for setting, url, _ in entries]
        parts = [Part(ds, documents(ds), cfg.seq_len) for ds in datasets]
        return cls(parts, [url for _, url, _ in entries], [w for _, _, w in entries], cfg, key)

    def identity(self) -> dict:
        return prepared_identity([p.dataset.index.fingerprint for p in self.parts], self.mixture.weights)

    def locate(self, i: int) -> tuple[int, int, int]:
        """(dataset, epoch, first token in its part) of sample i."""
        d, j = self.mixture.locate(i)
        epoch, start = self.parts[d].window(j, (*self.key, d))
        return d, epoch, start

    def sample(self, index: int) -> np.ndarray:
        return self._read([index])[0]

    def provenance(self, index: int) -> tuple[str, int, int]:
        d, epoch, start = self.locate(index)
        return self.names[d], epoch, start

    def rows(self, start: int, count: int) -> np.ndarray:
        """Samples [start, start + count), read with one batch of ranged reads per dataset."""
        return np.stack(self._read(range(start, start + count)))

    def _read(self, indices) -> list[np.ndarray]:
        """The token windows of `indices`, read with one batch of ranged reads per dataset."""
        wanted: dict[int, list[tuple[int, int]]] = {}  # dataset -> its (sample position, stream range)
        for n, i in enumerate(indices):
            d, _, start = self.locate(i)
            wanted.setdefault(d, []).extend((n, r) for r in self.parts[d].ranges(start, start + self.seq_len + 1))
        pieces: dict[int, list[np.ndarray]] = {}
        for d, items in wanted.items():
            tokens = _fetch(self.parts[d].dataset, [r for _, r in items], self.cache_dir)
            for (n, _), t in zip(items, tokens):
                pieces.setdefault(n, []).append(t)
        return [np.concatenate(pieces[n]) for n in range(len(pieces))]


def _fetch(ds: PreparedDataset, ranges: list[tuple[int, int]], cache_dir: str) -> list[np.ndarray]:
    """Token ranges [a, b) of one dataset's stream, in order, read in one batched call (through
    the node cache with data.cache_dir)."""
    if cache_dir:
        size = ds.dtype.itemsize
        return [ds.decode([blob]) for blob in _cached(ds, [(a * size, b * size) for a, b in ranges], cache_dir)]
    return [ds.decode(blobs) for blobs in _read_spans(ds, [ds.byte_ranges(a, b) for a, b in ranges])]


def _read_spans(ds: PreparedDataset, spans: list[list[tuple[str, int, int]]]) -> list[list[bytes]]:
    """The bytes of each span (its ranges of shard files, `PreparedDataset.byte_ranges`), read
    in one batched call: concurrent ranged GETs on object stores."""
    flat = [s for span in spans for s in span]
    blobs = ds.fs.cat_ranges(*map(list, zip(*flat)), on_error="raise") if flat else []
    out, k = [], 0
    for span in spans:
        out.append(blobs[k : k + len(span)])
        k += len(span)
    return out


def _cached(ds: PreparedDataset, ranges: list[tuple[int, int]], cache_dir: str) -> list[bytes]:
    """Byte ranges [a, b) of the dataset's token stream through the node's chunk cache.

    Chunk c holds the stream's bytes [c * CACHE_CHUNK, (c + 1) * CACHE_CHUNK), kept under the
    dataset's fingerprint (which names the stream, whatever its shards) and token type: any
    prepare of the same data, on any store and cut into any shards, reads and fills the same
    chunks. A chunk is used only at its full size; missing ones (and any of another size) are
    read from the store in one batch and written whole (temporary file, then rename)."""
    root = os.path.join(cache_dir, f"{ds.index.fingerprint[:24]}-{ds.dtype.name}")
    os.makedirs(root, exist_ok=True)
    total = ds.num_tokens * ds.dtype.itemsize

    def local(chunk: int) -> str:
        return os.path.join(root, f"stream.{chunk}")

    def size(chunk: int) -> int:
        return min(CACHE_CHUNK, total - chunk * CACHE_CHUNK)

    needed = sorted({c for a, b in ranges if b > a for c in range(a // CACHE_CHUNK, (b - 1) // CACHE_CHUNK + 1)})
    missing = [c for c in needed if not _whole(local(c), size(c))]
    if missing:
        _fill(ds, missing, [local(c) for c in missing], [size(c) for c in missing])
    out = []
    for a, b in ranges:
        parts = []
        for c in range(a // CACHE_CHUNK, (b - 1) // CACHE_CHUNK + 1):
            lo, hi = max(a, c * CACHE_CHUNK) - c * CACHE_CHUNK, min(b, (c + 1) * CACHE_CHUNK) - c * CACHE_CHUNK
            with open(local(c), "rb") as f:
                f.seek(lo)
                parts.append(f.read(hi - lo))
        out.append(b"".join(parts))
    return out


def _whole(path: str, size: int) -> bool:
    """Whether the cached chunk at `path` is there at its full size."""
    try:
        return os.path.getsize(path) == size
    except OSError:
        return False


def _fill(ds: PreparedDataset, chunks: list[int], paths: list[str], sizes: list[int]) -> None:
    """Read these chunks of the stream from the store (one batched call: a chunk that spans
    shards is a ranged read of each) and write each whole to its path."""
    item = ds.dtype.itemsize
    spans = [ds.byte_ranges(c * CACHE_CHUNK // item, (c * CACHE_CHUNK + n) // item) for c, n in zip(chunks, sizes)]
    for blobs, path, n in zip(_read_spans(ds, spans), paths, sizes):
        blob = b"".join(blobs)
        if len(blob) != n:
            raise OSError(f"{ds.url}: its shards hold fewer bytes than {INDEX} says; prepare it again")
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
