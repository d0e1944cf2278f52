"""Checkpoints: atomic publish, completeness checks, exact resume, and resharding on load.

A checkpoint written by dp2_pp2_tp2 after 3 steps is loaded under other topologies; their next
steps' losses must match continuing under the original topology (float32, CPU). The Llama 3
debug preset does the same from pp2 to tp2 and to FSDP.
"""

from __future__ import annotations

import json
import os

import pytest

from rayhybrid.config.schema import Config, DataConfig, ModelConfig, TrainConfig
from rayhybrid.preflight import load_config
from rayhybrid.storage import checkpoints as store
from rayhybrid.storage.store import Store
from tests.distributed import (
    checkpoint_then_continue,
    replace_topology,
    resume_many,
    run_configs,
    run_ranks,
    train_save_resume,
)

pytestmark = pytest.mark.slow  # Ray or several processes; see the quick tier in README.md

BEFORE, AFTER = 3, 3
RTOL = 1e-5
BASE = Config(
    model=ModelConfig(n_layers=4),
    data=DataConfig(seq_len=32),
    train=TrainConfig(steps=10, global_batch_size=8, micro_batch_size=1, warmup_steps=2),
)
SOURCE = replace_topology(BASE, dp=2, pp=2, tp=2)
WORLD4 = {
    "dp1_pp1_tp4": replace_topology(BASE, tp=4),
    "dp4": replace_topology(BASE, dp=4),
    "pp4": replace_topology(BASE, pp=4),
    "dp2_tp2_fsdp": replace_topology(BASE, dp=2, tp=2, dp_shard=True),
    "pp2_interleaved_tp2": replace_topology(BASE, pp=2, tp=2, schedule="interleaved_1f1b", stages_per_rank=2),
    "dp4_hsdp2": replace_topology(BASE, dp=4, dp_shard=2),  # into HSDP (2 groups x 2 shards)
}
WORLD8 = {
    "same": SOURCE,
    "dp2_pp2_tp2_fsdp": replace_topology(SOURCE, dp_shard=True),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    results = run_ranks(checkpoint_then_continue, 8, SOURCE, str(root), BEFORE, AFTER, timeout=600)
    return root, results[0]


def test_published_atomically_and_complete(source):
    root, result = source
    names = sorted(os.listdir(root))
    assert names == [store.name_for(BEFORE)], names  # nothing else left behind
    ckpt = store.check(root / names[0])
    assert ckpt.meta["step"] == BEFORE and ckpt.meta["consumed_samples"] == BEFORE * 8
    assert ckpt.meta["topology"]["dp"] == 2 and ckpt.path == str(root / names[0]) == result["path"]
    # Rank 0's SaveResult: the save, then its commit reported exactly once (with a step's result
    # when the upload ended during one, else by the wait), with the time its upload took.
    saved, done = result["saved"], result["done"]
    assert saved.step == done.step == BEFORE and saved.path == done.path == result["path"]
    assert done.upload_s is not None and done.error is None and saved.blocked_s is not None
    # 8 ranks wrote shards, but the dp replicas' copies are de-duplicated: total bytes stay
    # about one model + its AdamW state (3 x 234,624 fp32 values for the tiny model at seq 32).
    total = sum(ckpt.meta["files"].values())
    params = 234_624 - 32 * 64  # seq_len 32 instead of 64 positions
    assert 3 * 4 * params <= total < 1.5 * 3 * 4 * params, total


@pytest.mark.parametrize("label", ["same", "dp2_pp2_tp2_fsdp"])
def test_resume_world8(source, label, world8_resumed):
    _, result = source
    check(world8_resumed[label], result["after"])


@pytest.mark.parametrize("label", list(WORLD4))
def test_reshard_world4(source, label, world4_resumed):
    _, result = source
    check(world4_resumed[label], result["after"])


def test_reshard_single_rank(source):
    root, result = source
    (out,) = run_ranks(resume_many, 1, {"dp1": BASE}, str(root), AFTER)
    check(out["dp1"], result["after"])


def check(resumed: dict, expected: list[float]) -> None:
    assert resumed["start"] == BEFORE
    restored = resumed["restored"]  # the trainer's RestoreResult: the step and position it restored
    assert (restored.step, restored.consumed_samples) == (BEFORE, BEFORE * 8) and restored.seconds > 0
    assert resumed["consumed"] == [(BEFORE + i + 1) * 8 for i in range(AFTER)]
    assert resumed["losses"] == pytest.approx(expected, rel=RTOL)


@pytest.fixture(scope="module")
def world8_resumed(source):
    root, _ = source
    return run_configs(resume_many, WORLD8, str(root), AFTER, timeout=600)[0]


@pytest.fixture(scope="module")
def world4_resumed(source):
    root, _ = source
    return run_configs(resume_many, WORLD4, str(root), AFTER, timeout=600)[0]


def test_llama3_resumes_under_other_topologies(tmp_path):
    """llama3_debug saved by pp2 after 3 steps, resumed under tp2 (one KV head per rank) and
    under FSDP: the next steps' losses are pp2's own, uninterrupted ones."""
    llama = Config(model=load_config(["model=llama3_debug"]).model, data=BASE.data, train=BASE.train)
    source = replace_topology(llama, pp=2)
    resume = {"tp2": replace_topology(llama, tp=2), "dp2_fsdp": replace_topology(llama, dp=2, dp_shard=True)}
    (out, _) = run_ranks(
        train_save_resume, 2, {"pp2": source}, "pp2", str(tmp_path), BEFORE, AFTER, resume, timeout=600
    )
    assert out["path"] == str(tmp_path / store.name_for(BEFORE))
    assert store.check(out["path"]).meta["model"]["name"] == "llama3"
    uninterrupted = [m["loss"] for m in out["fresh"]["pp2"]]
    assert uninterrupted[-1] < uninterrupted[0]
    for label in resume:
        check(out["resumed"][label], uninterrupted[BEFORE:])


def test_incomplete_or_corrupt_latest_is_skipped(tmp_path, caplog):
    root = Store.open(tmp_path)
    good, bad, partial = (tmp_path / store.name_for(step) for step in (10, 20, 30))
    for d in (good, bad):
        d.mkdir()
        (d / ".metadata").write_bytes(b"m" * 10)
        (d / "__0_0.distcp").write_bytes(b"x" * 100)
        store.commit(root, str(d), {"step": int(d.name[5:])})
    (bad / "__0_0.distcp").write_bytes(b"x" * 50)  # truncated after the commit
    partial.mkdir()  # no meta.json: a save that never finished
    (partial / "__0_0.distcp").write_bytes(b"x" * 100)
    (tmp_path / (store.LEGACY_TMP_PREFIX + store.name_for(40))).mkdir()  # an older version's temporary
    ckpt = store.latest(tmp_path)
    assert ckpt is not None and ckpt.step == 10
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert "has 50 bytes, expected 100" in warnings and store.name_for(30) not in warnings  # passed over quietly
    assert store.uncommitted(tmp_path) == [str(partial)]
    store.retain(root, keep=2)
    assert sorted(os.listdir(tmp_path)) == [store.name_for(10), store.name_for(20)]
    assert json.loads((bad / store.META).read_text())["step"] == 20


def fake_checkpoint(root, cfg: Config, **meta) -> str:
    """A committed checkpoint as a run of `cfg` writes its meta.json (the DCP files stand-ins:
    nothing loads them), with `meta` changed; returns its directory."""
    import dataclasses

    s = Store.open(root)
    path = store.begin(s, 4)
    s.write_bytes(f"{path}/.metadata", b"m" * 10)
    t = cfg.topology
    written = {
        "version": 1,
        "step": 4,
        "model": dataclasses.asdict(cfg.model),
        "seq_len": cfg.data.seq_len,
        "consumed_samples": 4 * cfg.train.global_batch_size,
        "data": {"kind": "MarkovStream"},
        "global_batch_size": cfg.train.global_batch_size,
        "seed": cfg.seed,
        "topology": {"dp": t.dp, "pp": t.pp, "tp": t.tp, "schedule": t.schedule, "dp_shard": t.dp_shard},
    }
    store.commit(s, path, {**written, **meta})
    return path


@pytest.mark.parametrize(
    "change, setting, words",
    [
        ({"global_batch_size": 32}, "train.global_batch_size", ["train.global_batch_size=32, here 16"]),
        ({"data": {"kind": "WindowStream"}}, "data.name", ["other data", "'WindowStream' there, 'MarkovStream' here"]),
    ],
)
def test_a_resume_that_does_not_fit_is_refused_before_any_worker_starts(tmp_path, change, setting, words):
    """A checkpoint.dir whose latest checkpoint was trained with another global batch, or on
    other data, is refused by the driver from the checkpoint's meta.json and the config alone:
    exit 2, one line naming the setting, and no worker is ever started (the workers used to
    refuse it, each with a ValueError, after they had joined and built the model)."""
    from tests.test_cli import assert_one_line_error, run_cli

    cfg = load_config(["train.steps=8"])
    fake_checkpoint(tmp_path / "ckpts", cfg, **change)
    run_dir = tmp_path / "run"
    args = ["train.steps=8", f"checkpoint.dir={tmp_path / 'ckpts'}", f"hydra.run.dir={run_dir}"]
    proc = run_cli(args, cwd=tmp_path)
    line = assert_one_line_error(proc, f"{setting}:", *words, str(tmp_path / "ckpts" / store.name_for(4)))
    assert "new checkpoint.dir" in line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 0
    assert summary.get("startup_s") is None and "placement" not in summary  # no worker started
    assert not (run_dir / "workers.json").exists()
    assert "started" not in proc.stdout and "resuming" not in proc.stdout


def test_hsdp_checkpoint_resumes_replicated_and_fully_sharded(tmp_path):
    """A checkpoint saved under HSDP (dp4, topology.dp_shard=2) after 3 steps, resumed under
    dp4 replicated, dp4 FSDP over all of dp and dp2 x tp2: the next steps' losses are the HSDP
    run's own, uninterrupted ones (the reverse, into HSDP, is test_reshard_world4's dp4_hsdp2)."""
    source = replace_topology(BASE, dp=4, dp_shard=2)
    resume = {
        "dp4": replace_topology(BASE, dp=4),
        "dp4_fsdp": replace_topology(BASE, dp=4, dp_shard=True),
        "dp2_tp2": replace_topology(BASE, dp=2, tp=2),
    }
    (out, *_) = run_ranks(
        train_save_resume, 4, {"hsdp": source}, "hsdp", str(tmp_path), BEFORE, AFTER, resume, timeout=600
    )
    assert store.check(out["path"]).meta["topology"]["dp_shard"] == 2
    uninterrupted = [m["loss"] for m in out["fresh"]["hsdp"]]
    for label in resume:
        check(out["resumed"][label], uninterrupted[BEFORE:])
