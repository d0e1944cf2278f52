"""Checkpoint directories in a `Store` (a local path, a shared mount, s3://, gs://, ...): names,
the commit marker, validation, retention. No torch, no Ray.

Layout under `checkpoint.dir`::

    step_00000050/      DCP shards (__<rank>_<n>.distcp) and .metadata, then meta.json
    step_00000060/      no meta.json: being written, or a save that was interrupted

Object stores have no rename, so a checkpoint is written in place and published by its commit
marker: `meta.json`, written last, by rank 0, once DCP's `.metadata` says every rank's data is
complete (one PUT: an object is either absent or whole). It records the trainer state (step,
consumed_samples, topology, ...) and the size of every file, so a truncated or partly deleted
checkpoint is detected without reading it. Readers take only committed steps; an uncommitted
directory is never loaded, and the next commit deletes it (`retain`). Whether a checkpoint fits
a run (its model, global batch and data) is `rayhybrid.driver.compatibility.check_fits`,
asked once, by the driver.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass

from rayhybrid.storage.store import Store

log = logging.getLogger(__name__)

PREFIX = "step_"
LEGACY_TMP_PREFIX = ".tmp-"  # how checkpoints were written before the commit marker
META = "meta.json"
_NAME = re.compile(rf"^{PREFIX}(\d+)$")


def name_for(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def step_of(path: str) -> int | None:
    m = _NAME.match(os.path.basename(path.rstrip("/")))
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Checkpoint:
    path: str
    """A local path, or a URL (s3://bucket/prefix/step_00000050)."""
    meta: dict

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def as_store(root: Store | str | os.PathLike) -> Store:
    return root if isinstance(root, Store) else Store.open(root)


def file_sizes(store: Store, path: str) -> dict[str, int]:
    """Name -> size of the files directly under `path` (one listing), without the marker."""
    out = {}
    for entry in store.fs.ls(path, detail=True):
        name = os.path.basename(entry["name"].rstrip("/"))
        if entry.get("type") == "file" and name != META:
            out[name] = int(entry["size"])
    return dict(sorted(out.items()))


def begin(store: Store, step: int) -> str:
    """Make way for the checkpoint of `step` (rank 0, before any rank writes): a directory of
    that step written before (a save interrupted, or a run that went back past it) is
    uncommitted first, then removed. Returns the path to write to."""
    path = store.join(name_for(step))
    store.fresh()
    if store.fs.exists(path):
        if store.fs.exists(f"{path}/{META}"):
            store.fs.rm_file(f"{path}/{META}")
        store.fs.rm(path, recursive=True)
    if store.local:
        os.makedirs(path, exist_ok=True)
    return path


def commit(store: Store, path: str, meta: dict) -> Checkpoint:
    """Publish the checkpoint written at `path`: its marker, with every file's size, last."""
    store.fresh()
    meta = {**meta, "files": file_sizes(store, path)}
    if ".metadata" not in meta["files"]:
        raise ValueError(f"{store.url_of(path)} has no DCP .metadata: the save did not complete")
    store.write_bytes(f"{path}/{META}", json.dumps(meta, indent=2).encode())
    if store.local:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return Checkpoint(store.url_of(path), meta)


def check(store: Store | str | os.PathLike, path: str | os.PathLike | None = None) -> Checkpoint:
    """Raise ValueError saying what is wrong unless the checkpoint at `path` (a path or URL in
    `store`; or `store` itself when no path is given) is committed and complete."""
    if path is None:
        store, path = Store.open(store), os.fspath(store)
    store = as_store(store)
    path = store.relative(os.fspath(path))
    try:
        meta = json.loads(store.read_bytes(f"{path}/{META}"))
    except FileNotFoundError:
        raise ValueError(f"no {META}: not committed (a save that did not finish)") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"no readable {META} ({err.__class__.__name__})") from None
    files = meta.get("files") or {}
    if ".metadata" not in files:
        raise ValueError("no DCP .metadata recorded")
    present = file_sizes(store, path)
    for name, size in files.items():
        if name not in present:
            raise ValueError(f"{name} is missing")
        if present[name] != size:
            raise ValueError(f"{name} has {present[name]} bytes, expected {size}")
    return Checkpoint(store.url_of(path), meta)


def step_dirs(store: Store) -> list[str]:
    """Checkpoint directories (committed or not), oldest first; nothing when the root is absent."""
    store.fresh()
    try:
        entries = store.fs.ls(store.root, detail=True)
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        step = step_of(entry["name"])
        if step is not None and entry.get("type") == "directory":
            found.append((step, entry["name"].rstrip("/")))
    return [path for _, path in sorted(found)]


def committed(store: Store) -> list[str]:
    """Directories whose commit marker exists, oldest first (complete or not: see `check`)."""
    return [path for path in step_dirs(store) if store.fs.exists(f"{path}/{META}")]


def uncommitted(root: Store | str | os.PathLike) -> list[str]:
    """Directories without a commit marker (a save in flight, or one that never finished)."""
    store = as_store(root)
    return [path for path in step_dirs(store) if not store.fs.exists(f"{path}/{META}")]


def latest(root: Store | str | os.PathLike) -> Checkpoint | None:
    """The newest committed, complete checkpoint; uncommitted steps are passed over, and corrupt
    committed ones too, with a warning."""
    store = as_store(root)
    for path in reversed(step_dirs(store)):
        try:
            return check(store, path)
        except ValueError as err:
            if store.fs.exists(f"{path}/{META}"):
                log.warning("skipping checkpoint %s: %s; using an older one", store.url_of(path), err)
    return None


def best(root: Store | str | os.PathLike, paths: list[str] | None = None) -> Checkpoint | None:
    """The committed, complete checkpoint with the lowest held-out loss (`val_loss` in its
    marker: the step was evaluated, see eval.every); the newest of equals. None without one.
    `paths`: the committed directories, when the caller has listed them already."""
    store = as_store(root)
    found = []
    for path in committed(store) if paths is None else paths:
        try:
            ckpt = check(store, path)
        except ValueError:
            continue
        if isinstance(ckpt.meta.get("val_loss"), (int, float)):
            found.append(ckpt)
    return min(found, key=lambda c: (c.meta["val_loss"], -c.step), default=None)


def retain(store: Store, keep: int, keep_best: bool = False) -> list[str]:
    """After a commit (no other save in flight): delete every uncommitted directory, and all but
    the newest `keep` committed ones (0: keep all) and, with `keep_best`, the one with the
    lowest val_loss (`best`). Returns what was deleted."""
    gone = []
    paths = step_dirs(store)
    done = [p for p in paths if store.fs.exists(f"{p}/{META}")]
    gone += [p for p in paths if p not in done]
    if keep > 0:
        kept = best(store, done) if keep_best else None
        gone += [p for p in done[:-keep] if kept is None or step_of(p) != kept.step]
    if store.local and os.path.isdir(store.root):
        gone += [os.path.join(store.root, n) for n in os.listdir(store.root) if n.startswith(LEGACY_TMP_PREFIX)]
    for path in gone:
        try:
            if store.fs.exists(f"{path}/{META}"):
                store.fs.rm_file(f"{path}/{META}")  # uncommit first: never a committed, partial one
            store.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
    return gone
