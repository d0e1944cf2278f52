"""Does this checkpoint fit this run? Asked in one place, by the driver, of the checkpoint a run
would resume from, before any worker starts (so a refusal is one ConfigError line naming the
setting, exit 2, and never an error from the workers after they joined): the same model (its
family's settings with their defaults, `models.registry.comparable`), the same global batch and
the same data (`rayhybrid.data.identity.data_identity`, which fixes what sample i is)."""

from __future__ import annotations

from rayhybrid.config.schema import Config
from rayhybrid.errors import ConfigError
from rayhybrid.models.registry import comparable, comparable_record
from rayhybrid.storage.checkpoints import Checkpoint
from rayhybrid.storage.store import redact_url

IGNORED_MODEL_FIELDS = ("flavor", "init_from")
"""Settings that do not change what a checkpoint holds: a run resumed from its own checkpoint
may drop init_from (the checkpoint has the weights now) or come from another preset name."""
RESUME_FIX = "or train into a new checkpoint.dir"


def check_fits(ckpt: Checkpoint | None, cfg: Config, data: dict | None = None) -> None:
    """Whether the run `cfg` may resume from `ckpt` (its latest checkpoint): the same model
    (but for IGNORED_MODEL_FIELDS), the same global batch, and the same data (`data`: the run's
    data identity, `rayhybrid.data.identity.data_identity`, which fixes what sample i is). The
    one place this is asked: the driver asks it before any worker starts, so a refusal is one
    ConfigError line naming the setting (exit 2), not an error from the workers after they
    joined. A checkpoint written before one of these was recorded is not refused on it."""
    if ckpt is None:
        return
    meta, where = ckpt.meta, redact_url(str(ckpt.path))
    _same_model(where, meta.get("model"), cfg)
    recorded = meta.get("global_batch_size")
    if recorded is not None and recorded != cfg.train.global_batch_size:
        raise ConfigError(
            "train.global_batch_size",
            f"{where} was trained with train.global_batch_size={recorded}, here {cfg.train.global_batch_size}; "
            f"resume with the same global batch (it fixes the sample stream and the LR schedule), {RESUME_FIX}",
        )
    if data is not None and meta.get("data") is not None and meta["data"] != data:
        setting, what = _data_difference(meta["data"], data, cfg)
        raise ConfigError(
            setting,
            f"{where} was trained on other data ({what}); resume with the same data settings (they fix which "
            f"sample each step reads), {RESUME_FIX}",
        )


def _same_model(where: str, recorded: dict | None, cfg: Config) -> None:
    """Another model cannot be resumed: the settings that differ, in one line (not DCP's error
    about missing keys from a worker)."""
    if not recorded:
        return  # written before checkpoints recorded the model
    now, recorded = comparable(cfg.model), comparable_record(recorded)
    differ = [
        f"model.{k}={recorded[k]!r} there, {now[k]!r} here"
        for k in now
        if k in recorded and k not in IGNORED_MODEL_FIELDS and recorded[k] != now[k]
    ]
    if differ:
        raise ConfigError(
            "checkpoint.dir",
            f"{where} holds another model ({'; '.join(differ)}); use the same model settings to resume, "
            "or a new checkpoint.dir",
        )


def _data_difference(recorded: dict, now: dict, cfg: Config) -> tuple[str, str]:
    """(the setting to name, what differs) between two data identities."""
    if recorded.get("kind") != now.get("kind"):
        return "data.name", f"data of kind {recorded.get('kind')!r} there, {now.get('kind')!r} here"
    datasets = "data.mix" if cfg.data.mix else "data.path"
    for key, setting in (("datasets", datasets), ("weights", "data.mix"), ("order", "checkpoint.dir")):
        if recorded.get(key) != now.get(key):
            return setting, f"{key} {recorded.get(key)!r} there, {now.get(key)!r} here"
    return "data", f"{recorded} there, {now} here"
