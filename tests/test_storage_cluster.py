"""Checkpoints on S3 from a 2-node `ray.cluster_utils.Cluster` whose nodes were started without
any S3 settings: the driver alone has the endpoint and the credentials (moto's S3 server on
127.0.0.1) and forwards them to the workers. Recovery, resharding, retention and a save killed
mid-upload all go through the bucket; the start-up check refuses a node that sees another store.

Every AWS client started from this module points at a dead loopback port unless told the moto
endpoint (benchmarks/s3.py), so nothing here can reach a real cloud."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

import rayhybrid
from benchmarks import s3 as s3_server
from benchmarks.clusters import add_node, local_cluster
from rayhybrid.errors import ConfigError
from rayhybrid.storage import checkpoints as checkpoint_store
from rayhybrid.storage.store import Store
from tests import s3
from tests.test_recovery import events, in_background, losses, when_step

pytestmark = pytest.mark.slow

COMMON = ["train.global_batch_size=8", "train.micro_batch_size=2", "data.seq_len=32", "checkpoint.every=2"]
# Credentials only the driver has; unique, so a leak is found by searching for them.
GROW_STEPS = 80
KEY, SECRET = f"key-{uuid.uuid4().hex[:12]}", f"secret-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def cluster():
    with (
        s3_server.loopback_aws(),
        local_cluster(head_cpus=0, node_cpus=[4, 4]) as (c, _),  # nodes: no endpoint, no credentials
        s3_server.moto_server() as endpoint,
        s3_server.env(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET),
    ):
        s3_server.make_bucket("ckpts", endpoint)
        yield c, endpoint


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """Uninterrupted dp2 losses with checkpoints on the driver's disk (the first N are those of
    a run of N steps: the learning-rate schedule does not depend on train.steps)."""
    run_dir = tmp_path_factory.mktemp("ref")
    summary = rayhybrid.train([*COMMON, "+topology=dp2", f"train.steps={GROW_STEPS}"], run_dir=run_dir)
    assert summary["status"] == "completed"
    return losses(run_dir)


def bucket(url: str) -> Store:
    return Store.open(url)


def test_recovery_from_s3_is_exact_and_keeps_no_secret(cluster, reference, tmp_path, capfd):
    c, endpoint = cluster
    run_dir, url = tmp_path / "run", "s3://ckpts/recover"
    overrides = [
        *COMMON,
        "+topology=dp2",
        "train.steps=10",
        f"checkpoint.dir={url}",
        "checkpoint.keep=2",
        "fault.inject=[kill@7:1]",
        "fault.heal=false",  # the restore from the bucket is the point (healing loads nothing)
        # The same credentials handed to fsspec as well: they must not be written anywhere either.
        f"checkpoint.storage_options.key={KEY}",
        f"checkpoint.storage_options.secret={SECRET}",
    ]
    summary = rayhybrid.train(overrides, run_dir=run_dir)
    assert summary["status"] == "completed" and summary["restarts"] == 1
    # The ranks ran on the two nodes without S3 settings, not on the driver's head node.
    nodes = {w["node_id"] for w in summary["placement"]}
    assert len(nodes) == 2 and c.head_node.node_id not in nodes
    # Restored from the bucket, and the losses are those of the uninterrupted run, bit for bit.
    (resume,) = events(run_dir, "resume")
    assert resume["checkpoint"].startswith(f"{url}/step_") and resume["step"] in (4, 6)
    assert losses(run_dir) == reference[:10]
    # Retention in the bucket: the newest two committed checkpoints, nothing uncommitted.
    store = bucket(url)
    assert [checkpoint_store.step_of(p) for p in checkpoint_store.committed(store)] == [8, 10]
    assert not checkpoint_store.uncommitted(store)
    assert checkpoint_store.latest(store).step == 10
    # Written after the restart: by the run's generation 1 (docs/design.md, invariant 10).
    assert summary["last_checkpoint"] == f"{url}/{checkpoint_store.name_for(10, 1)}" == f"{url}/step_00000010.g1"
    # No secret in the run directory, the bucket or the output.
    written = [p.read_bytes() for p in run_dir.rglob("*") if p.is_file()]
    stored = s3.objects(url, endpoint)
    written += list(stored.values())
    # goodput's totals in the bucket, for a resumed run: this process, up to its end
    (process,) = json.loads(stored[f"{url.removeprefix('s3://')}/goodput.json"])["processes"]
    assert process["wall_s"] == pytest.approx(summary["goodput"]["wall_s"], abs=0.01)
    out, err = capfd.readouterr()
    for secret in (SECRET, KEY):
        assert not any(secret.encode() in blob for blob in written), "a secret was written"
        assert secret not in out + err, "a secret was printed"


def test_prepared_data_read_with_credentials_only_in_data_storage_options_keeps_no_secret(cluster, tmp_path, capfd):
    """A prepared dataset in the bucket, and no S3 setting anywhere but data.storage_options:
    not in the driver's environment (a dead endpoint, no credentials), not on the nodes. The
    driver's checks and the ranks on the other nodes read it with those options alone, and
    neither the key nor the secret is written (config, summary.json, metrics, checkpoints'
    meta.json) or printed."""
    from tests.prepared import random_documents, write_dataset

    _, endpoint = cluster
    url = write_dataset("s3://ckpts/corpus-only-options", random_documents(400, seed=5), vocab_size=300)
    data_key, data_secret = f"dkey-{uuid.uuid4().hex[:12]}", f"dsecret-{uuid.uuid4().hex}"
    run_dir = tmp_path / "run"
    overrides = [
        *COMMON,
        "train.steps=4",
        "data=prepared",
        f"data.path={url}",
        "model.vocab_size=320",
        f"checkpoint.dir={tmp_path / 'ckpts'}",
        f"data.storage_options.endpoint_url={endpoint}",
        f"data.storage_options.key={data_key}",
        f"data.storage_options.secret={data_secret}",
    ]
    with s3_server.env(AWS_ENDPOINT_URL=s3_server.DEAD_ENDPOINT, AWS_ACCESS_KEY_ID=None, AWS_SECRET_ACCESS_KEY=None):
        summary = rayhybrid.train(overrides, run_dir=run_dir)
    assert summary["status"] == "completed" and summary["steps"] == 4
    latest = checkpoint_store.latest(str(tmp_path / "ckpts"))
    assert latest.step == 4 and latest.meta["data"]["kind"] == "prepared"  # a checkpoint's meta.json among them
    written = [p.read_bytes() for root in (run_dir, tmp_path / "ckpts") for p in root.rglob("*") if p.is_file()]
    out, err = capfd.readouterr()
    for secret in (data_key, data_secret):
        assert not any(secret.encode() in blob for blob in written), "a secret was written"
        assert secret not in out + err, "a secret was printed"


def test_dp2_pp2_tp2_checkpoint_resumes_as_tp2_from_s3(cluster, reference, tmp_path):
    url = "s3://ckpts/reshard"
    first = rayhybrid.train(
        [*COMMON, "+topology=dp2_pp2_tp2", "train.steps=4", f"checkpoint.dir={url}"], run_dir=tmp_path / "a"
    )
    assert first["status"] == "completed" and first["last_checkpoint"] == f"{url}/step_00000004"
    second = rayhybrid.train(
        [*COMMON, "+topology=tp2", "train.steps=6", f"checkpoint.dir={url}"], run_dir=tmp_path / "b"
    )
    assert second["status"] == "completed" and second["resumed_step"] == 4
    assert second["resumed_from"] == f"{url}/step_00000004"
    # Another topology: the same mathematics, to float32 rounding.
    assert losses(tmp_path / "a") == pytest.approx(reference[:4], rel=1e-5)
    resumed = [
        r["loss"] for r in map(json.loads, (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]
    assert resumed == pytest.approx(reference[4:6], rel=1e-5)


def test_save_killed_mid_upload_is_never_loaded(cluster, reference, tmp_path):
    """Rank 1 dies once its shards of the step-4 checkpoint are in the bucket, while the upload
    runs behind step 5: no marker, so the run goes back to step 2, whose upload was committed
    before the step-4 save began (fault.heal=false: healing would load no checkpoint)."""
    run_dir, url = tmp_path / "run", "s3://ckpts/midupload"
    overrides = [*COMMON, "+topology=dp2", "train.steps=6", f"checkpoint.dir={url}", "fault.inject=[kill_save@4:1]"]
    overrides.append("fault.heal=false")
    summary = rayhybrid.train(overrides, run_dir=run_dir)
    assert summary["status"] == "completed" and summary["restarts"] == 1
    assert summary["recoveries"][0]["resume_step"] == 2
    assert [e["step"] for e in events(run_dir, "resume")] == [2]
    assert losses(run_dir) == reference[:6]
    store = bucket(url)
    assert not checkpoint_store.uncommitted(store)
    assert checkpoint_store.latest(store).step == 6


def test_node_that_sees_another_store_is_refused(cluster, tmp_path):
    """One machine, two S3 servers (each with buckets of its own): a node whose fsspec
    configuration (FSSPEC_CONFIG_DIR, set when it started) points s3:// at the second one sees
    a bucket of the same name without the driver's marker, as a node in another account or
    region would."""
    c, _ = cluster
    normal = [n for n in c.list_all_nodes() if n is not c.head_node]
    with s3.moto_process() as other:
        s3_server.make_bucket("ckpts", other)
        conf = tmp_path / "fsspec"
        conf.mkdir()
        (conf / "s3.json").write_text(json.dumps({"s3": {"endpoint_url": other}}))
        c.remove_node(normal[-1])
        with s3_server.env(FSSPEC_CONFIG_DIR=str(conf)):
            odd = add_node(c, 4)
        c.wait_for_nodes()
        try:
            with pytest.raises(ConfigError) as caught:
                rayhybrid.train(
                    [
                        *COMMON,
                        "+topology=dp2",
                        "train.steps=2",
                        "cluster.cpus_per_rank=4",
                        "checkpoint.dir=s3://ckpts/odd",
                    ],
                    run_dir=tmp_path / "run",
                )
        finally:
            c.remove_node(odd)
            add_node(c, 4)
            c.wait_for_nodes()
    err = caught.value
    assert err.setting == "checkpoint.dir" and "\n" not in str(err)
    assert f"node {odd.node_ip_address} ({odd.node_id[:8]}) does not see the marker" in str(err)
    assert "s3://ckpts/odd" in str(err) and "every node must reach the same store" in str(err)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 0
    assert not [p for p in Path(tmp_path / "run").glob("checkpoints/*")]


def test_elastic_grow_onto_a_new_node_restores_from_s3(cluster, reference, tmp_path):
    """A node that joins later passes the storage check and its replica restores from the
    bucket: the run starts at dp1 (one node of 4 CPUs per rank) and grows to dp2."""
    c, _ = cluster
    normal = [n for n in c.list_all_nodes() if n is not c.head_node]
    c.remove_node(normal[-1])
    run_dir, url = tmp_path / "run", "s3://ckpts/grow"
    elastic = ["elastic.enabled=true", "elastic.min_dp=1", "elastic.max_dp=2", "elastic.reschedule_timeout_s=5"]
    overrides = [*COMMON, *elastic, f"train.steps={GROW_STEPS}", "cluster.cpus_per_rank=4", f"checkpoint.dir={url}"]
    thread, result = in_background(overrides, run_dir)
    when_step(run_dir, 1)
    joined = add_node(c, 4)
    thread.join(timeout=400)
    summary = result.get("summary")
    assert summary is not None, result.get("error")
    assert summary["status"] == "completed" and summary["steps"] == GROW_STEPS
    (grow,) = summary["resizes"]
    assert (grow["from_dp"], grow["to_dp"]) == (1, 2)
    assert joined.node_id in {w["node_id"] for w in summary["placement"]}
    resumed = events(run_dir, "resume")[-1]
    assert resumed["step"] == grow["step"] and resumed["checkpoint"] == f"{url}/step_{grow['step']:08d}"
    assert losses(run_dir) == pytest.approx(reference, rel=1e-5)  # dp1 then dp2: the same mathematics
