"""format=jsonl: JSON Lines (optionally gzipped), one document per row, its text in `field`."""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator

from rayhybrid.errors import ConfigError
from rayhybrid.prepare.formats.format import READ_ROWS, Format, no_field, rows

SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson", ".ndjson.gz")


def texts(f, url: str, field: str) -> Iterator[tuple[int, str]]:
    """(line number, `field`'s text) of each row of a JSON Lines file open in binary mode; a
    ConfigError naming the file and the line for a row that is not JSON, not an object, or
    holds no text in `field`."""
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


def _open(fs, path: str):
    raw = fs.open(path, "rb")
    return gzip.open(raw) if path.endswith(".gz") else raw


def read(fs, path: str, field: str, where: str) -> Iterator[dict]:
    with _open(fs, path) as f:
        batch = []
        for _, text in texts(f, where, field):
            batch.append(text)
            if len(batch) == READ_ROWS:
                yield rows(field, batch, path)
                batch = []
        if batch:
            yield rows(field, batch, path)


def inspect(fs, path: str, where: str, field: str, first_only: bool) -> None:
    with _open(fs, path) as f:
        for _ in texts(f, where, field):
            if first_only:
                return


FORMAT = Format(
    name="jsonl",
    what="JSON Lines",
    read=read,
    inspect=inspect,
    suffixes=SUFFIXES,
    help="JSON Lines, one document per row, its text in field= (" + ", ".join(SUFFIXES) + ")",
)
