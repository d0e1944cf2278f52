"""The input formats of `python -m rayhybrid.prepare`, one module each, in one registry.

    fmt = get("jsonl")                 # its Format: what, read, inspect, suffixes, field, ...
    format_of("raw/part-0.jsonl.gz")   # the format format=auto takes a file for
    register(Format(name="csv", ...))  # a new format: its module and this one call

Everything prepare does with a format goes through its `Format` (recognising files, the quick
look before Ray, the read tasks, what the tokenizer actors decode, the search for a bad file,
the index's record), so adding one touches its module and `FORMATS` here, nothing else.
"""

from __future__ import annotations

from rayhybrid.errors import ConfigError
from rayhybrid.prepare.formats import hf, jsonl, parquet, text
from rayhybrid.prepare.formats.base import Format

AUTO = "auto"
FORMATS: dict[str, Format] = {}
"""The registry: format=<name> -> its Format, in the order format=auto tries their suffixes."""


def register(fmt: Format) -> Format:
    """Add `fmt` to the registry (a format of the same name is replaced); returns it."""
    FORMATS[fmt.name] = fmt
    return fmt


for _module in (text, jsonl, parquet, hf):
    register(_module.FORMAT)


def names() -> list[str]:
    return [AUTO, *FORMATS]


def fix_format() -> str:
    """The end of a message that asks for a format."""
    return f"choose one with format={'|'.join(FORMATS)}, or narrow input= with a glob"


def get(name: str | Format) -> Format:
    """The registered format called `name` (a Format passes through); ConfigError naming
    `format` for a name none has."""
    if isinstance(name, Format):
        return name
    if name not in FORMATS:
        raise ConfigError("format", f"{name!r} is not a format; choose one of {', '.join(names())}")
    return FORMATS[name]


def format_of(path: str) -> Format:
    """The format a file's name says: the first whose suffixes name it, else the catch-all."""
    for fmt in FORMATS.values():
        if fmt.names_file(path):
            return fmt
    return next(fmt for fmt in FORMATS.values() if fmt.catch_all)


def with_marker() -> list[Format]:
    """The formats whose input is a directory holding a marker file (hf: state.json)."""
    return [fmt for fmt in FORMATS.values() if fmt.marker]


__all__ = ["AUTO", "FORMATS", "Format", "fix_format", "format_of", "get", "names", "register", "with_marker"]
