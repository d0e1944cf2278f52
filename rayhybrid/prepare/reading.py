"""The read tasks: each input file read into batches of its documents, every failure raised with
the file's path, so the driver reports it at once without looking for the file itself.

    ray.data.from_items([{"path": p} for p in paths]).map_batches(read_files, batch_size=1, fn_kwargs=...)

A batch is {field: the documents' texts, "path": the file's path for each}; for format text
(a file is a document) {"bytes": the file, "path": its path}, decoded by the tokenizer actors.
What is wrong with a file (not JSON, not Parquet, a row without text in `field`) is a
ConfigError naming it; anything else (an I/O error, a library's crash) is `TaskFailed`, whose
message names the file too. No Ray here: plain code that Ray Data runs.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator

import numpy as np

from rayhybrid.errors import ConfigError, RayHybridError
from rayhybrid.prepare.inputs import jsonl_texts, no_field
from rayhybrid.storage.store import one_line, redact_url

READ_ROWS = 1024  # documents per batch of a JSON Lines, Parquet or Arrow file
WHAT = {"parquet": "a Parquet file", "hf": "an Arrow stream", "jsonl": "JSON Lines", "text": "a file"}


class TaskFailed(RayHybridError):
    """A read, tokenize or write task failed for another reason than its input's content (an
    I/O error, a library's crash); the message names the file or shard it was working on."""


def shown(protocol: str, path: str) -> str:
    """A path of the input's filesystem as the user sees it (with its URL scheme)."""
    return redact_url(f"{protocol}{path}" if protocol and "://" not in path else path)


def _rows(name: str, values: list, path: str) -> dict:
    return {name: np.array(values, dtype=object), "path": np.array([path] * len(values), dtype=object)}


def _text(fs, path: str, field: str, where: str) -> Iterator[dict]:
    yield _rows("bytes", [fs.cat_file(path)], path)


def _jsonl(fs, path: str, field: str, where: str) -> Iterator[dict]:
    with fs.open(path, "rb") as raw, gzip.open(raw) if path.endswith(".gz") else raw as f:
        texts = []
        for _, text in jsonl_texts(f, where, field):
            texts.append(text)
            if len(texts) == READ_ROWS:
                yield _rows(field, texts, path)
                texts = []
        if texts:
            yield _rows(field, texts, path)


def _parquet(fs, path: str, field: str, where: str) -> Iterator[dict]:
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as f:
        parquet = pq.ParquetFile(f)
        if field not in parquet.schema_arrow.names:
            raise no_field(field, where, parquet.schema_arrow.names)
        for batch in parquet.iter_batches(batch_size=READ_ROWS, columns=[field]):
            yield _rows(field, batch.column(0).to_pylist(), path)


def _arrow(fs, path: str, field: str, where: str) -> Iterator[dict]:
    """An Arrow IPC stream, as `datasets`' save_to_disk writes them (format hf)."""
    import pyarrow as pa

    with fs.open(path, "rb") as f:
        reader = pa.ipc.open_stream(f)
        if field not in reader.schema.names:
            raise no_field(field, where, reader.schema.names)
        for record_batch in reader:
            yield _rows(field, record_batch.column(field).to_pylist(), path)


READERS = {"text": _text, "jsonl": _jsonl, "parquet": _parquet, "hf": _arrow}


def read_files(batch: dict, *, fs, fmt: str, field: str, protocol: str) -> Iterator[dict]:
    """Ray Data's UDF for the read tasks: each file of the batch -> batches of its documents."""
    for path in map(str, batch["path"]):
        where = shown(protocol, path)
        try:
            yield from READERS[fmt](fs, path, field, where)
        except RayHybridError:
            raise
        except Exception as err:  # noqa: BLE001 - every failure leaves with the file's name
            raise failure(err, where, fmt) from None


def failure(err: BaseException, where: str, fmt: str) -> RayHybridError:
    """The error to raise for `err`, met while reading the file `where`."""
    if isinstance(err, UnicodeDecodeError):
        return ConfigError("input", f"{where} is not UTF-8 ({err.reason} at byte {err.start}); convert or remove it")
    if isinstance(err, FileNotFoundError):
        return ConfigError("input", f"{where} disappeared while preparing; list the input again")
    if isinstance(err, (ValueError, EOFError, gzip.BadGzipFile, zlib.error)):  # pyarrow's ArrowInvalid too
        return ConfigError("input", f"{where} is not readable as {WHAT[fmt]} ({one_line(err)})")
    return TaskFailed(f"reading {where}: {one_line(err)}")
