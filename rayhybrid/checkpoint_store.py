"""Checkpoint directories on a filesystem: names, validation, retention. No torch, no Ray.

Layout under `checkpoint.dir`::

    step_00000050/          a published checkpoint: DCP shards + .metadata + meta.json
    .tmp-step_00000060/     being written; published by one rename once every rank is done

`meta.json` records the trainer state (step, consumed_samples, topology, ...) and the size of
every file, so a truncated or partly deleted checkpoint is detected without reading it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "step_"
TMP_PREFIX = ".tmp-"
META = "meta.json"
_NAME = re.compile(rf"^{PREFIX}(\d+)$")


def name_for(step: int) -> str:
    return f"{PREFIX}{step:08d}"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    meta: dict

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def file_sizes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file() and p.name != META}


def write_meta(path: Path, meta: dict) -> None:
    meta = {**meta, "files": file_sizes(path)}
    tmp = path / (META + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / META)


def publish(tmp: Path, final: Path) -> None:
    """The one rename that makes a checkpoint visible."""
    if final.exists():  # the same step written again (after a restart): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check(path: Path) -> Checkpoint:
    """Raise ValueError saying what is wrong unless `path` is a complete checkpoint."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"no readable {META} ({err.__class__.__name__})") from None
    files = meta.get("files") or {}
    if ".metadata" not in files:
        raise ValueError("no DCP .metadata recorded")
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            raise ValueError(f"{name} is missing")
        if f.stat().st_size != size:
            raise ValueError(f"{name} has {f.stat().st_size} bytes, expected {size}")
    return Checkpoint(path, meta)


def published(root: Path) -> list[Path]:
    """Published checkpoint directories, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest(root: str | os.PathLike) -> Checkpoint | None:
    """The newest complete checkpoint; incomplete or corrupt newer ones are skipped with a warning."""
    for path in reversed(published(Path(root))):
        try:
            return check(path)
        except ValueError as err:
            log.warning("skipping checkpoint %s: %s; using an older one", path, err)
    return None


def retain(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` published checkpoints, and stale temporary ones."""
    for path in root.glob(TMP_PREFIX + "*"):
        shutil.rmtree(path, ignore_errors=True)
    if keep > 0:
        for path in published(root)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
