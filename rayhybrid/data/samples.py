"""The base of every sample stream (`SampleStream`): what the trainer asks of one, whatever the
data, and the read-ahead every kind shares. Its own module so that the streams built here
(`streams.py`: generated, text and token data) and the prepared datasets' reader (`reader.py`)
both build on it, and `streams.build_stream` can pick either without an import circle.

    rows = stream.rows(start, count)        # numpy [count, seq_len + 1]: samples [start, start + count)
    stream.prefetch(start, count)           # read them in the background (data.read_ahead)
    tensor = stream.take(start, count)      # torch: the read-ahead's when it has them, else read now
    inputs, targets = stream.batch(start, count)

The read-ahead is keyed by (start, count), and a sample is a function of the data, the seed and
its index alone (docs/design.md, invariant 4): whatever was read ahead is exactly what reading
now would give, so a step redone, skipped or resized into never reads a wrong sample; what is no
longer wanted is dropped (`keep`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch


def inputs_and_targets(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of seq_len + 1 token ids as (inputs, targets), each [rows, seq_len]: every token but
    the last, and every token but the first (the next token of each input)."""
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


class SampleStream:
    """Base class: `batch(start, count)` returns (inputs, targets), each [count, seq_len] int64.
    A kind defines `rows` (all of a batch at once) or `sample` (one row); each falls back on
    the other."""

    seq_len: int
    loss_floor: float | None = None
    """The best achievable mean cross-entropy (nats/token) when known, else None."""
    pin_memory: bool = False
    """Hand out page-locked tensors (set on CUDA, for asynchronous copies to the device)."""
    _pool: ThreadPoolExecutor | None = None
    _ahead: dict[tuple[int, int], Future] | None = None

    def sample(self, index: int) -> np.ndarray:  # seq_len + 1 token ids
        return self.rows(index, 1)[0]

    def rows(self, start: int, count: int) -> np.ndarray:
        """Samples [start, start + count) as one int64 array [count, seq_len + 1]."""
        return np.stack([self.sample(start + i) for i in range(count)]).astype(np.int64, copy=False)

    def tensor(self, start: int, count: int) -> torch.Tensor:
        """`rows` as a tensor, page-locked with `pin_memory`."""
        data = torch.from_numpy(self.rows(start, count).astype(np.int64, copy=False))
        return data.pin_memory() if self.pin_memory else data

    def take(self, start: int, count: int) -> torch.Tensor:
        """Samples [start, start + count) as `tensor`: from the read-ahead when it has them
        (waiting for them if they are still being read), else read now."""
        future = self._ahead.pop((start, count), None) if self._ahead else None
        return future.result() if future is not None else self.tensor(start, count)

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs_and_targets(self.take(start, count))

    def prefetch(self, start: int, count: int) -> None:
        """Start reading samples [start, start + count) in the background, one batch after
        another in a thread of the stream's own."""
        if self._ahead is None:
            self._ahead = {}
        if (start, count) in self._ahead:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayhybrid-read-ahead")
        self._ahead[(start, count)] = self._pool.submit(self.tensor, start, count)

    def ready(self, start: int, count: int) -> bool:
        """Whether samples [start, start + count) are read ahead and done."""
        future = self._ahead.get((start, count)) if self._ahead else None
        return future is not None and future.done()

    def keep(self, wanted) -> None:
        """Drop what was read (or is being read) ahead but is not among `wanted` (start, count)
        pairs: the steps a jump of the position (a restore, a heal, a resize) left behind."""
        for key in [k for k in (self._ahead or {}) if k not in wanted]:
            self._ahead.pop(key).cancel()

    def provenance(self, index: int) -> tuple[str, int, int | None]:
        """(dataset, epoch, first token) of sample `index`, for data.trace: None where the
        sample is not a window of stored tokens (generated data)."""
        return getattr(self, "source", "synthetic"), 0, None

    def close(self) -> None:
        """Stop reading ahead: its thread goes, and what it read with it (a later `prefetch`
        starts another)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._ahead = None

    def identity(self) -> dict:
        """What fixes this stream's samples besides the seed and seq_len, as JSON (kept in
        checkpoints): the kind of data, and for data read from a store what identifies it."""
        return {"kind": type(self).__name__}
