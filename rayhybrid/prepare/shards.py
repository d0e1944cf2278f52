"""The shards of a prepared dataset, written by Ray Data's write tasks: one shard per task.

Each write task streams its rows (one row per tokenized batch: token bytes and document
lengths, in stream order) into `shard-<task index>.bin` and then writes its `.lengths.npy`.
On the driver, `on_write_complete` orders the shards by task index (the stream's order, with
`preserve_order`) and renames them to `shard-00000`, `shard-00001`, ... where tasks that wrote
nothing left gaps, because readers find shard i at `shard_files(i)`. index.json is not written
here: `rayhybrid.prepare.run` writes it after everything else, as the commit marker.
"""

from __future__ import annotations

import numpy as np
from ray.data import Datasink
from ray.data.block import BlockAccessor

from rayhybrid.data.prepared import lengths_bytes, shard_files
from rayhybrid.errors import RayHybridError
from rayhybrid.prepare.reading import TaskFailed
from rayhybrid.storage.store import one_line, open_store, redact_url


class ShardSink(Datasink):
    """Writes token shards under `url`; after the write, `shards` lists them in stream order as
    the index records them: {"name": "shard-00000", "documents": n, "tokens": t}."""

    def __init__(self, url: str, options: dict, dtype: str) -> None:
        self.url = url
        self.options = dict(options)
        self.itemsize = np.dtype(dtype).itemsize
        self.shards: list[dict] = []

    def get_name(self) -> str:
        return "WriteShards"

    def write(self, blocks, ctx) -> dict:
        try:
            return self._write(blocks, ctx)
        except RayHybridError:
            raise
        except Exception as err:  # noqa: BLE001 - the error leaves with the shard it was writing
            where = f"{redact_url(self.url)}/{shard_files(ctx.task_idx)[0]}"  # never a key in a URL
            raise TaskFailed(f"writing {where}: {one_line(err)}") from None

    def _write(self, blocks, ctx) -> dict:
        store = open_store(self.url, self.options, setting="output")
        fs, root = store.fs, store.root
        token_file, lengths_file = (f"{root}/{name}" for name in shard_files(ctx.task_idx))
        lengths: list[np.ndarray] = []
        num_bytes, out = 0, None
        try:
            for block in blocks:
                table = BlockAccessor.for_block(block).to_arrow()
                for tokens, counts in zip(table.column("tokens").to_pylist(), table.column("lengths").to_pylist()):
                    if not counts:
                        continue
                    if out is None:
                        out = fs.open(token_file, "wb")
                    out.write(tokens)
                    num_bytes += len(tokens)
                    lengths.append(np.frombuffer(counts, dtype=np.int64))
        finally:
            if out is not None:
                out.close()
        if out is None:
            return {"task": ctx.task_idx, "documents": 0, "tokens": 0}
        counts = np.concatenate(lengths)
        assert int(counts.sum()) * self.itemsize == num_bytes, "token bytes disagree with the document lengths"
        fs.pipe_file(lengths_file, lengths_bytes(counts))
        return {"task": ctx.task_idx, "documents": len(counts), "tokens": int(counts.sum())}

    def on_write_complete(self, write_result) -> None:
        written = sorted((r for r in write_result.write_returns if r and r["documents"]), key=lambda r: r["task"])
        self.shards = renumber(self.url, self.options, written)


def renumber(url: str, options: dict, written: list[dict]) -> list[dict]:
    """Rename the shards written by tasks (sorted by task index) to consecutive numbers.
    Safe in ascending order: shard j's new name was either free or already moved away."""
    store = open_store(url, options, setting="output")
    fs, root = store.fs, store.root
    shards = []
    for number, result in enumerate(written):
        if result["task"] != number:
            for old, new in zip(shard_files(result["task"]), shard_files(number)):
                fs.mv(f"{root}/{old}", f"{root}/{new}")
        name = shard_files(number)[0].removesuffix(".bin")
        shards.append({"name": name, "documents": result["documents"], "tokens": result["tokens"]})
    return shards
