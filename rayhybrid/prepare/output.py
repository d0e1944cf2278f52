"""Where a prepared dataset goes, and its commit: index.json, written last.

    out = open_output(cfg.output, cfg.storage_options, inputs)  # ConfigError naming `output`
    recipe = make_recipe(inputs, tokenizer, cfg)                # what decides the token stream
    committed(out, recipe)      # the index of the same prepare already there, or None
    clear_stale(out)            # shard files a killed or failed prepare left behind
    index = build_index(recipe, shards, dtype); write_index(out, index)

An output holding index.json is a prepared dataset: the same inputs prepare to it again as
"already prepared", other inputs are refused. An output with shards but no index.json is what
a killed or failed prepare left: its shards are removed and everything is done again.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import uuid
from importlib import metadata

from rayhybrid.data.prepared import FORMAT, INDEX, VERSION, Index, held_out_documents
from rayhybrid.errors import ConfigError
from rayhybrid.storage.store import Store, one_line, open_store, write_json

PROBE = ".rayhybrid-prepare-probe"
STEM = "shard-"
FINGERPRINTED = ("sources", "tokenizer", "bos", "input", "documents", "tokens", "held_out")
"""What the fingerprint hashes: everything that decides the token stream. The tokenizer's name
(its directory's) is left out: the same files under another name give the same stream."""


def open_output(url: str, options: dict, inputs) -> Store:
    """The output store, checked: a known protocol, not inside the input, writable."""
    store = open_store(url, options, setting="output")
    same_fs = type(store.fs) is type(inputs.fs)
    if same_fs and inputs.base and (store.root + "/").startswith(inputs.base.rstrip("/") + "/"):
        raise ConfigError(
            "output",
            f"{store.display} lies inside the input's directory, so its shards would be read as "
            "input next time; choose an output outside it",
        )
    probe = store.join(f"{PROBE}-{uuid.uuid4().hex[:8]}")
    try:
        if store.local:
            os.makedirs(store.root, exist_ok=True)
        store.write_bytes(probe, b"")
        store.fs.rm_file(probe)
    except Exception as err:  # noqa: BLE001 - any client error means it cannot be written
        raise ConfigError(
            "output", f"cannot write to {store.display} ({one_line(err)}); choose an output you can write to"
        ) from None
    return store


def make_recipe(inputs, tokenizer, cfg) -> dict:
    """What the token stream follows from: sources and sizes, tokenizer, bos, format, field
    (none for a format whose file is a document: text) and the held-out fraction."""
    return {
        "sources": [{"path": s.url, "size": s.size} for s in inputs.files],
        "tokenizer": tokenizer.facts(),
        "bos": bool(cfg.bos),
        "input": {"format": inputs.format.name, "field": cfg.field if inputs.format.field else None},
        "val_fraction": float(cfg.val_fraction),
    }


def _same(index: dict, recipe: dict) -> bool:
    def tokenizer(facts: dict) -> dict:
        return {k: v for k, v in facts.items() if k != "name"}

    return (
        index.get("sources") == recipe["sources"]
        and tokenizer(index.get("tokenizer") or {}) == tokenizer(recipe["tokenizer"])
        and bool(index.get("bos")) == recipe["bos"]
        and index.get("input") == recipe["input"]
        and float((index.get("held_out") or {}).get("fraction", 0.0)) == recipe["val_fraction"]
    )


def committed(store: Store, recipe: dict) -> Index | None:
    """The index already at the output when it records the same recipe; None when there is no
    index; ConfigError naming `output` when it holds another dataset."""
    path = store.join(INDEX)
    try:
        text = store.read_bytes(path).decode()
    except FileNotFoundError:
        return None
    fix = "choose another output or remove it"
    try:
        index = Index.parse(store.display, text)
    except (ValueError, KeyError, TypeError):
        raise ConfigError("output", f"{store.display}/{INDEX} is not a prepared dataset's index; {fix}") from None
    if not _same(index.raw, recipe):
        raise ConfigError("output", f"{store.display} holds another prepared dataset; {fix}")
    return index


def clear_stale(store: Store) -> int:
    """Remove the shard files (and probes) a prepare that did not commit left; returns how many."""
    stale = store.fs.glob(store.join(f"{STEM}*")) + store.fs.glob(store.join(f"{PROBE}*"))
    if stale:
        store.fs.rm(stale)
    store.fresh()
    return len(stale)


def held_out(recipe: dict, documents: int) -> dict | None:
    """The index's held_out entry; ConfigError naming `val_fraction` when it holds out no
    document or every one."""
    fraction = recipe["val_fraction"]
    if fraction <= 0:
        return None
    k = len(held_out_documents(documents, fraction))
    if k == 0 or k == documents:
        what = "no document" if k == 0 else "every document"
        raise ConfigError(
            "val_fraction",
            f"{fraction} of {documents} documents holds out {what}; "
            f"choose a fraction between {1 / documents:.3g} and {1 - 1 / documents:.3g}, or 0 for none",
        )
    return {"fraction": fraction, "documents": k}


def _version() -> str:
    try:
        return metadata.version("rayhybrid")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def build_index(recipe: dict, shards: list[dict], dtype: str) -> dict:
    """index.json's content for these shards (in stream order)."""
    documents = sum(s["documents"] for s in shards)
    body = {
        "sources": recipe["sources"],
        "tokenizer": recipe["tokenizer"],
        "bos": recipe["bos"],
        "input": recipe["input"],
        "documents": documents,
        "tokens": sum(s["tokens"] for s in shards),
        "held_out": held_out(recipe, documents),
    }
    hashed = {k: body[k] for k in FINGERPRINTED}
    hashed["tokenizer"] = {k: v for k, v in body["tokenizer"].items() if k != "name"}
    canonical = json.dumps(hashed, sort_keys=True, separators=(",", ":"))
    return {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": hashlib.sha256(canonical.encode()).hexdigest(),
        "dtype": dtype,
        "tokenizer": body["tokenizer"],
        "bos": body["bos"],
        "documents": body["documents"],
        "tokens": body["tokens"],
        "held_out": body["held_out"],
        "shards": shards,
        "sources": body["sources"],
        "input": body["input"],
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "rayhybrid": _version(),
    }


def write_index(store: Store, index: dict) -> str:
    """Write index.json (atomically: a PUT, or a rename on POSIX): the commit. Returns its URL."""
    write_json(store, INDEX, index)
    return f"{store.display}/{INDEX}"
