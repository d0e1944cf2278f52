"""format=text: a file is one document, read whole as UTF-8 (decoded by the tokenizer actors).
format=auto takes any file that no other format's name claims as text."""

from __future__ import annotations

from collections.abc import Iterator

from rayhybrid.prepare.formats.format import Format, rows


def read(fs, path: str, field: str, where: str) -> Iterator[dict]:
    yield rows("bytes", [fs.cat_file(path)], path)


def inspect(fs, path: str, where: str, field: str, first_only: bool) -> None:
    if not first_only:
        fs.cat_file(path).decode("utf-8")


FORMAT = Format(
    name="text",
    what="UTF-8 text",
    read=read,
    inspect=inspect,
    catch_all=True,
    field=False,
    batch_documents=16,  # whole files per tokenizer call
    help="one document per file, UTF-8 (format=auto: any file no other format names)",
)
