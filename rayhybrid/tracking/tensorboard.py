"""TensorBoard (`metrics.tensorboard`): event files of the step scalars in <run dir>/tensorboard,
written with tensorboardX (a dependency; importing it imports torch, so only when enabled)."""

from __future__ import annotations

import logging
import struct
import uuid
from pathlib import Path

from rayhybrid.config.schema import Config
from rayhybrid.errors import ConfigError
from rayhybrid.storage.store import one_line
from rayhybrid.tracking.base import Start, Tracker

log = logging.getLogger("rayhybrid")

TENSORBOARD_DIR = "tensorboard"
"""Under the run directory: the event files."""


def tensorboard_dir(run_dir: Path) -> Path:
    return Path(run_dir) / TENSORBOARD_DIR


def tag(name: str) -> str:
    """A step scalar's tag (`step_scalars` names it): names with a `/` as they are (`memory_mb/...`,
    `activation_mb/...`), `val_<x>` as `val/<x>`, the others as `train/<name>`."""
    if "/" in name:
        return name
    if name.startswith("val_"):
        return f"val/{name[4:]}"
    return f"train/{name}"


def last_logged_step(directory: Path) -> int:
    """The last step with a scalar in the event files in `directory` (0: none). Each frame of an
    event file: length (8 bytes), its CRC (4), an `Event` protobuf, the data's CRC (4); a frame
    cut short (a writer killed mid-write) ends the file."""
    from tensorboardX.proto import event_pb2

    last = 0
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[i : i + 8])
            end = i + 12 + length
            if end + 4 > len(data):
                break
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12 : end])
            if event.summary.value:
                last = max(last, event.step)
            i = end + 4
    return last


class TensorBoardTracker(Tracker):
    """The step scalars under `tag`'s names; no events and no summary (the run's files have
    those). A resumed run that writes into the same run directory continues after the last step
    the event files there hold."""

    name = "TensorBoard"
    setting = "metrics.tensorboard"

    def __init__(self, writer) -> None:
        super().__init__()
        self.writer = writer

    @staticmethod
    def enabled(cfg: Config) -> bool:
        return cfg.metrics.tensorboard

    @classmethod
    def open(cls, cfg: Config, start: Start) -> TensorBoardTracker:
        directory = tensorboard_dir(start.run_dir)
        last = _continues_after(directory, start)
        try:
            from tensorboardX import SummaryWriter

            # A name of its own: tensorboardX names a file after the second it opens it, and a
            # second writer in that second would overwrite the first's file.
            writer = SummaryWriter(str(directory), filename_suffix=f".{uuid.uuid4().hex[:8]}")
        except Exception as err:  # noqa: BLE001 - no tensorboardX, a directory that cannot be written
            raise ConfigError(
                "metrics.tensorboard", f"could not start the TensorBoard writer ({one_line(err)}); check {directory}"
            ) from None
        tracker = cls(writer)
        tracker.last_step = last
        if last:
            log.info("TensorBoard: continuing in %s from step %d", directory, last + 1)
        return tracker

    def log_step(self, step: int, scalars: dict[str, float], wall: float | None) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(tag(name), value, step, walltime=wall)

    def log_event(self, kind: str, scalars: dict[str, float], record: dict) -> None:
        """Events are not written to TensorBoard (metrics.jsonl and the other trackers have them)."""

    def finish(self, summary: dict, status: str, events: list[dict]) -> None:
        self.writer.close()

    def release(self) -> None:
        try:
            self.writer.close()
        except Exception as err:  # noqa: BLE001
            log.debug("metrics.tensorboard: could not close the writer: %s", one_line(err))

    def abandon(self) -> None:
        self.release()


def _continues_after(directory: Path, start: Start) -> int:
    """The last step an earlier process of the run wrote into `directory`: event files there
    count when the run resumes from a checkpoint, not when it starts over from step 1."""
    if not directory.is_dir():
        return 0
    try:
        last = last_logged_step(directory)
    except Exception as err:  # noqa: BLE001 - an unreadable file: TensorBoard gets every step, as before
        log.warning("metrics.tensorboard: could not read the event files in %s (%s)", directory, one_line(err))
        return 0
    return last if last and start.resuming else 0
