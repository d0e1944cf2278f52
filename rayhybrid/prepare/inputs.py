"""What `input=` names: the files, their format, their order, and their problems in one line.

    inputs = list_inputs("s3://bucket/raw/*.jsonl", "auto", storage_options)
    inputs.format, inputs.files            # "jsonl", (Source(path, url, size), ...) sorted by path
    check_field(inputs, "text")            # the first file has the field (a cheap look, no Ray)
    find_bad_file(inputs, "text")          # after a failure that named no file: a bounded search

A path, a directory (searched recursively; names starting with . or _ are skipped), a glob or
a URL of any fsspec store. `format=auto` goes by extension; a directory holding `state.json`
and `*.arrow` files is a Hugging Face dataset saved with `save_to_disk` (format hf), whose
files are read in `state.json`'s `_data_files` order. No Ray here.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import posixpath
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from rayhybrid.errors import ConfigError
from rayhybrid.storage.store import one_line, redact_url, validate_url

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson", ".ndjson.gz")
FIX_FORMAT = "choose one with format=text|jsonl|parquet|hf, or narrow input= with a glob"


@dataclass(frozen=True)
class Source:
    """One input file: its path in the filesystem's own form, its URL as shown and recorded
    (never with credentials), and its size in bytes."""

    path: str
    url: str
    size: int


@dataclass(frozen=True)
class Inputs:
    """The files of `input=`, sorted (hf: in `state.json`'s order), and how to read them."""

    spec: str
    format: str
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


def kind_of(path: str) -> str:
    """The format a file's name says: jsonl, parquet, arrow, or text (everything else)."""
    name = path.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "arrow" if name.endswith(".arrow") else "text"


def _hidden(path: str) -> bool:
    return posixpath.basename(path.rstrip("/")).startswith((".", "_"))


def _open_fs(spec: str, options: dict):
    validate_url("input", spec)
    try:
        return fsspec.core.url_to_fs(spec, **options)
    except (ImportError, ValueError, TypeError) as err:
        raise ConfigError("input", f"cannot open {redact_url(spec)}: {one_line(err)}") from None


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


def _choose_format(files: dict[str, int], fmt: str, spec: str, is_dir: bool) -> tuple[str, list[str]]:
    """The format and the files to read: auto takes the one format the names say; a given
    format takes a directory's files of that format, and every file a glob or path names."""
    kinds = Counter(kind_of(p) for p in files)
    if fmt == "auto":
        if len(kinds) > 1:
            found = ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items()))
            raise ConfigError("format", f"{redact_url(spec)} holds files of several formats ({found}); {FIX_FORMAT}")
        fmt = next(iter(kinds))
        if fmt == "arrow":
            raise ConfigError("format", f"{redact_url(spec)} holds .arrow files but no state.json; {FIX_FORMAT}")
        return fmt, sorted(files)
    chosen = sorted(p for p in files if kind_of(p) == fmt or not is_dir)
    if not chosen:
        found = ", ".join(sorted(kinds))
        raise ConfigError("input", f"{redact_url(spec)} holds no {fmt} files (found: {found}); {FIX_FORMAT}")
    return fmt, chosen


def _hf_files(fs, root: str, spec: str) -> list[str]:
    """The `*.arrow` files of a dataset saved with `save_to_disk`, in its `state.json` order."""
    if fs.isfile(f"{root}/dataset_dict.json"):
        splits = sorted(posixpath.basename(p) for p in fs.ls(root, detail=False) if fs.isdir(p))
        raise ConfigError(
            "input",
            f"{redact_url(spec)} is a DatasetDict (splits: {', '.join(splits)}); give one split, e.g. "
            f"input={redact_url(spec).rstrip('/')}/{splits[0] if splits else 'train'}",
        )
    try:
        state = json.loads(fs.cat_file(f"{root}/state.json"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except FileNotFoundError:
        raise ConfigError(
            "input", f"{redact_url(spec)} is not a saved Hugging Face dataset (no state.json); {FIX_FORMAT}"
        ) from None
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError("input", f"{redact_url(spec)}/state.json lists no _data_files ({one_line(err)})") from None
    return [f"{root}/{name}" for name in names]


def list_inputs(spec: str, fmt: str, options: dict | None = None) -> Inputs:
    """The files `spec` names, in the format `fmt` (auto: by extension), sorted by path."""
    fs, path = _open_fs(spec, dict(options or {}))
    path = path.rstrip("/") or path
    is_dir = not fsspec.core.has_magic(path) and fs.isdir(path)
    if is_dir and (fmt == "hf" or (fmt == "auto" and fs.isfile(f"{path}/state.json"))):
        fmt, chosen = "hf", _hf_files(fs, path, spec)
        try:
            sizes = {p: int(fs.info(p)["size"]) for p in chosen}
        except FileNotFoundError as err:
            raise ConfigError("input", f"{redact_url(spec)}: state.json names a missing file ({err})") from None
    elif fmt == "hf":
        raise ConfigError("input", f"{redact_url(spec)} is not a directory saved by datasets' save_to_disk")
    else:
        sizes = _matches(fs, path, spec)
        if not sizes:
            raise ConfigError("input", f"{redact_url(spec)} matches no files; give a file, a directory or a glob")
        fmt, chosen = _choose_format(sizes, fmt, spec, is_dir)
    local = isinstance(fs, LocalFileSystem)
    files = tuple(Source(p, redact_url(p if local else fs.unstrip_protocol(p)), sizes[p]) for p in chosen)
    if not any(s.size for s in files):
        raise ConfigError("input", f"{redact_url(spec)}: all {len(files)} {fmt} file(s) are empty; nothing to prepare")
    return Inputs(spec=spec, format=fmt, files=files, fs=fs, base=path if is_dir else "")


# -- the fields of the first file (before Ray starts), and the file to blame after a failure ------


def _open_text(inputs: Inputs, source: Source):
    raw = inputs.fs.open(source.path, "rb")
    return gzip.open(raw) if source.path.endswith(".gz") else raw


def no_field(field: str, url: str, found: list[str]) -> ConfigError:
    shown = ", ".join(map(str, found[:20])) or "none"
    return ConfigError("field", f"{url} has no {field!r} (found: {shown}); give field=<one of them>")


def jsonl_texts(f, url: str, field: str) -> Iterator[tuple[int, str]]:
    """(line number, `field`'s text) of each row of a JSON Lines file open in binary mode; a
    ConfigError naming the file and the line for a row that is not JSON, not an object, or
    holds no text in `field` (also used by the read tasks: rayhybrid.prepare.reading)."""
    for number, line in enumerate(io.TextIOWrapper(f, encoding="utf-8", errors="strict"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise ConfigError("input", f"{url} line {number} is not JSON ({err}); fix or remove it") from None
        if not isinstance(row, dict):
            raise ConfigError("input", f"{url} line {number} is not a JSON object; give JSON Lines")
        if field not in row:
            raise no_field(field, url, list(row))
        if not isinstance(row[field], str):
            kind = "nothing" if row[field] is None else f"a {type(row[field]).__name__}"
            raise ConfigError("field", f"{url} line {number}: {field!r} holds {kind}, not text")
        yield number, row[field]


def _jsonl_problem(inputs: Inputs, source: Source, field: str, first_only: bool) -> ConfigError | None:
    with _open_text(inputs, source) as f:
        try:
            for _ in jsonl_texts(f, source.url, field):
                if first_only:
                    return None
        except ConfigError as err:
            return err
    return None


def _columns(inputs: Inputs, source: Source) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with inputs.fs.open(source.path, "rb") as f:
        if inputs.format == "parquet":
            return list(pq.read_schema(f).names)
        return list(pa.ipc.open_stream(f).schema.names)


def _file_problem(inputs: Inputs, source: Source, field: str, first_only: bool) -> ConfigError | None:
    """What is wrong with one file (None: nothing found). `first_only`: look at its start only."""
    what = {"parquet": "a Parquet file", "hf": "an Arrow stream", "jsonl": "JSON Lines", "text": "UTF-8 text"}
    try:
        if inputs.format == "jsonl":
            return _jsonl_problem(inputs, source, field, first_only)
        if inputs.format in ("parquet", "hf"):
            names = _columns(inputs, source)
            return None if field in names else no_field(field, source.url, names)
        if not first_only:
            inputs.fs.cat_file(source.path).decode("utf-8")
    except UnicodeDecodeError as err:
        return ConfigError(
            "input", f"{source.url} is not UTF-8 ({err.reason} at byte {err.start}); convert or remove it"
        )
    except (OSError, ValueError, EOFError) as err:
        if isinstance(err, FileNotFoundError):
            return ConfigError("input", f"{source.url} disappeared while preparing; list the input again")
        return ConfigError("input", f"{source.url} is not readable as {what[inputs.format]} ({one_line(err)})")
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
    whole = inputs.format in ("jsonl", "text")  # Parquet and Arrow: only the schema is read
    for i, source in enumerate(files):
        cost = source.size if whole else 0
        if time.monotonic() - start >= seconds or read + cost > max_bytes:
            return Search(None, i, len(files), read, time.monotonic() - start)
        problem = _file_problem(inputs, source, field, first_only=False)
        read += cost
        if problem is not None:
            return Search(problem, i + 1, len(files), read, time.monotonic() - start)
    return Search(None, len(files), len(files), read, time.monotonic() - start)
