"""The input formats of `python -m rayhybrid.prepare`, one module each, in one registry.

    fmt = get("jsonl")                 # its Format: what, read, inspect, suffixes, field, ...
    format_of("raw/part-0.jsonl.gz")   # the format format=auto takes a file for
    register(Format(name="csv", ...))  # a new format: its module and this one call

Everything prepare does with a format goes through its `Format` (recognising files, the quick
look before Ray, the read tasks, what the tokenizer actors decode, the search for a bad file,
the index's record), so adding one touches its module and the list of built-ins here, nothing else.
"""

from __future__ import annotations

from rayhybrid.prepare.formats import hf, jsonl, parquet, text
from rayhybrid.prepare.formats.format import Format
from rayhybrid.prepare.formats.registry import AUTO, FORMATS, fix_format, format_of, get, names, register, with_marker

for _module in (text, jsonl, parquet, hf):
    register(_module.FORMAT)

__all__ = ["AUTO", "FORMATS", "Format", "fix_format", "format_of", "get", "names", "register", "with_marker"]
