"""Local paths on a 2-node `ray.cluster_utils.Cluster` (issue 37, item 5): `prepare` refuses an
output that a node does not see, and training refuses a prepared dataset on a path that a node
does not see, each in one line naming the setting, before any work; a path every node sees (a
mount they share) passes both.

On one machine every node sees the same disk. A node with a disk of its own is simulated by a
path whose meaning depends on the process that opens it: /proc/self/cwd/<name> is <name> in the
opening process's working directory, and Ray's workers run in their raylet's. The driver and
the normal node run in one directory ("shared"), the odd node in another ("own"): at
/proc/self/cwd/out the odd node finds another directory, as a node finds its own disk at a
node-local path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never download

import pytest

import rayhybrid
from benchmarks.clusters import add_node, local_cluster
from rayhybrid.config.schema import DataConfig
from rayhybrid.data.prepared import INDEX, open_prepared
from rayhybrid.errors import ConfigError
from tests.prepared import random_documents, write_dataset
from tests.test_prepare import config, local_put, write_corpus
from tests.tokenizer import corpus, make_tokenizer

pytestmark = pytest.mark.slow

NODE_CPUS = 4  # with cluster.cpus_per_rank=4: one rank on each node


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(cluster, shared, own, odd node): the head (no CPUs, the driver's) and one node run in
    `shared`, the odd node in `own`; the test process stays in `shared` meanwhile."""
    shared, own = tmp_path_factory.mktemp("shared"), tmp_path_factory.mktemp("own")
    before = os.getcwd()
    os.chdir(shared)
    try:
        with local_cluster(head_cpus=0, node_cpus=[NODE_CPUS]) as (c, _):
            os.chdir(own)
            try:
                odd = add_node(c, NODE_CPUS)
            finally:
                os.chdir(shared)
            c.wait_for_nodes()
            yield c, shared, own, odd
    finally:
        os.chdir(before)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tiny-bpe")


def assert_names_the_odd_node(err: ConfigError, odd, setting: str, *words: str) -> None:
    assert err.setting == setting and "\n" not in str(err), str(err)
    assert f"node {odd.node_ip_address} ({odd.node_id[:8]})" in str(err), str(err)
    for word in words:
        assert word in str(err), str(err)


def test_prepare_to_a_path_a_node_does_not_see_is_refused(cluster, tok_dir, tmp_path):
    from rayhybrid.prepare import prepare

    _, shared, own, odd = cluster
    write_corpus("jsonl", corpus(40, seed=1), local_put(tmp_path / "raw"))
    with pytest.raises(ConfigError) as err:
        prepare(config(tmp_path / "raw", "/proc/self/cwd/out", tok_dir))
    assert_names_the_odd_node(err.value, odd, "output", "/proc/self/cwd/out", "does not see the marker")
    assert "give output= a mount every node shares, or a bucket URL" in str(err.value)
    assert [p.name for p in (shared / "out").iterdir()] == []  # no shard, no index, no probe left
    assert not (own / "out").exists()


def test_prepare_to_a_path_every_node_sees_writes_there(cluster, tok_dir, tmp_path):
    """The same cluster, a path both nodes see (as a shared mount): the prepare runs, its read
    and write tasks on the two nodes (the head has no CPUs), and commits."""
    from rayhybrid.prepare import prepare

    texts = corpus(60, seed=2)
    write_corpus("jsonl", texts, local_put(tmp_path / "raw"), num_files=6)
    done = prepare(config(tmp_path / "raw", tmp_path / "out", tok_dir))
    assert not done.already and done.documents == len(texts)
    assert open_prepared(str(tmp_path / "out")).num_documents == len(texts)


def test_check_datasets_on_every_node(cluster):
    """The start-up check itself: a dataset both nodes see passes; at a path where the odd
    node finds nothing, or another dataset, it names the odd node and the setting."""
    from rayhybrid.data.packing import prepared_sources
    from rayhybrid.storage.visibility import check_datasets

    c, shared, own, odd = cluster
    nodes = [n.node_id for n in c.list_all_nodes()]
    write_dataset(shared / "ds", random_documents(50))
    check_datasets(prepared_sources(DataConfig(name="prepared", path=str(shared / "ds"))), nodes, {})
    here = DataConfig(name="prepared", mix=({"path": str(shared / "ds")}, {"path": "/proc/self/cwd/ds"}))
    with pytest.raises(ConfigError) as err:
        check_datasets(prepared_sources(here), nodes, {})
    assert_names_the_odd_node(err.value, odd, "data.mix[1].path", f"does not see its {INDEX}", "a mount every node")
    write_dataset(own / "ds", random_documents(50, seed=9))
    try:
        with pytest.raises(ConfigError) as err:
            check_datasets(prepared_sources(DataConfig(name="prepared", val_path="/proc/self/cwd/ds")), nodes, {})
        assert_names_the_odd_node(err.value, odd, "data.val_path", "sees another dataset there")
    finally:
        for path in (own / "ds").iterdir():
            path.unlink()


def test_training_on_a_dataset_a_node_does_not_see_fails_at_start(cluster, tmp_path):
    _, shared, _, odd = cluster
    write_dataset(shared / "train-ds", random_documents(200), vocab_size=300)
    overrides = [
        "data=prepared",
        "data.path=/proc/self/cwd/train-ds",
        "data.seq_len=16",
        "model.vocab_size=320",
        "+topology=dp2",
        "train.steps=2",
        f"cluster.cpus_per_rank={NODE_CPUS}",
    ]
    with pytest.raises(ConfigError) as err:
        rayhybrid.train(overrides, run_dir=tmp_path / "run")
    assert_names_the_odd_node(err.value, odd, "data.path", f"does not see its {INDEX}", "prepare it to a bucket")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 0
