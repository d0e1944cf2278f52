"""Zombie ranks fenced off by the run's generation (storage/generation.py, trainer/fence.py).

A rank that is stopped rather than dead (its node cut off the network) is replaced, and may
resume later: it must write nothing that the run or a resume reads. First in one process: a
save held mid-upload while the driver moves the run to a newer generation is refused, and a
commit that got past the check anyway is passed over by every reader. Then as a partition
looks, on a 3-node `ray.cluster_utils.Cluster` (dp2, one rank per node, a spare node): every
process of rank 0's node is stopped (SIGSTOP) while the final checkpoint uploads (a slow store:
`RAYHYBRID_TEST_UPLOAD_DELAY_S`); the run declares the node lost, heals rank 0 on the spare
node from rank 1 and saves again. Then rank 0's process is continued alone (its raylet would
kill it once told it is dead): it must exit without committing, the checkpoints stay valid,
and a resume from the last one trains an uninterrupted run's losses."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

import rayhybrid
from benchmarks.clusters import local_cluster
from rayhybrid.cluster import drain as drain_module
from rayhybrid.storage import checkpoints as cs
from rayhybrid.storage import generation as generations
from rayhybrid.storage.generation import Fenced, Generations
from rayhybrid.storage.store import Store
from rayhybrid.trainer import checkpoint as ckpt
from rayhybrid.trainer import upload
from rayhybrid.trainer.fence import Fence
from tests.clusters import fenced_line, gone, node_pids, signal_all
from tests.test_recovery import in_background, losses, when_step
from tests.test_storage import FakeTrainer, commit_step, gate, gloo, s3, url  # noqa: F401 - fixtures

# -- in one process -------------------------------------------------------------------------


def test_a_rank_of_an_older_generation_commits_nothing_that_is_read(gloo, url, gate):  # noqa: F811
    """Rank 0 of generation 1 saves; while its upload is held the driver moves the run to
    generation 2. The upload ends refused (no marker), and a marker written past the check
    (a rank stopped between its check and its write) is passed over by readers and deleted
    by the next generation's retention. The same save by the current generation commits."""
    store = Store.open(url)
    generations.publish(store, cs.next_generation(store))  # a first start: generation 0
    generations.publish(store, cs.next_generation(store, 0))  # a recovery: generation 1
    trainer = FakeTrainer(gloo, seed=0)
    trainer.train()
    saver = ckpt.Saver(trainer, url, {}, 2, True, upload_group=trainer.upload_group, fence=Fence(1))
    record = saver.save(trainer.meta())
    assert record.path == store.url_of(store.join("step_00000001.g1"))
    generations.publish(store, cs.next_generation(store, 1))  # the node is lost: generation 2
    gate.set()
    [done] = saver.wait()
    saver.close()
    assert done.error is not None and "fenced off" in done.error and "generation 2" in done.error
    assert not store.fs.exists(store.join("step_00000001.g1", cs.META))
    assert cs.latest(store) is None and cs.committed(store) == []
    # Past the check: committed all the same, but generation 1 had committed nothing when the
    # run moved on, so nothing of it is read.
    cs.commit(store, store.join("step_00000001.g1"), {**trainer.meta(), "generation": 1})
    assert cs.latest(store) is None and cs.committed(store) == [] and cs.best(store) is None
    # Generation 2 saves the same step in its own directory, and its retention deletes the zombie's.
    saver = ckpt.Saver(trainer, url, {}, 2, True, upload_group=trainer.upload_group, fence=Fence(2))
    saver.save(trainer.meta())
    [done] = saver.wait()
    saver.close()
    assert done.error is None and cs.latest(store).path == store.url_of(store.join("step_00000001.g2"))
    assert cs.latest(store).meta["generation"] == 2
    assert [os.path.basename(p) for p in cs.step_dirs(store)] == ["step_00000001.g2"]


def test_a_stale_rank_is_refused_before_its_commit(tmp_path):
    store = Store.open(tmp_path / "ck")
    generations.publish(store, Generations(3, {0: 10, 1: None, 2: 40}))
    Fence(3).check(store, "step 50")  # current: passes
    with pytest.raises(Fenced, match="joined the run's generation 2, but the driver has moved the run to generation 3"):
        Fence(2).check(store, "step 50")
    Fence(0).check(Store.open(tmp_path / "none"), "step 1")  # no record: a trainer run without a driver


def test_generations_past_what_the_store_holds(tmp_path):
    """A resume never reuses a generation: it goes past the record, or (a store written before
    generations) past generation 0, whose commits stay readable; older generations are read only
    up to the step they had committed when the run moved on."""
    store = Store.open(tmp_path / "ck")
    assert cs.next_generation(store) == Generations(0)  # an empty store
    commit_step(store, 4)  # written before generations: generation 0, no marker field
    assert cs.latest(store).step == 4
    first = cs.next_generation(store)
    assert first == Generations(1, {0: 4})
    generations.publish(store, first)
    assert cs.latest(store).step == 4  # still read
    # A zombie of generation 0 commits step 6 after the run moved on: never read.
    path = cs.begin(store, 6)
    store.write_bytes(f"{path}/.metadata", b"meta")
    cs.commit(store, path, {"step": 6})
    assert cs.latest(store).step == 4 and [cs.step_of(p) for p in cs.committed(store)] == [4]
    assert cs.next_generation(store, 1) == Generations(2, {0: 4, 1: None})
    assert cs.retain(store, keep=2, generation=1) == [path]  # a fenced-off commit is deleted
    # A marker naming another generation than its directory is not a checkpoint.
    path = cs.begin(store, 8, 1)
    store.write_bytes(f"{path}/.metadata", b"meta")
    cs.commit(store, path, {"step": 8, "generation": 0})
    with pytest.raises(ValueError, match="names generation 0"):
        cs.check(store, path)


# -- a partition, on a Ray cluster ----------------------------------------------------------

DELAY_S = 2.0
STEPS = 4  # the final step, whose upload the partition catches
COMMON = [
    "+topology=dp2",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "data.seq_len=32",
    "checkpoint.every=2",
    "checkpoint.async_save=true",
    "fault.step_timeout_s=4",
    "cluster.placement_timeout_s=15",
]


@pytest.fixture(scope="module")
def cluster():
    """A head without CPUs and three 1-CPU nodes: one rank per node, and a spare. Their
    processes inherit the slow store."""
    os.environ[upload.DELAY_ENV] = str(DELAY_S)
    try:
        with local_cluster(head_cpus=0, node_cpus=[1, 1, 1]) as (c, _):
            yield c
    finally:
        os.environ.pop(upload.DELAY_ENV, None)


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """Uninterrupted dp2 losses of STEPS + 2 steps."""
    root = tmp_path_factory.mktemp("ref")
    summary = rayhybrid.train([*COMMON, f"train.steps={STEPS + 2}"], run_dir=root / "run")
    assert summary["status"] == "completed"
    return losses(root / "run")


@pytest.mark.slow
def test_a_partitioned_node_resumes_fenced_off(cluster, reference, tmp_path, monkeypatch, caplog):
    # Should rank 1 be caught in a collective with the stopped rank (gloo waits 300 s), the drain
    # replaces it after 5 s rather than 30: the run then restores a checkpoint instead of healing.
    monkeypatch.setattr(drain_module, "DRAIN_TIMEOUT_S", 5.0)
    run_dir, root = tmp_path / "run", tmp_path / "ckpts"
    summary = partitioned(cluster, [*COMMON, f"train.steps={STEPS}"], STEPS, run_dir, root, caplog)
    assert summary["status"] == "completed" and summary["restarts"] == 1
    (recovery,) = summary["recoveries"]  # recorded when the run ends: no step followed it
    assert recovery["healed"] == "peer" and recovery["first_step_s"] == 0
    assert any("from their data-parallel peers" in r.getMessage() for r in caplog.records)  # rank 1 kept its state
    assert losses(run_dir) == reference[:STEPS]
    # A resume goes on from the last checkpoint as a run never interrupted, under a generation never used.
    latest = cs.latest(Store.open(root))
    resumed = rayhybrid.train([*COMMON, f"train.steps={STEPS + 2}", f"checkpoint.dir={root}"], run_dir=tmp_path / "b")
    assert resumed["status"] == "completed" and resumed["resumed_from"] == latest.path
    assert generations.read(Store.open(root)).current == 2
    records = map(json.loads, (tmp_path / "b" / "metrics.jsonl").read_text().splitlines())
    assert [r["loss"] for r in records if "loss" in r] == reference[STEPS:]


def partitioned(cluster, overrides: list[str], steps: int, run_dir: Path, root: Path, caplog) -> dict:
    """A run of `overrides` (dp >= 2, asynchronous saves, `steps` steps, one rank per node, a
    spare node, every node's store slowed by `RAYHYBRID_TEST_UPLOAD_DELAY_S`) whose rank 0's
    node is stopped whole (SIGSTOP) while the final checkpoint uploads; once the run has moved
    to generation 1, rank 0 alone is continued (its raylet would kill it once told it is dead),
    then the node. Checks that rank 0 exited without committing and said so, that every
    checkpoint a reader takes is one the run recorded, and that the last is generation 1's.
    Returns the run's summary (tests/test_soak.py runs it too)."""
    store = Store.open(root)
    thread, result = in_background([*overrides, f"checkpoint.dir={root}"], run_dir)
    when_step(run_dir, steps)
    stale_dir = root / cs.name_for(steps)
    workers = json.loads((run_dir / "workers.json").read_text())
    zombie = workers[0]["pid"]
    (node,) = [n for n in cluster.list_all_nodes() if n.node_id == workers[0]["node_id"]]
    frozen = node_pids(node) | {zombie}
    # The save call has returned: the upload runs in rank 0's background thread (the delay).
    uploading = f"checkpoint step {steps}: training blocked"
    wait_for(lambda: any(uploading in r.getMessage() for r in list(caplog.records)), 30, "the final upload")
    signal_all(frozen, signal.SIGSTOP)  # the node is cut off mid-upload: raylet, agents, rank
    try:
        assert not (stale_dir / upload.RESULTS.format(rank=0)).exists(), "the upload was not in flight"
        # The run declares the node lost and moves on: generation 1, published before it rejoins.
        wait_for(lambda: (generations.read(store) or Generations()).current >= 1, 120, "a new generation")
        os.kill(zombie, signal.SIGCONT)  # the rank resumes alone, as before anything can kill it
        committed = False
        deadline = time.monotonic() + 20
        while not gone(zombie) and time.monotonic() < deadline:
            committed = committed or (stale_dir / cs.META).exists()
            time.sleep(0.02)
        committed = committed or (stale_dir / cs.META).exists()
        exited = gone(zombie)
    finally:
        signal_all(frozen, signal.SIGCONT)
    thread.join(timeout=180)
    assert not committed, "a rank of the old generation committed its checkpoint"
    assert exited, "the fenced-off rank did not exit"
    assert fenced_line(zombie), "the fenced-off rank said nothing"
    summary = result.get("summary")
    assert summary is not None, result.get("error")
    # Every checkpoint a reader takes is one the run recorded, whole; the last is generation 1's.
    recorded = {
        e["path"]
        for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if e.get("event") == "checkpoint"
    }
    kept = cs.committed(store)
    assert kept and set(kept) <= recorded
    latest = cs.latest(store)
    assert latest.step == steps and latest.path == str(root / cs.name_for(steps, 1)) and latest.meta["generation"] == 1
    return summary


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g}s for {what}")
        time.sleep(0.02)
