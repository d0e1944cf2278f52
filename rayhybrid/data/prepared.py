"""A prepared dataset on any store: token shards plus one index, the index written last.

    <url>/shard-00000.bin            token ids, little-endian (uint16 when the vocabulary fits, else uint32)
    <url>/shard-00000.lengths.npy    int64: the token count of each of the shard's documents, in order
    ...
    <url>/index.json                 the commit marker: written last, so a dataset without it is not one

`python -m rayhybrid.prepare` writes it (rayhybrid/prepare/); `open_prepared(url)` opens it for
inspection and the training streams read it (`rayhybrid.data.packing`). A document is
`tokenizer(text, add_special_tokens=False)` followed by the EOS id (the BOS id first with
`bos=true`); the documents keep the input's order, and the shards concatenated are the
dataset's token stream. Shard boundaries carry no meaning: two prepares of the same input
with different worker counts may cut the stream at other places, nothing else differs.

Held-out documents (prepare's `val_fraction`) are a seeded choice of whole documents among
all of them (`held_out_documents`), recorded in the index by their fraction and count and
derived again by every reader: training never reads them, evaluation reads only them.

Its store is opened as every store is (`rayhybrid.storage.store.open_store`), with
data.storage_options. No torch, no Ray here: the checks before a run (`rayhybrid.preflight`)
read the index too.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from rayhybrid.data.seeds import HELD_OUT
from rayhybrid.errors import ConfigError
from rayhybrid.storage.store import one_line, open_store, redact_url

INDEX = "index.json"
FORMAT = "rayhybrid.prepared"
VERSION = 1


def token_dtype(vocab_size: int) -> str:
    """The narrowest unsigned type that holds every id of a vocabulary of this size."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_files(number: int) -> tuple[str, str]:
    """The token file and the lengths file of shard `number` (relative to the dataset's URL)."""
    stem = f"shard-{number:05d}"
    return f"{stem}.bin", f"{stem}.lengths.npy"


def held_out_documents(num_documents: int, fraction: float) -> np.ndarray:
    """The sorted ids of the documents held out for evaluation: round(n * fraction) of the n,
    a seeded choice that depends on n and the fraction alone."""
    k = round(num_documents * fraction)
    if fraction <= 0 or k == 0:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng([HELD_OUT, num_documents])
    return np.sort(rng.permutation(num_documents)[:k]).astype(np.int64)


def lengths_bytes(lengths: np.ndarray) -> bytes:
    """A shard's document lengths as the bytes of its .lengths.npy file."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(lengths, dtype=np.int64), allow_pickle=False)
    return buf.getvalue()


@dataclass(frozen=True)
class Index:
    """index.json, parsed. `tokenizer` holds name, vocab_size (every id, added tokens
    included), eos_id, bos_id and sha256 (of its tokenizer.json)."""

    url: str
    dtype: str
    tokenizer: dict
    bos: bool
    shards: tuple[dict, ...]  # {"name": "shard-00000", "documents": n, "tokens": t}, in stream order
    documents: int
    tokens: int
    held_out_fraction: float
    sources: tuple[dict, ...]  # {"path": ..., "size": bytes}, as read
    raw: dict

    @classmethod
    def parse(cls, url: str, text: str) -> Index:
        raw = json.loads(text)
        if raw.get("format") != FORMAT or raw.get("version") != VERSION:
            raise ValueError(f"{url}/{INDEX} is not a {FORMAT} index of version {VERSION}")
        return cls(
            url=url,
            dtype=raw["dtype"],
            tokenizer=dict(raw["tokenizer"]),
            bos=bool(raw.get("bos", False)),
            shards=tuple(raw["shards"]),
            documents=int(raw["documents"]),
            tokens=int(raw["tokens"]),
            held_out_fraction=float((raw.get("held_out") or {}).get("fraction", 0.0)),
            sources=tuple(raw.get("sources", ())),
            raw=raw,
        )

    @property
    def fingerprint(self) -> str:
        """What identifies this dataset's token stream (for checkpoints and caches)."""
        return self.raw["fingerprint"]


def read_index(url: str, options: dict | None = None, setting: str = "data.path") -> Index:
    """The committed index of the dataset at `url`, read with `options` (data.storage_options);
    ConfigError naming `setting` when there is none (nothing prepared there, or a prepare that
    did not finish) or it cannot be read."""
    store = open_store(url, options, setting=setting)
    shown = redact_url(url)
    try:
        text = store.read_bytes(store.join(INDEX)).decode()
    except FileNotFoundError:
        raise ConfigError(
            setting,
            f"{shown} holds no committed prepared dataset ({INDEX} is missing: nothing was prepared there, or "
            "a prepare did not finish); run python -m rayhybrid.prepare input=... output=" + shown,
        ) from None
    except (OSError, ValueError) as err:
        raise ConfigError(setting, f"cannot read {shown}/{INDEX}: {one_line(err)}") from None
    except Exception as err:  # noqa: BLE001 - a store client's own error (no credentials, access denied)
        raise ConfigError(
            setting,
            f"cannot read {shown}/{INDEX}: {one_line(err)}; check the credentials and the endpoint "
            "(data.storage_options, or the store's environment variables such as AWS_*)",
        ) from None
    try:
        return Index.parse(url, text)
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            setting, f"{shown}/{INDEX} is not a prepared dataset's index ({err}); prepare it again"
        ) from None


class PreparedDataset:
    """A prepared dataset, opened: its index, every document's length, and ranged reads of its
    token stream (only the bytes asked for leave the store).

        ds = open_prepared("s3://bucket/corpus")
        ds.num_documents, ds.tokenizer["eos_id"]
        ds.document(3)                      # token ids of document 3, EOS included
        ds.read(1000, 1200)                 # tokens [1000, 1200) of the whole stream
    """

    def __init__(self, index: Index, options: dict | None = None, setting: str = "data.path") -> None:
        self.index = index
        self.url = index.url
        self.store = open_store(index.url, options, setting=setting)
        self.options, self.fs, self.root = self.store.options, self.store.fs, self.store.root
        self.dtype = np.dtype(index.dtype).newbyteorder("<")
        self.shard_paths = [f"{self.root}/{shard_files(i)[0]}" for i in range(len(index.shards))]
        counts = np.array([s["tokens"] for s in index.shards], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(counts)])  # token offset of each shard

    @property
    def tokenizer(self) -> dict:
        return self.index.tokenizer

    @property
    def num_documents(self) -> int:
        return self.index.documents

    @property
    def num_tokens(self) -> int:
        return self.index.tokens

    @cached_property
    def lengths(self) -> np.ndarray:
        """int64 token count of every document, in order (read once, from every shard)."""
        names = [f"{self.root}/{shard_files(i)[1]}" for i in range(len(self.index.shards))]
        blobs = self.fs.cat(names) if names else {}
        parts = [np.load(io.BytesIO(blobs[name]), allow_pickle=False) for name in names]
        lengths = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        if len(lengths) != self.index.documents or int(lengths.sum()) != self.index.tokens:
            raise ValueError(f"{self.url}: the shards' lengths disagree with {INDEX}; prepare it again")
        return lengths

    @cached_property
    def offsets(self) -> np.ndarray:
        """int64 token offset of each document in the stream, and the stream's length last."""
        return np.concatenate([[0], np.cumsum(self.lengths)])

    @cached_property
    def held_out(self) -> np.ndarray:
        """Sorted ids of the documents held out for evaluation (empty when none)."""
        return held_out_documents(self.num_documents, self.index.held_out_fraction)

    def document(self, i: int) -> np.ndarray:
        """Token ids of document `i`, EOS included (and BOS first when prepared with bos=true)."""
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} of {self.num_documents}")
        return self.read(int(self.offsets[i]), int(self.offsets[i + 1]))

    def pieces(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Tokens [start, stop) of the stream as (shard, first token, end token) within shards."""
        out = []
        shard = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self.shard_starts[shard + 1]))
            if end > start:
                base = int(self.shard_starts[shard])
                out.append((shard, start - base, end - base))
            start, shard = end, shard + 1
        return out

    def byte_ranges(self, start: int, stop: int) -> list[tuple[str, int, int]]:
        """Tokens [start, stop) as (path, first byte, end byte) ranges of shard files."""
        size = self.dtype.itemsize
        return [(self.shard_paths[s], a * size, b * size) for s, a, b in self.pieces(start, stop)]

    def decode(self, blobs: list[bytes]) -> np.ndarray:
        """The bytes of consecutive ranges -> token ids (int64)."""
        if not blobs:
            return np.zeros(0, dtype=np.int64)
        return np.frombuffer(b"".join(blobs), dtype=self.dtype).astype(np.int64)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream, with one ranged read per shard it spans."""
        ranges = self.byte_ranges(start, stop)
        if not ranges:
            return np.zeros(0, dtype=np.int64)
        paths, starts, ends = zip(*ranges)
        return self.decode(self.fs.cat_ranges(list(paths), list(starts), list(ends), on_error="raise"))


def open_prepared(url: str, storage_options: dict | None = None, setting: str = "data.path") -> PreparedDataset:
    """Open the prepared dataset at `url` (a path or any fsspec URL) with `storage_options`
    (data.storage_options) for inspection or reading. ConfigError naming `setting` when nothing
    committed is there, or the store cannot be opened."""
    return PreparedDataset(read_index(url, storage_options, setting), storage_options, setting)
