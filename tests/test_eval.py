"""Evaluation on held-out data (eval.every, eval.batches): the held-out streams, the settings'
checks, the same val_loss under every topology and schedule (pipelines included) without
touching training, val_loss through a recovery and a resume, and checkpoint.keep_best."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import run_configs

from rayhybrid.config.schema import DataConfig, EvalConfig, WandbConfig
from rayhybrid.data.sources import split_point
from rayhybrid.data.streams import MarkovStream, build_held_out, build_stream
from rayhybrid.errors import ConfigError
from rayhybrid.preflight import load_config
from rayhybrid.storage import checkpoints as cs
from rayhybrid.storage.store import Store

# ------------------------------------------------------------------------------------------
# Held-out streams


def test_synthetic_held_out_is_the_same_chain_from_an_independent_stream():
    train = MarkovStream(64, 32, 4, seed=3)
    held = build_held_out(DataConfig(seq_len=32), 64, 3, train)
    assert held.loss_floor == train.loss_floor and held.successors is train.successors  # the same chain
    seen = {train.sample(i).tobytes() for i in range(400)}
    for i in range(50):
        s = held.sample(i)
        assert s.tobytes() not in seen  # sequences training does not read
        for a, b in itertools.pairwise(s):
            assert b in train.successors[a]  # drawn from the chain
    assert not np.array_equal(held.sample(0), train.sample(0))
    assert np.array_equal(held.sample(7), build_held_out(DataConfig(seq_len=32), 64, 3).sample(7))  # seeded
    assert not np.array_equal(held.sample(7), build_held_out(DataConfig(seq_len=32), 64, 4).sample(7))


def test_val_fraction_splits_the_tokens_and_training_never_reads_the_tail(tmp_path, monkeypatch):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)  # token i at position i: a window says where it came from
    cfg = DataConfig(name="tokens", path=str(path), seq_len=16, val_fraction=0.1)
    cut = split_point(1000, 0.1)
    assert cut == 900
    train, held = build_stream(cfg, 1000, 0), build_held_out(cfg, 1000, 0)
    train_max = max(int(train.sample(i).max()) for i in range(3000))
    held_tokens = [held.sample(i) for i in range(300)]
    assert train_max == cut - 1  # the last training window ends right before the tail
    assert min(int(s.min()) for s in held_tokens) == cut and max(int(s.max()) for s in held_tokens) == 999
    # Given the training stream, the tail is sliced from the tokens it read, not read again.
    from rayhybrid.data import streams as data

    monkeypatch.setattr(data, "_tokens", lambda *args: pytest.fail("data.path read a second time"))
    again = build_held_out(cfg, 1000, 0, train)
    assert all(np.array_equal(again.sample(i), held.sample(i)) for i in range(20))
    monkeypatch.undo()
    # Without a held-out part, training reads everything (the stream of earlier versions).
    whole = build_stream(DataConfig(name="tokens", path=str(path), seq_len=16), 1000, 0)
    assert max(int(whole.sample(i).max()) for i in range(3000)) == 999


def test_val_path_is_read_for_text(tmp_path):
    (tmp_path / "train.txt").write_text("a" * 200)
    (tmp_path / "val.txt").write_text("b" * 200)
    cfg = DataConfig(name="text", path=str(tmp_path / "train.txt"), val_path=str(tmp_path / "val.txt"), seq_len=16)
    assert set(build_stream(cfg, 256, 0).sample(0)) == {ord("a")}
    assert set(build_held_out(cfg, 256, 0).sample(0)) == {ord("b")}


def test_evaluation_is_due_every_n_steps_and_after_the_last():
    assert [s for s in range(1, 13) if EvalConfig(every=5).due(s, 12)] == [5, 10, 12]
    assert not any(EvalConfig(every=0).due(s, 12) for s in range(1, 13))


def _write(tmp_path: Path, name: str, n: int) -> str:
    path = tmp_path / name
    np.zeros(n, dtype=np.uint16).tofile(path)
    return str(path)


@pytest.mark.parametrize(
    ("overrides", "setting", "message"),
    [
        (["eval.batches=0"], "eval.batches", "must be positive, got 0"),
        (["eval.every=-1"], "eval.every", "must not be negative, got -1"),
        (["data.val_fraction=1.5"], "data.val_fraction", "must be in [0, 1), got 1.5"),
        (["data.val_fraction=0.1"], "data.val_fraction", "synthetic data holds out a stream of its own"),
        (["data.val_path=/x"], "data.val_path", "synthetic data holds out a stream of its own"),
        (["checkpoint.keep_best=true"], "checkpoint.keep_best", "needs a held-out loss to compare: set eval.every=N"),
        (
            ["checkpoint.keep_best=true", "eval.every=20", "checkpoint.every=50"],
            "checkpoint.keep_best",
            "make checkpoint.every=50 a multiple of eval.every=20",
        ),
        (["data=tokens", "data.path={big}", "eval.every=10"], "eval.every", "evaluation needs held-out data"),
        (
            ["data=tokens", "data.path={big}", "data.val_path={big}", "data.val_fraction=0.1"],
            "data.val_fraction",
            "set data.val_path or data.val_fraction",
        ),
        (["data=tokens", "data.path={big}", "data.val_path={small}"], "data.val_path", "holds 10 tokens, fewer"),
        (["data=tokens", "data.path={big}", "data.val_path={tmp}/none.bin"], "data.val_path", "matches no file"),
        (["data=tokens", "data.path={big}", "data.val_fraction=0.01"], "data.val_fraction", "leaves 10 held out"),
    ],
)
def test_bad_evaluation_settings_are_one_line_errors(tmp_path, overrides, setting, message):
    names = {"big": _write(tmp_path, "big.bin", 1000), "small": _write(tmp_path, "small.bin", 10), "tmp": tmp_path}
    with pytest.raises(ConfigError) as err:
        load_config([o.format(**names) for o in overrides])
    assert err.value.setting == setting and message in str(err.value) and "\n" not in str(err.value)


def test_good_evaluation_settings_pass(tmp_path):
    big = _write(tmp_path, "big.bin", 2000)  # data=tokens: windows of 129
    cfg = load_config(["data=tokens", f"data.path={big}", "data.val_fraction=0.1", "eval.every=5"])
    assert cfg.eval.every == 5 and cfg.data.val_fraction == 0.1
    cfg = load_config(["eval.every=10", "checkpoint.every=20", "checkpoint.keep_best=true"])
    assert cfg.checkpoint.keep_best
    # A token file that cannot be read is not counted here (no traceback): the workers that
    # open it report what is wrong, as without held-out data (tests/test_recovery.py).
    (tmp_path / "bad.npy").write_bytes(b"not a numpy file")
    assert load_config(["data=tokens", f"data.path={tmp_path / 'bad.npy'}", "data.val_fraction=0.1"])


def test_a_config_error_from_the_cli_exits_2(tmp_path):
    from test_cli import run_cli

    proc = run_cli(["checkpoint.keep_best=true"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "rayhybrid: error: checkpoint.keep_best: needs a held-out loss to compare: set eval.every=N"
    ]


def test_loss_plot_draws_the_held_out_points(tmp_path, monkeypatch):
    import matplotlib.axes

    from rayhybrid.driver.observe import loss_plot

    drawn = []
    plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "plot",
        lambda ax, x, y, **kw: drawn.append((kw.get("label"), list(x), list(y))) or plot(ax, x, y, **kw),
    )
    history = [
        {"step": s, "loss": 5.0 - s / 10, **({"val_loss": 4.0 - s / 10} if s % 2 == 0 else {})} for s in range(1, 6)
    ]
    assert loss_plot(history, None, tmp_path / "loss.png").stat().st_size > 0
    assert drawn[-1] == ("val_loss (held-out)", [2, 4], [3.8, 3.6])


# ------------------------------------------------------------------------------------------
# checkpoint.keep_best's retention


def _checkpoint(store: Store, step: int, val_loss: float | None) -> None:
    path = cs.begin(store, step)
    store.write_bytes(f"{path}/.metadata", b"m")
    cs.commit(store, path, {"step": step, **({"val_loss": val_loss} if val_loss is not None else {})})


def test_keep_best_keeps_the_lowest_val_loss_besides_the_newest(tmp_path):
    store = Store.open(tmp_path)
    for step, val in ((10, 3.0), (20, 2.0), (30, 2.5), (40, None)):
        _checkpoint(store, step, val)
    assert cs.best(store).step == 20
    cs.retain(store, keep=1, keep_best=True)
    assert [cs.step_of(p) for p in cs.committed(store)] == [20, 40]
    cs.retain(store, keep=1)  # without keep_best: the newest only
    assert [cs.step_of(p) for p in cs.committed(store)] == [40]
    assert cs.best(store) is None  # no checkpoint with a val_loss left
    _checkpoint(store, 50, 2.0)
    _checkpoint(store, 60, 2.0)  # a tie: the newer
    assert cs.best(store).step == 60


def test_a_tune_trial_of_a_keep_best_config_is_valid():
    """rayhybrid.tune's trials evaluate nothing, so they cannot keep the best checkpoint either
    (the shipped experiments set checkpoint.keep_best)."""
    from rayhybrid.preflight import check
    from rayhybrid.tune.run import trial_config

    cfg = load_config(["eval.every=5", "checkpoint.every=10", "checkpoint.keep_best=true"])
    trial = trial_config(cfg, {"micro_batch_size": 2, "num_microbatches": 2, "activation_checkpointing": False})
    check(trial)
    assert trial.eval.every == 0 and not trial.checkpoint.keep_best
    # Nor do they log to experiment trackers (whose checks need W&B's key where a trial runs).
    cfg = dataclasses.replace(cfg, metrics=dataclasses.replace(cfg.metrics, wandb=WandbConfig(enabled=True)))
    trial = trial_config(cfg, {"micro_batch_size": 2, "num_microbatches": 2, "activation_checkpointing": False})
    assert not trial.metrics.wandb.enabled and not trial.metrics.mlflow.enabled and trial.metrics.memory


# ------------------------------------------------------------------------------------------
# The same val_loss under every topology and schedule, and training untouched


def evaluate_many(rank: int, cfgs: dict) -> dict[str, tuple]:
    """For each config: val_loss before training and after two steps, evaluated between the
    steps; and a twin trainer's third-step loss and parameters without any evaluation, against
    the first's (evaluation must not move the optimizer, its state or the sample stream)."""
    from rayhybrid.trainer.loop import Trainer

    out = {}
    for label, cfg in cfgs.items():
        tr = Trainer(cfg, rank=rank, device=torch.device("cpu"))
        before = tr.evaluate()
        tr.train_step()
        tr.evaluate()
        tr.train_step()
        after = tr.evaluate()
        third = tr.train_step().metrics
        twin = Trainer(cfg, rank=rank, device=torch.device("cpu"))
        twin_third = [twin.train_step().metrics for _ in range(3)][-1]
        same = all(
            torch.equal(_full(a), _full(b))
            for (_, a), (_, b) in zip(tr.named_parameters(), twin.named_parameters(), strict=True)
        )
        out[label] = (before, after, third["loss"], twin_third["loss"], third["consumed_samples"], same)
        del tr, twin
    return out


def _full(p):
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


EVAL = ["eval.batches=2", "train.global_batch_size=8", "train.micro_batch_size=2", "data.seq_len=32"]
TOPOLOGIES = {
    1: {"dp1": [], "dp1 ckpt": ["train.activation_checkpointing=true"], "llama dp1": ["model=llama3_debug"]},
    2: {
        "dp2": ["+topology=dp2"],
        "dp2 fsdp": ["+topology=dp2", "topology.dp_shard=true"],
        "tp2": ["+topology=tp2"],
        "tp2 loss parallel": ["+topology=tp2", "topology.loss_parallel=true"],
        "pp2 1f1b": ["+topology=pp2"],
        "pp2 gpipe": ["+topology=pp2", "topology.schedule=gpipe"],
        "pp2 interleaved_1f1b": ["+topology=pp2_interleaved"],
        "pp2 interleaved_zb": ["+topology=pp2_interleaved", "topology.schedule=interleaved_zb"],
        "pp2 zbv": ["+topology=pp2_zbv"],
        "llama pp2 zbv": ["model=llama3_debug", "+topology=pp2_zbv"],
        "llama tp2": ["model=llama3_debug", "+topology=tp2"],
    },
}
# dp2_pp2_tp2 (8 ranks): tests/test_recovery.py's SIGKILL test compares its val_loss with one rank's.


@pytest.mark.slow
def test_val_loss_is_the_same_under_every_topology_and_leaves_training_alone():
    results = {}
    for group in TOPOLOGIES.values():
        cfgs = {label: load_config([*EVAL, *ov]) for label, ov in group.items()}
        ranks = run_configs(evaluate_many, cfgs)
        for label in group:
            assert len({r[label][:2] for r in ranks}) == 1, f"{label}: ranks disagree"  # every rank has it
            results[label] = ranks[0][label]
    for label, (before, after, third, twin_third, consumed, same) in results.items():
        reference = results["llama dp1" if label.startswith("llama") else "dp1"]
        assert before == pytest.approx(reference[0], rel=1e-5), label
        assert after == pytest.approx(reference[1], rel=1e-5), label
        assert after < before, label  # two steps of training lower it
        # Training with evaluations in between is training without them, bit for bit.
        assert third == twin_third and same and consumed == 3 * 8, label


# ------------------------------------------------------------------------------------------
# Through the driver: a recovery, a resume, the records and keep_best


COMMON = [*EVAL, "checkpoint.every=3", "eval.every=3", "train.steps=12"]


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def val_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in records(run_dir) if "val_loss" in r}


@pytest.fixture(scope="module")
def reference(local_ray, tmp_path_factory):
    """An uninterrupted run on one rank, with TensorBoard on: its val_loss at steps 3, 6, 9, 12."""
    import rayhybrid

    run_dir = tmp_path_factory.mktemp("ref")
    summary = rayhybrid.train([*COMMON, "metrics.tensorboard=true"], run_dir=run_dir)
    assert summary["status"] == "completed"
    return run_dir, summary


@pytest.mark.slow
def test_val_loss_is_recorded_everywhere(reference):
    from test_observe import _scalars

    run_dir, summary = reference
    vals = val_losses(run_dir)
    assert sorted(vals) == [3, 6, 9, 12] and vals[12] < vals[3]
    assert all(r["eval_s"] > 0 for r in records(run_dir) if "val_loss" in r)
    assert summary["final_val_loss"] == vals[12]
    assert (summary["best_val_loss"], summary["best_val_step"]) == (min(vals.values()), min(vals, key=vals.get))
    assert json.loads((run_dir / "summary.json").read_text())["final_val_loss"] == vals[12]
    # Each checkpoint's marker carries the val_loss of its step.
    for path in cs.committed(Store.open(run_dir / "checkpoints")):
        meta = cs.check(Store.open(run_dir / "checkpoints"), path).meta
        assert meta["val_loss"] == vals[meta["step"]]
    assert _scalars(run_dir / "tensorboard", "val/loss") == pytest.approx(vals, rel=1e-6)
    assert (run_dir / "loss.png").stat().st_size > 0


@pytest.mark.slow
def test_a_recovered_and_a_resumed_run_report_the_same_val_loss_and_track_one_run(reference, tmp_path):
    """pp2 zbv, with W&B (offline) and MLflow (a file store) on: rank 1 is killed at step 5
    (recovery from step 3), and the run fails at step 8 with no restarts left; the same command
    resumes it from the checkpoint of step 6. The held-out losses are the uninterrupted run's,
    and the two processes log into one W&B run and one MLflow run, every step once. (A
    recovery under dp2_pp2_tp2: tests/test_recovery.py's SIGKILL test.)"""
    from test_tracking import history, mlflow_client, wandb_run

    import rayhybrid
    from rayhybrid.driver.controller import RunFailed

    expected = val_losses(reference[0])
    trackers = [
        "metrics.wandb.enabled=true",
        "metrics.wandb.mode=offline",
        "metrics.mlflow.enabled=true",
        f"metrics.mlflow.tracking_uri={(tmp_path / 'mlruns').as_uri()}",
    ]
    # Synchronous saves: the checkpoint of step 6 is committed before step 7 starts (an upload
    # still in flight when step 8 fails would be abandoned, and the resume would start at 3).
    ckpt = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.async_save=false"]
    zbv = ["+topology=pp2_zbv", *COMMON, *ckpt, *trackers]
    with pytest.raises(RunFailed):
        faults = ["fault.inject=[kill@5:1,raise@8]", "fault.max_restarts=1"]
        rayhybrid.train([*zbv, *faults], run_dir=tmp_path / "first")
    assert val_losses(tmp_path / "first") == pytest.approx({3: expected[3], 6: expected[6]}, rel=1e-5)
    resumed = rayhybrid.train(zbv, run_dir=tmp_path / "second")
    assert resumed["status"] == "completed" and resumed["resumed_step"] == 6
    assert val_losses(tmp_path / "second") == pytest.approx({9: expected[9], 12: expected[12]}, rel=1e-5)

    # MLflow: one run, finished; the loss of every step once, the held-out loss of all four.
    client = mlflow_client(tmp_path)
    (run,) = client.search_runs([client.get_experiment_by_name("rayhybrid").experiment_id])
    assert run.info.status == "FINISHED"
    assert sorted(history(client, run.info.run_id, "loss")) == list(range(1, 13))
    assert history(client, run.info.run_id, "val_loss") == pytest.approx(expected, rel=1e-5)
    assert list(history(client, run.info.run_id, "events/restart").values()) == [1.0]  # one restart
    assert run.data.metrics["summary/final_val_loss"] == pytest.approx(expected[12], rel=1e-5)
    # W&B: the second process continued the first's run: the same id, the steps after its last.
    first, second = wandb_run(tmp_path / "first"), wandb_run(tmp_path / "second")
    assert first["id"] == second["id"]
    assert sorted(first["history"]) == list(range(1, 8)) and sorted(second["history"]) == list(range(8, 13))
    assert second["history"][12]["val_loss"] == pytest.approx(expected[12], rel=1e-5)
    assert (first["exit_code"], second["exit_code"]) == (1, 0)


@pytest.mark.slow
def test_text_data_held_out_tail_and_keep_best(local_ray, tmp_path, caplog):
    """Byte-level text with data.val_fraction, checkpoint.keep=1 and keep_best: a learning rate
    that grows until training diverges makes the held-out loss rise after step 3 (seen: 4.88,
    6.28, 8.48 at steps 3, 6, 9), so that step's checkpoint is kept beside the newest, and
    named in the summary."""
    import rayhybrid

    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    summary = rayhybrid.train(
        [
            *EVAL,
            "data=text",
            f"data.path={text}",
            "data.val_fraction=0.2",
            "eval.every=3",
            "checkpoint.every=3",
            "checkpoint.keep=1",
            "checkpoint.keep_best=true",
            "train.steps=9",
            "train.lr=3",  # warming up over 60 steps: 0.05 at step 1, 0.45 at step 9
            "train.warmup_steps=60",
            "train.grad_clip=0",
        ],
        run_dir=tmp_path / "run",
    )
    vals = val_losses(tmp_path / "run")
    assert sorted(vals) == [3, 6, 9]
    best = min(vals, key=vals.get)
    kept = sorted({best, 9})
    assert [cs.step_of(p) for p in cs.committed(Store.open(tmp_path / "run" / "checkpoints"))] == kept
    assert summary["best_checkpoint"].endswith(cs.name_for(best)) and summary["best_val_step"] == best
    assert best == 3, vals
    lines = [r.getMessage() for r in caplog.records if r.name == "rayhybrid"]
    assert [line.split("|")[-1].strip() for line in lines if line.startswith("step ") and "val_loss" in line] == [
        f"val_loss {vals[step]:.4f}" for step in (3, 6, 9)
    ]
    assert f"best checkpoint: {summary['best_checkpoint']} (step 3, val_loss {vals[3]:.4f})" in lines
    assert f"val_loss {vals[9]:.4f} (best {vals[3]:.4f} at step 3)" in lines[-1]
