"""The base of every sample stream (`SampleStream`): what the trainer asks of one, whatever the
data. Its own module so that the streams built here (`streams.py`: generated, text and token
data) and the prepared datasets' reader (`reader.py`) both build on it, and `streams.build_stream`
can pick either without an import circle.
"""

from __future__ import annotations

import numpy as np
import torch


class SampleStream:
    """Base class: `batch(start, count)` returns (inputs, targets), each [count, seq_len] int64."""

    seq_len: int
    loss_floor: float | None = None
    """The best achievable mean cross-entropy (nats/token) when known, else None."""

    def sample(self, index: int) -> np.ndarray:  # seq_len + 1 token ids
        raise NotImplementedError

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([self.sample(start + i) for i in range(count)]).astype(np.int64)
        data = torch.from_numpy(rows)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def prefetch(self, start: int, count: int) -> None:
        """Start reading samples [start, start + count) ahead of `batch` (streams that read a
        store do; generated and memory-mapped data need not)."""

    def provenance(self, index: int) -> tuple[str, int, int | None]:
        """(dataset, epoch, first token) of sample `index`, for data.trace: None where the
        sample is not a window of stored tokens (generated data)."""
        return getattr(self, "source", "synthetic"), 0, None

    def close(self) -> None:
        """Stop reading ahead (a background reader's thread)."""

    def identity(self) -> dict:
        """What fixes this stream's samples besides the seed and seq_len, as JSON (kept in
        checkpoints): the kind of data, and for data read from a store what identifies it."""
        return {"kind": type(self).__name__}
