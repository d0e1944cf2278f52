"""format=parquet: Parquet files, one document per row, its text in the column `field`."""

from __future__ import annotations

from collections.abc import Iterator

from rayhybrid.prepare.formats.format import READ_ROWS, Format, check_columns, rows


def read(fs, path: str, field: str, where: str) -> Iterator[dict]:
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as f:
        parquet = pq.ParquetFile(f)
        check_columns(field, where, parquet.schema_arrow.names)
        for batch in parquet.iter_batches(batch_size=READ_ROWS, columns=[field]):
            yield rows(field, batch.column(0).to_pylist(), path)


def inspect(fs, path: str, where: str, field: str, first_only: bool) -> None:
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as f:
        check_columns(field, where, list(pq.read_schema(f).names))


FORMAT = Format(
    name="parquet",
    what="a Parquet file",
    read=read,
    inspect=inspect,
    suffixes=(".parquet",),
    whole_file=False,  # the schema says whether the column is there
    help="Parquet, one document per row, its text in the column field= (.parquet)",
)
