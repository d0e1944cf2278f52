"""The registry of prepare's input formats (`FORMATS`) and the look-ups on it; the built-in
formats register themselves in `rayhybrid.prepare.formats` (the package), which re-exports
these. A format module may use the look-ups (hf's error names the formats) without importing
the package that imports it."""

from __future__ import annotations

from rayhybrid.errors import ConfigError
from rayhybrid.prepare.formats.format import Format

AUTO = "auto"
FORMATS: dict[str, Format] = {}
"""The registry: format=<name> -> its Format, in the order format=auto tries their suffixes."""


def register(fmt: Format) -> Format:
    """Add `fmt` to the registry (a format of the same name is replaced); returns it."""
    FORMATS[fmt.name] = fmt
    return fmt


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
