"""A stream's batches on the rank's device, ready before the step asks (docs/data.md, "Read
ahead"):

    feed = DeviceFeed(stream, device)
    inputs, targets = feed.take((start, count))       # samples [start, start + count) on the device
    feed.ahead([(next_start, count), ...])            # the next steps', read in the background
    ...                                               # the step's forward and backward queued
    feed.stage()                                      # the next batch's copy, behind them

`take` hands out a batch as (inputs, targets) on the device; `ahead` has the stream read the
next ones in its background thread (`SampleStream.prefetch`), dropping whatever else it had
read ahead (a position that jumped: restore, heal, resize). On CUDA the host tensors are
page-locked and copied with non_blocking=True on a copy stream of their own: `stage`, called
once the step's work is queued, starts the next batch's copy if it is read by then (else
`ahead` or `take` start it), so it runs while the device works through this step, and the
compute stream waits for it only when it uses it. On a CPU nothing is pinned or copied: the
batch is the very tensor the stream read, and results are those of reading it directly.
"""

from __future__ import annotations

import torch

from rayhybrid.data.samples import SampleStream, inputs_and_targets

Key = tuple[int, int]


class DeviceFeed:
    """`stream`'s batches on `device`, the next one copied there ahead (CUDA)."""

    def __init__(self, stream: SampleStream, device: torch.device) -> None:
        self.stream, self.device = stream, device
        self.cuda = device.type == "cuda"
        stream.pin_memory = self.cuda
        self.copies = torch.cuda.Stream(device) if self.cuda else None
        self.staged: dict[Key, torch.Tensor] = {}  # batches copied (or being copied) to the device
        self.upcoming: list[Key] = []  # the next steps' batches, as `ahead` was last told

    def take(self, key: Key) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch `key` as (inputs, targets) on the device: copied there ahead, else read ahead,
        else read now."""
        data = self.staged.pop(key, None)
        if data is None:
            data = self._to_device(self.stream.take(*key))
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.copies)
            data.record_stream(current)  # allocated on the copy stream, used on this one
        return inputs_and_targets(data)

    def ahead(self, upcoming: list[Key]) -> None:
        """Read `upcoming` in the background, drop whatever else was read or copied ahead, and
        on CUDA start copying the first of them to the device if it is read already."""
        self.upcoming = list(upcoming)
        self.stream.keep(upcoming)
        for k in [k for k in self.staged if k not in upcoming]:
            del self.staged[k]
        for k in upcoming:
            if k not in self.staged:
                self.stream.prefetch(*k)
        self.stage()

    def stage(self) -> None:
        """On CUDA, start copying the next batch to the device if it is read already (a no-op
        on a CPU, or when it is copied or not yet read)."""
        k = self.upcoming[0] if self.upcoming else None
        if k is not None and self.cuda and k not in self.staged and self.stream.ready(*k):
            self.staged[k] = self._to_device(self.stream.take(*k))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return host
        with torch.cuda.stream(self.copies):
            return host.to(self.device, non_blocking=True)

    def close(self) -> None:
        """Stop the stream's reading ahead and drop what was copied ahead."""
        self.staged.clear()
        self.upcoming = []
        self.stream.close()
