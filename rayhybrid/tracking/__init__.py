"""Experiment tracking: a run's config, step records, events and summary in Weights & Biases and
MLflow (`metrics.wandb`, `metrics.mlflow`), its step scalars in TensorBoard event files
(`metrics.tensorboard`, into <run dir>/tensorboard). The driver logs; the workers never do.

    check_settings(cfg)                             # the settings alone: ConfigError (exit code 2)
    check_environment(cfg)                          # packages, credentials: once per command
    trackers = Trackers.open(cfg, run_dir, store)   # starts (or continues) each enabled tracker's run
    trackers.step(metrics)                          # a step record, as metrics.jsonl has it
    trackers.event(record)                          # checkpoint, resume, restart, resize, preemption, ...
    trackers.close(summary)                         # summary.json's dict; ends the runs with its status

One module per tracker behind `base.Tracker` (`wandb.py`, `mlflow.py`, `tensorboard.py`, each
with its checks: of its settings, and of what it needs where the driver runs). `trackers.py` fans out to the enabled ones and owns the one rule for
steps trained again (after a recovery, or a resume from an older checkpoint): a step a tracker
has already is not logged again; the values first logged stay. A resumed run continues its W&B
and MLflow runs, named in `tracking.json` at the root of the checkpoint store; TensorBoard keeps
nothing there, and continues after the last step of the event files in the run directory.

Names: every tracker gets `base.step_scalars(record)`. W&B and MLflow log those names as they
are; TensorBoard through `tensorboard.tag`, which keeps its tags as they were: `train/<name>`
(`train/loss`, `train/mfu`, ...), `val/loss`, `memory_mb/...`. So it now also has the scalars
it used to leave out (`train/consumed_samples`, `train/eval_s`, `activation_mb/...`, ...); as
before, no events and no summary.

What reaches a tracker is redacted and scrubbed first (`rayhybrid.storage`): no storage secret,
no user:password of a URL. A tracker that fails during the run logs one warning and records
nothing more; training goes on. A setting that cannot work is refused before the run starts
(`rayhybrid.preflight`), a server out of reach by `Trackers.open`, each with a ConfigError naming
it. wandb, mlflow and tensorboardX (which imports torch) are imported only
when their tracker is enabled. Not thread-safe: the driver's thread calls these; MLflow's calls
run on a thread of their own, so a slow server never holds up a step.
"""

from rayhybrid.tracking.base import FINISH_TIMEOUT_S, SKIPPED_KEYS, Start, Tracker, flatten, step_scalars
from rayhybrid.tracking.mlflow import MLflowTracker, is_file_store, mlflow_tracking_uri
from rayhybrid.tracking.tensorboard import TensorBoardTracker, tensorboard_dir
from rayhybrid.tracking.trackers import BACKENDS, TRACKING_FILE, Trackers, check_environment, check_settings
from rayhybrid.tracking.wandb import WandbTracker

_MLflow = MLflowTracker  # the names these classes had in rayhybrid/tracking.py
_Wandb = WandbTracker

__all__ = [
    "BACKENDS",
    "FINISH_TIMEOUT_S",
    "SKIPPED_KEYS",
    "TRACKING_FILE",
    "MLflowTracker",
    "Start",
    "TensorBoardTracker",
    "Tracker",
    "Trackers",
    "WandbTracker",
    "check_environment",
    "check_settings",
    "flatten",
    "is_file_store",
    "mlflow_tracking_uri",
    "step_scalars",
    "tensorboard_dir",
]
