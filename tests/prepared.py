"""Prepared datasets written directly in rayhybrid's format, without Ray or a tokenizer, for the
tests of what reads them (`python -m rayhybrid.prepare` has tests of its own: test_prepare.py).

    write_dataset(tmp_path / "ds", documents, vocab_size=300, shards=3, held_out=0.1)
    write_dataset("s3://bucket/ds", documents)          # any fsspec URL

`documents` are lists of token ids, EOS included (as prepare writes them).
"""

from __future__ import annotations

import hashlib
import json

import fsspec
import numpy as np

from rayhybrid.data.prepared import FORMAT, INDEX, VERSION, held_out_documents, lengths_bytes, shard_files, token_dtype


def random_documents(n: int, vocab_size: int = 300, eos: int = 0, seed: int = 0, lengths=(3, 40)) -> list[list[int]]:
    """`n` documents of random ids in [1, vocab_size), each ending with `eos`."""
    rng = np.random.default_rng(seed)
    return [[*rng.integers(1, vocab_size, size=rng.integers(*lengths)).tolist(), eos] for _ in range(n)]


def write_dataset(
    url,
    documents: list[list[int]],
    *,
    vocab_size: int = 300,
    eos: int = 0,
    shards: int = 2,
    held_out: float = 0.0,
    tokenizer_sha: str = "test-tokenizer",
    name: str = "test",
    commit: bool = True,
) -> str:
    """Write `documents` as a prepared dataset at `url` in `shards` shards; returns the URL.
    `commit=False` leaves out index.json (a prepare that did not finish)."""
    url = str(url).rstrip("/")
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    dtype = np.dtype(token_dtype(vocab_size)).newbyteorder("<")
    cuts = np.linspace(0, len(documents), shards + 1).astype(int)
    listed = []
    for i in range(shards):
        docs = documents[cuts[i] : cuts[i + 1]]
        tokens = np.concatenate([np.asarray(d, dtype) for d in docs]) if docs else np.zeros(0, dtype)
        bin_name, len_name = shard_files(i)
        fs.pipe_file(f"{root}/{bin_name}", tokens.tobytes())
        fs.pipe_file(f"{root}/{len_name}", lengths_bytes(np.array([len(d) for d in docs], np.int64)))
        listed.append({"name": bin_name.removesuffix(".bin"), "documents": len(docs), "tokens": len(tokens)})
    n, total = len(documents), sum(len(d) for d in documents)
    index = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": hashlib.sha256(json.dumps([documents, vocab_size, held_out]).encode()).hexdigest(),
        "dtype": dtype.name,
        "tokenizer": {"name": name, "vocab_size": vocab_size, "eos_id": eos, "bos_id": None, "sha256": tokenizer_sha},
        "bos": False,
        "documents": n,
        "tokens": total,
        "held_out": {"fraction": held_out, "documents": len(held_out_documents(n, held_out))} if held_out else None,
        "shards": listed,
        "sources": [{"path": "generated", "size": total}],
        "input": {"format": "generated", "field": ""},
    }
    if commit:
        fs.pipe_file(f"{root}/{INDEX}", json.dumps(index, indent=1).encode())
    return url
