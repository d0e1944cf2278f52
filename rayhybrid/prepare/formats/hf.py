"""format=hf: a Hugging Face dataset saved with `datasets`' save_to_disk: a directory holding
state.json and Arrow IPC streams (`*.arrow`), read in state.json's `_data_files` order, one
document per row, its text in the column `field`."""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator

from rayhybrid.errors import ConfigError
from rayhybrid.prepare.formats.format import Format, check_columns, rows
from rayhybrid.prepare.formats.registry import fix_format
from rayhybrid.storage.store import one_line, redact_url


def files(fs, root: str, spec: str) -> list[str]:
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
        fix = fix_format()
        raise ConfigError(
            "input", f"{redact_url(spec)} is not a saved Hugging Face dataset (no state.json); {fix}"
        ) from None
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError("input", f"{redact_url(spec)}/state.json lists no _data_files ({one_line(err)})") from None
    return [f"{root}/{name}" for name in names]


def read(fs, path: str, field: str, where: str) -> Iterator[dict]:
    import pyarrow as pa

    with fs.open(path, "rb") as f:
        reader = pa.ipc.open_stream(f)
        check_columns(field, where, reader.schema.names)
        for record_batch in reader:
            yield rows(field, record_batch.column(field).to_pylist(), path)


def inspect(fs, path: str, where: str, field: str, first_only: bool) -> None:
    import pyarrow as pa

    with fs.open(path, "rb") as f:
        check_columns(field, where, list(pa.ipc.open_stream(f).schema.names))


FORMAT = Format(
    name="hf",
    what="an Arrow stream",
    read=read,
    inspect=inspect,
    suffixes=(".arrow",),
    marker="state.json",
    listing=files,
    container="a directory saved by datasets' save_to_disk",
    whole_file=False,  # the stream's schema says whether the column is there
    help="a Hugging Face dataset saved with save_to_disk (a directory with state.json and *.arrow), "
    "one document per row, its text in the column field=",
)
