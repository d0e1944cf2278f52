"""The read tasks: each input file read into batches of its documents, every failure raised with
the file's path, so the driver reports it at once without looking for the file itself.

    ray.data.from_items([{"path": p} for p in paths]).map_batches(read_files, batch_size=1, fn_kwargs=...)

Each format's `read` (rayhybrid.prepare.formats) makes the batches: {field: the documents'
texts, "path": the file's path for each}; for a format whose file is a document (text)
{"bytes": the file, "path": its path}, decoded by the tokenizer actors.
What is wrong with a file (not JSON, not Parquet, a row without text in `field`) is a
ConfigError naming it; anything else (an I/O error, a library's crash) is `TaskFailed`, whose
message names the file too. No Ray here: plain code that Ray Data runs.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator

from rayhybrid.errors import ConfigError, RayHybridError
from rayhybrid.prepare.formats import Format, get
from rayhybrid.storage.store import one_line, redact_url


class TaskFailed(RayHybridError):
    """A read, tokenize or write task failed for another reason than its input's content (an
    I/O error, a library's crash); the message names the file or shard it was working on."""


def shown(protocol: str, path: str) -> str:
    """A path of the input's filesystem as the user sees it (with its URL scheme)."""
    return redact_url(f"{protocol}{path}" if protocol and "://" not in path else path)


def read_files(batch: dict, *, fs, fmt: str | Format, field: str, protocol: str) -> Iterator[dict]:
    """Ray Data's UDF for the read tasks: each file of the batch -> batches of its documents,
    read by its format's `read` (the Format itself travels to the task, so a format registered
    only where the prepare started reads there too)."""
    fmt = get(fmt)
    for path in map(str, batch["path"]):
        where = shown(protocol, path)
        try:
            yield from fmt.read(fs, path, field, where)
        except RayHybridError:
            raise
        except Exception as err:  # noqa: BLE001 - every failure leaves with the file's name
            raise failure(err, where, fmt) from None


def failure(err: BaseException, where: str, fmt: str | Format) -> RayHybridError:
    """The error to raise for `err`, met while reading the file `where`."""
    if isinstance(err, UnicodeDecodeError):
        return ConfigError("input", f"{where} is not UTF-8 ({err.reason} at byte {err.start}); convert or remove it")
    if isinstance(err, FileNotFoundError):
        return ConfigError("input", f"{where} disappeared while preparing; list the input again")
    if isinstance(err, (ValueError, EOFError, gzip.BadGzipFile, zlib.error)):  # pyarrow's ArrowInvalid too
        return ConfigError("input", f"{where} is not readable as {get(fmt).what} ({one_line(err)})")
    return TaskFailed(f"reading {where}: {one_line(err)}")
