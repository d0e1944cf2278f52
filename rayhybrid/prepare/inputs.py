"""What `input=` names: the files, their format, their order, and their problems in one line.

    inputs = list_inputs("s3://bucket/raw/*.jsonl", "auto", storage_options)
    inputs.format, inputs.files            # the jsonl Format, (Source(path, url, size), ...) sorted by path
    check_field(inputs, "text")            # the first file has the field (a cheap look, no Ray)
    find_bad_file(inputs, "text")          # after a failure that named no file: a bounded search

A path, a directory (searched recursively; names starting with . or _ are skipped), a glob or
a URL of any fsspec store, opened as every store is (`rayhybrid.storage.store.open_store`).
What a format is, how its files are recognised and read, is its `Format`
(`rayhybrid.prepare.formats`): `format=auto` takes a directory holding a format's marker (a
saved Hugging Face dataset's state.json) as that format, in the order the marker lists, else
goes by each file's name. No Ray here.
"""

from __future__ import annotations

import os
import posixpath
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from rayhybrid.errors import ConfigError
from rayhybrid.prepare.formats import AUTO, Format, fix_format, format_of, get, with_marker
from rayhybrid.storage.store import one_line, open_store, redact_url


@dataclass(frozen=True)
class Source:
    """One input file: its path in the filesystem's own form, its URL as shown and recorded
    (never with credentials), and its size in bytes."""

    path: str
    url: str
    size: int


@dataclass(frozen=True)
class Inputs:
    """The files of `input=`, sorted (a marked directory: in its marker's order), and their format."""

    spec: str
    format: Format
    files: tuple[Source, ...]
    fs: Any
    base: str  # the directory read recursively (its own form), "" when input= is a file or a glob

    @property
    def display(self) -> str:
        return redact_url(self.spec)

    @property
    def readable(self) -> tuple[Source, ...]:
        """The files that hold anything (an empty file holds no document)."""
        return tuple(s for s in self.files if s.size > 0)

    @property
    def num_bytes(self) -> int:
        return sum(s.size for s in self.files)

    @property
    def local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    @property
    def protocol(self) -> str:
        """The URL scheme paths of this store are shown with ("" for local paths)."""
        return "" if self.local else self.fs.unstrip_protocol("x")[: -len("x")]


def _hidden(path: str) -> bool:
    return posixpath.basename(path.rstrip("/")).startswith((".", "_"))


def _matches(fs, path: str, spec: str) -> dict[str, int]:
    """{file path: size} of everything `path` names: a file, a directory's files, a glob's."""
    try:
        if fsspec.core.has_magic(path):
            found = fs.glob(path, detail=True)
        elif fs.isdir(path):
            found = fs.find(path, detail=True)
        elif fs.isfile(path):
            found = {path: fs.info(path)}
        else:
            found = {}
    except (OSError, ValueError) as err:
        raise ConfigError("input", f"cannot list {redact_url(spec)}: {one_line(err)}") from None
    files = {}
    for name, info in found.items():
        if info.get("type") == "directory":
            files.update({n: i["size"] for n, i in fs.find(name, detail=True).items() if not _hidden(n)})
        elif not (_hidden(name) and name != path):
            files[name] = int(info.get("size") or 0)
    return files


def _choose_format(files: dict[str, int], fmt: Format | None, spec: str, is_dir: bool) -> tuple[Format, list[str]]:
    """The format and the files to read: auto (`fmt` None) takes the one format the names say;
    a given format takes a directory's files of that format, and every file a glob or path names."""
    kinds = Counter(format_of(p).name for p in files)
    if fmt is None:
        if len(kinds) > 1:
            found = ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items()))
            raise ConfigError("format", f"{redact_url(spec)} holds files of several formats ({found}); {fix_format()}")
        fmt = get(next(iter(kinds)))
        if fmt.marker:
            raise ConfigError(
                "format", f"{redact_url(spec)} holds {fmt.suffixes[0]} files but no {fmt.marker}; {fix_format()}"
            )
        return fmt, sorted(files)
    chosen = sorted(p for p in files if format_of(p) is fmt or not is_dir)
    if not chosen:
        found = ", ".join(sorted(kinds))
        raise ConfigError("input", f"{redact_url(spec)} holds no {fmt.name} files (found: {found}); {fix_format()}")
    return fmt, chosen


def _marked(fs, path: str, fmt: Format | None, is_dir: bool) -> Format | None:
    """The format of a directory holding its marker: the given one, or with auto the first
    whose marker is there. None: input= is read file by file."""
    if fmt is not None:
        return fmt if fmt.marker else None
    if is_dir:
        return next((f for f in with_marker() if fs.isfile(f"{path}/{f.marker}")), None)
    return None


def list_inputs(spec: str, fmt: str | Format, options: dict | None = None) -> Inputs:
    """The files `spec` names, in the format `fmt` (auto: by their names), sorted by path."""
    given = None if fmt == AUTO else get(fmt)
    store = open_store(spec, options, setting="input")
    fs, path = store.fs, store.root or "/"
    is_dir = not fsspec.core.has_magic(path) and fs.isdir(path)
    marked = _marked(fs, path, given, is_dir)
    if marked is not None and is_dir:
        chosen = marked.listing(fs, path, spec)
        try:
            sizes = {p: int(fs.info(p)["size"]) for p in chosen}
        except FileNotFoundError as err:
            raise ConfigError("input", f"{redact_url(spec)}: {marked.marker} names a missing file ({err})") from None
        fmt = marked
    elif marked is not None:
        raise ConfigError("input", f"{redact_url(spec)} is not {marked.container}")
    else:
        sizes = _matches(fs, path, spec)
        if not sizes:
            raise ConfigError("input", f"{redact_url(spec)} matches no files; give a file, a directory or a glob")
        fmt, chosen = _choose_format(sizes, given, spec, is_dir)
    local = isinstance(fs, LocalFileSystem)
    files = tuple(Source(p, redact_url(p if local else fs.unstrip_protocol(p)), sizes[p]) for p in chosen)
    if not any(s.size for s in files):
        raise ConfigError(
            "input", f"{redact_url(spec)}: all {len(files)} {fmt.name} file(s) are empty; nothing to prepare"
        )
    return Inputs(spec=spec, format=fmt, files=files, fs=fs, base=path if is_dir else "")


# -- the fields of the first file (before Ray starts), and the file to blame after a failure ------


def _file_problem(inputs: Inputs, source: Source, field: str, first_only: bool) -> ConfigError | None:
    """What is wrong with one file (None: nothing found). `first_only`: look at its start only."""
    fmt = inputs.format
    try:
        fmt.inspect(inputs.fs, source.path, source.url, field, first_only)
    except ConfigError as err:
        return err
    except UnicodeDecodeError as err:
        return ConfigError(
            "input", f"{source.url} is not UTF-8 ({err.reason} at byte {err.start}); convert or remove it"
        )
    except (OSError, ValueError, EOFError) as err:
        if isinstance(err, FileNotFoundError):
            return ConfigError("input", f"{source.url} disappeared while preparing; list the input again")
        return ConfigError("input", f"{source.url} is not readable as {fmt.what} ({one_line(err)})")
    return None


def check_field(inputs: Inputs, field: str) -> None:
    """A quick look at the first file that holds anything: is it readable, has it `field`."""
    problem = _file_problem(inputs, inputs.readable[0], field, first_only=True)
    if problem is not None:
        raise problem


def sees_file(path: str, size: int) -> str | None:
    """On a node: None when it sees the local file `path` with `size` bytes, else what it sees
    (the start-up check of a prepare on several nodes: rayhybrid.prepare.run.check_nodes)."""
    try:
        seen = os.path.getsize(path)
    except FileNotFoundError:
        return "does not see it (a disk of its own?)"
    except OSError as err:
        return f"cannot read it ({one_line(err)})"
    return None if seen == size else f"sees {seen} bytes there, not {size} (a disk of its own?)"


SEARCH_SECONDS = 10.0
SEARCH_BYTES = 256 << 20
"""How long, and how many bytes, `find_bad_file` reads before it stops looking."""


@dataclass(frozen=True)
class Search:
    """What `find_bad_file` found: the file to blame (or None), and how far it looked."""

    problem: ConfigError | None
    checked: int
    total: int
    num_bytes: int
    seconds: float

    def note(self) -> str:
        """How far the search went, for an error that names no file."""
        looked = f"looked at {self.checked} of {self.total} input files ({self.num_bytes / 1e6:.1f} MB, {self.seconds:.1f} s)"
        if self.checked < self.total:
            return f"{looked} and stopped there, at the search's bound: found nothing wrong in them"
        return f"{looked}: found nothing wrong"


def find_bad_file(inputs: Inputs, field: str, seconds: float | None = None, max_bytes: int | None = None) -> Search:
    """After a failure that named no file: the first file, in input order, that cannot be read
    as its format or lacks `field`. It stops after `seconds`, or before a file that would take
    it past `max_bytes` read, so a failure on a large corpus is reported in seconds, not after
    reading the corpus on the driver (defaults: SEARCH_SECONDS, SEARCH_BYTES)."""
    seconds = SEARCH_SECONDS if seconds is None else seconds
    max_bytes = SEARCH_BYTES if max_bytes is None else max_bytes
    files, start, read = inputs.readable, time.monotonic(), 0
    whole = inputs.format.whole_file  # Parquet and Arrow: only the schema is read
    for i, source in enumerate(files):
        cost = source.size if whole else 0
        if time.monotonic() - start >= seconds or read + cost > max_bytes:
            return Search(None, i, len(files), read, time.monotonic() - start)
        problem = _file_problem(inputs, source, field, first_only=False)
        read += cost
        if problem is not None:
            return Search(problem, i + 1, len(files), read, time.monotonic() - start)
    return Search(None, len(files), len(files), read, time.monotonic() - start)
