"""Which checkpoint an export reads and which model it holds: `find_checkpoint` (a committed
step directory, or a checkpoint.dir's latest) and `model_of` (the model config, its Hugging Face
adapter and sequence length, from the checkpoint's meta.json). Every way they can be wrong is a
`ConfigError` on --checkpoint that says why."""

from __future__ import annotations

from rayhybrid.errors import ConfigError
from rayhybrid.storage.store import one_line, redact_url


def find_checkpoint(url: str, options: dict):
    """The committed checkpoint at `url` (a step directory, not fenced off by the run's
    generation record above it), or the latest one under it (a checkpoint.dir); ConfigError
    saying why there is none."""
    from rayhybrid.storage import checkpoints as checkpoint_store
    from rayhybrid.storage.store import open_store

    shown = redact_url(url)
    store = open_store(url, options, setting="--checkpoint")
    try:
        exists = store.fs.exists(store.root)
        is_step = checkpoint_store.step_of(store.root) is not None or store.fs.exists(
            f"{store.root}/{checkpoint_store.META}"
        )
    except Exception as err:  # noqa: BLE001 - any client error: the store cannot be read
        raise ConfigError("--checkpoint", f"cannot read {shown} ({one_line(err)})") from None
    if not exists:
        raise ConfigError("--checkpoint", f"{shown} does not exist")
    if is_step:
        try:
            ckpt = checkpoint_store.check(store, store.root)
            fenced = checkpoint_store.fenced_off(store, store.root)  # the reader's rule, as `latest` applies it
        except ValueError as err:
            raise ConfigError("--checkpoint", f"{shown} is not a usable checkpoint: {err}") from None
        if fenced:
            raise ConfigError(
                "--checkpoint", f"{shown} is not a usable checkpoint: {fenced}; give the run's checkpoint.dir"
            )
        return store, ckpt
    ckpt = checkpoint_store.latest(store)
    if ckpt is None:
        raise ConfigError(
            "--checkpoint", f"{shown} holds no committed checkpoint (give a step_<N> directory or a checkpoint.dir)"
        )
    return store, ckpt


def model_of(meta: dict, path: str):
    """(ModelConfig, its adapter, seq_len) from a checkpoint's meta.json."""
    from rayhybrid.models.registry import get_spec, model_from_record

    recorded = meta.get("model")
    if not isinstance(recorded, dict):
        raise ConfigError(
            "--checkpoint",
            f"{redact_url(path)}'s meta.json records no model (written by an older rayhybrid); "
            "save a checkpoint with this version first",
        )
    model = model_from_record(recorded)  # a family's settings an older rayhybrid kept flat too
    spec = get_spec(model)
    if spec.hf is None:
        chosen = f"model.module={model.module}" if model.module else f"model.name={model.name}"
        raise ConfigError("--checkpoint", f"{chosen} has no Hugging Face adapter (SPEC.hf); it cannot be exported")
    seq_len = int(meta.get("seq_len") or model.max_positions or 0)
    return model, spec.hf, seq_len
