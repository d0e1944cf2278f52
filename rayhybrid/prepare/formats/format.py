"""What an input format of `python -m rayhybrid.prepare` is: one `Format` value that says how
its files are recognised, what one is called in errors, how one is read (the read task) and
checked (on the driver, before Ray), and whether its documents are rows with a text field or
whole files. Each format's module declares one; `rayhybrid.prepare.formats` registers them.
No Ray here."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from rayhybrid.errors import ConfigError

READ_ROWS = 1024  # documents per batch of a file whose documents are rows
DEFAULT_BATCH = 256  # documents per tokenizer call


@dataclass(frozen=True)
class Format:
    """One input format (`format=<name>`).

    `read(fs, path, field, where)` is the read task's work on one file: batches of its
    documents, {field: texts, "path": the file's path for each} (`rows`), or for a format
    without a field {"bytes": the file, "path": ...}, decoded by the tokenizer actors; a row
    without text in `field` is a ConfigError naming `where` (the file as the user sees it).
    `inspect(fs, path, where, field, first_only)` is the driver's look at one file, before Ray
    (`first_only`: at its start) and after a failure that named no file: it raises a
    ConfigError, or the reader's own error (not UTF-8, not the format, an I/O error)."""

    name: str
    what: str
    """What a file of it is called in errors: "{file} is not readable as {what}"."""
    read: Callable[..., Iterator[dict]]
    inspect: Callable[..., None]
    suffixes: tuple[str, ...] = ()
    """File names (lower case) format=auto takes as this format."""
    catch_all: bool = False
    """format=auto takes a file that no format's suffixes name as this format (text)."""
    marker: str = ""
    """A directory holding this file is one input of this format, whose files `listing` gives
    in their order (a saved Hugging Face dataset's state.json); format=auto looks for it first."""
    listing: Callable[..., list[str]] | None = None
    """(fs, directory, spec) -> the files of a directory holding `marker`, in order."""
    container: str = ""
    """What input= must be for a format with a marker, for the message when it is not."""
    field: bool = True
    """Documents are rows with their text in `field=`; False: a file is one document."""
    whole_file: bool = True
    """Checking a file reads all of it (JSON Lines, text); False: only its head (a schema)."""
    batch_documents: int = DEFAULT_BATCH
    """Documents per tokenizer call (whole files: fewer)."""
    help: str = ""
    """One line for `--help`."""

    def names_file(self, path: str) -> bool:
        return path.lower().endswith(self.suffixes) if self.suffixes else False


def rows(name: str, values: list, path: str) -> dict:
    """A read task's batch: `values` under `name`, each with its file's `path`."""
    return {name: np.array(values, dtype=object), "path": np.array([path] * len(values), dtype=object)}


def no_field(field: str, url: str, found: list[str]) -> ConfigError:
    shown = ", ".join(map(str, found[:20])) or "none"
    return ConfigError("field", f"{url} has no {field!r} (found: {shown}); give field=<one of them>")


def check_columns(field: str, where: str, names: list[str]) -> None:
    """A file whose schema lacks `field` is refused, naming the columns it has."""
    if field not in names:
        raise no_field(field, where, list(names))
