"""Checkpoint directories in a `Store` (a local path, a shared mount, s3://, gs://, ...): names,
the commit marker, validation, retention. No torch, no Ray.

Layout under `checkpoint.dir`::

    generation.json     the run's generation and what older ones committed (storage/generation.py)
    step_00000050/      DCP shards (__<rank>_<n>.distcp) and .metadata, then meta.json
    step_00000060/      no meta.json: being written, or a save that was interrupted
    step_00000060.g2/   the same step written by the ranks of generation 2 (generation 0 has no suffix)

Object stores have no rename, so a checkpoint is written in place and published by its commit
marker: `meta.json`, written last, by rank 0, once DCP's `.metadata` says every rank's data is
complete (one PUT: an object is either absent or whole). It records the trainer state (step,
consumed_samples, topology, ...) and the size of every file, so a truncated or partly deleted
checkpoint is detected without reading it. Readers take only committed steps; an uncommitted
directory is never loaded, and the next commit deletes it (`retain`). Whether a checkpoint fits
a run (its model, global batch and data) is `rayhybrid.driver.compatibility.check_fits`,
asked once, by the driver.

Each generation of ranks writes only into its own directories, and a commit by a generation
older than the one the driver published is not accepted (`generation.json`: a rank that was
stopped and resumes after the run moved on, see storage/generation.py): `committed`, `latest`
and `best` pass over it, and `retain` deletes it. Directories of a newer generation than the
caller's are never deleted.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
from dataclasses import dataclass

from rayhybrid.storage import generation as generations
from rayhybrid.storage.generation import Generations
from rayhybrid.storage.store import Store

log = logging.getLogger(__name__)

PREFIX = "step_"
LEGACY_TMP_PREFIX = ".tmp-"  # how checkpoints were written before the commit marker
META = "meta.json"
_NAME = re.compile(rf"^{PREFIX}(\d+)(?:\.g(\d+))?$")


def name_for(step: int, generation: int = 0) -> str:
    """The directory of `step` written by the ranks of `generation` (0: no suffix, as before)."""
    return f"{PREFIX}{step:08d}" + (f".g{generation}" if generation else "")


def step_of(path: str) -> int | None:
    m = _NAME.match(os.path.basename(path.rstrip("/")))
    return int(m.group(1)) if m else None


def generation_of(path: str) -> int:
    """The generation whose ranks wrote the checkpoint directory `path` (0 without a suffix)."""
    m = _NAME.match(os.path.basename(path.rstrip("/")))
    return int(m.group(2) or 0) if m else 0


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


def begin(store: Store, step: int, generation: int = 0) -> str:
    """Make way for the checkpoint of `step` by `generation` (rank 0, before any rank writes): a
    directory of that step this generation wrote before (a save interrupted, or a run that
    went back past it) is uncommitted first, then removed. Returns the path to write to."""
    path = store.join(name_for(step, generation))
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
    if int(meta.get("generation", 0)) != generation_of(path):
        raise ValueError(f"its marker names generation {meta.get('generation', 0)}, its directory another")
    present = file_sizes(store, path)
    for name, size in files.items():
        if name not in present:
            raise ValueError(f"{name} is missing")
        if present[name] != size:
            raise ValueError(f"{name} has {present[name]} bytes, expected {size}")
    return Checkpoint(store.url_of(path), meta)


def next_generation(store: Store, after: int | None = None) -> Generations:
    """The record of the run's next generation (storage/generation.py): past `after` (the
    driver's current one; None at a start: past every generation the store holds, so a resumed
    run never uses one twice; 0 in an empty store), with the generation before it closed at the
    newest step it committed."""
    paths, record = step_dirs(store), generations.read(store)
    if record is None and not paths and after is None:
        return Generations(0)
    before = record or Generations(max((generation_of(p) for p in paths), default=0))
    mine = [p for p in paths if generation_of(p) == before.current and store.fs.exists(f"{p}/{META}")]
    newest = max((step_of(p) for p in mine), default=None)
    return before.after(newest, max(before.current, -1 if after is None else after) + 1)


def step_dirs(store: Store) -> list[str]:
    """Checkpoint directories (committed or not), oldest first (by step, then generation);
    nothing when the root is absent."""
    store.fresh()
    try:
        entries = store.fs.ls(store.root, detail=True)
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        step = step_of(entry["name"])
        if step is not None and entry.get("type") == "directory":
            name = entry["name"].rstrip("/")
            found.append((step, generation_of(name), name))
    return [path for *_, path in sorted(found)]


def accepted(record: Generations | None, path: str) -> bool:
    """Whether readers take the commit in `path`, by the generation record (None: all)."""
    return record is None or record.accepts(generation_of(path), step_of(path))


def fenced_off(store: Store, path: str) -> str | None:
    """Why readers pass over the commit in `path`, a step directory named directly (an export's
    --checkpoint), by the generation record in the checkpoint.dir above it; None when they take
    it (`accepted`: what `latest` and `committed` apply)."""
    record = generations.read(store, posixpath.dirname(path)) if step_of(path) is not None else None
    if accepted(record, path):
        return None
    mine, newest = generation_of(path), record.accepted.get(generation_of(path))
    took = "none of its commits" if newest is None else f"its commits up to step {newest}"
    return (
        f"fenced off: written by a rank of generation {mine} after the run moved on to generation "
        f"{record.current} (generation.json accepts {took})"
    )


def committed(store: Store) -> list[str]:
    """Directories whose commit marker exists, oldest first (complete or not: see `check`),
    but for commits of a fenced-off generation (storage/generation.py)."""
    record = generations.read(store)
    return [p for p in step_dirs(store) if store.fs.exists(f"{p}/{META}") and accepted(record, p)]


def uncommitted(root: Store | str | os.PathLike) -> list[str]:
    """Directories without a commit marker (a save in flight, or one that never finished)."""
    store = as_store(root)
    return [path for path in step_dirs(store) if not store.fs.exists(f"{path}/{META}")]


def latest(root: Store | str | os.PathLike) -> Checkpoint | None:
    """The newest committed, complete checkpoint; uncommitted steps are passed over, and corrupt
    committed ones too, with a warning."""
    store = as_store(root)
    paths = step_dirs(store)
    record = generations.read(store) if paths else None
    for path in reversed(paths):
        if not accepted(record, path):
            if store.fs.exists(f"{path}/{META}"):
                log.warning("skipping checkpoint %s: committed by a fenced-off generation", store.url_of(path))
            continue
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


def retain(store: Store, keep: int, keep_best: bool = False, generation: int | None = None) -> list[str]:
    """After a commit (no other save in flight): delete every uncommitted directory (and every
    commit of a fenced-off generation), and all but the newest `keep` committed ones (0: keep
    all) and, with `keep_best`, the one with the lowest val_loss (`best`). Directories of a
    newer generation than the caller's `generation` are left alone. Returns what was deleted."""
    gone = []
    record = generations.read(store)
    paths = [p for p in step_dirs(store) if generation is None or generation_of(p) <= generation]
    done = [p for p in paths if store.fs.exists(f"{p}/{META}") and accepted(record, p)]
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
