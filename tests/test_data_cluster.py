"""data=prepared on a 2-node `ray.cluster_utils.Cluster` through failures (issue 27): an elastic
run on a mixture of two prepared datasets in S3 (moto's server on 127.0.0.1) has a rank
SIGKILLed from outside, loses a node (dp 2 -> 1) and gets one back (dp 1 -> 2). What the ranks
read (data.trace) shows every window of each dataset's epoch read exactly once, the mixture's
shares within 1% of its weights, and the same samples as an uninterrupted run, whose losses it
matches bit for bit.

Bitwise across dp changes: a replica is one rank (pp=1, tp=1) and the global batch two
micro-batches, so dp2 adds one micro-batch's gradients from each replica (a + b, by the
all-reduce) and dp1 accumulates both (0 + a + b): the same float32 sums, the halving exact.

Every AWS client started from this module points at a dead loopback port unless told the moto
endpoint (benchmarks/s3.py): the nodes start without S3 settings and the driver forwards its own.
Checkpoints (every 2 steps) go to the driver's disk, which every node of this one-machine
cluster sees: through the S3 server they would double the run's time on 2 cores."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import ray

import rayhybrid
from benchmarks import s3 as s3_server
from benchmarks.clusters import add_node, local_cluster
from tests.prepared import random_documents, write_dataset
from tests.test_recovery import in_background, losses

pytestmark = pytest.mark.slow

SEQ_LEN = 16
MICRO = 8
GLOBAL = 2 * MICRO  # dp2: one micro-batch per replica; dp1: two, accumulated
STEPS = 64
VOCAB = 256
WEIGHTS = {"web": 0.7, "code": 0.3}
# Documents of 3..39 tokens: ~21 on average, so ~1.3 windows of 16 each. The run's samples
# (STEPS * GLOBAL) cover one epoch of each dataset and part of a second (checked below).
DOCUMENTS = {"web": 460, "code": 190}
BUCKET = "corpora"
NODE_CPUS = 2  # one rank per node: cluster.cpus_per_rank=NODE_CPUS


def common(web: str, code: str) -> list[str]:
    return [
        "data=prepared",
        f"data.mix=[{{path:{web},weight:{WEIGHTS['web']}}},{{path:{code},weight:{WEIGHTS['code']}}}]",
        f"data.seq_len={SEQ_LEN}",
        "data.trace=true",
        f"model.vocab_size={VOCAB}",
        f"train.micro_batch_size={MICRO}",
        f"train.global_batch_size={GLOBAL}",
        f"train.steps={STEPS}",
        f"cluster.cpus_per_rank={NODE_CPUS}",
    ]


@pytest.fixture(scope="module")
def cluster():
    with (
        s3_server.loopback_aws(),
        local_cluster(head_cpus=0, node_cpus=[NODE_CPUS, NODE_CPUS]) as (c, _),  # nodes: no S3 settings
        s3_server.moto_server() as endpoint,
        s3_server.env(AWS_ENDPOINT_URL=endpoint, **s3_server.CREDENTIALS),
    ):
        s3_server.make_bucket(BUCKET, endpoint)
        yield c


@pytest.fixture(scope="module")
def datasets(cluster) -> dict[str, dict]:
    """The two prepared datasets in the bucket: URL -> name, weight and windows (of the whole
    dataset: nothing is held out)."""
    out = {}
    for seed, (name, n) in enumerate(DOCUMENTS.items()):
        docs = random_documents(n, VOCAB, seed=seed + 1)
        url = write_dataset(f"s3://{BUCKET}/{name}", docs, vocab_size=VOCAB, shards=4, name="mix-test")
        tokens = sum(len(d) for d in docs)
        out[url] = {"name": name, "weight": WEIGHTS[name], "windows": (tokens - 1) // SEQ_LEN}
    return out


def trace(run_dir: Path) -> list[dict]:
    """Every row of data_trace/rank*.jsonl."""
    files = sorted((run_dir / "data_trace").glob("rank*.jsonl"))
    assert files, "no data_trace"
    return [json.loads(line) for path in files for line in path.read_text().splitlines()]


def records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's complete lines, also while the run writes it."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def step_records(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if "event" not in r]


def events(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in records(run_dir) if r.get("event") == kind]


def wait_for(predicate, what: str, timeout: float = 180.0, thread=None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert thread is None or thread.is_alive(), f"the run ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def workers(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "workers.json").read_text())


def test_elastic_mixture_from_s3_reads_every_window_once_through_failures(cluster, datasets, tmp_path):
    web, code = datasets
    windows = {url: d["windows"] for url, d in datasets.items()}
    # The run reads at least one full epoch of each dataset.
    for url, d in datasets.items():
        assert d["weight"] * STEPS * GLOBAL - 2 >= d["windows"], (url, d["windows"])

    # The reference: uninterrupted, fixed dp2 (what the elastic run starts with).
    ref_dir = tmp_path / "ref"
    reference = rayhybrid.train([*common(web, code), "topology.dp=2", "checkpoint.every=0"], run_dir=ref_dir)
    assert reference["status"] == "completed" and reference["steps"] == STEPS

    # The elastic run, in the background: a rank killed, a node removed, a node added.
    run_dir = tmp_path / "run"
    wait_for(lambda: ray.available_resources().get("CPU", 0) == 2 * NODE_CPUS, "the reference's CPUs")
    elastic = [
        "elastic.enabled=true",
        "elastic.min_dp=1",
        "elastic.max_dp=2",
        "elastic.reschedule_timeout_s=3",
        "checkpoint.every=2",
        f"checkpoint.dir={tmp_path / 'checkpoints'}",
    ]
    thread, result = in_background([*common(web, code), *elastic], run_dir)

    def trained(dp: int, after: int) -> bool:
        return any(r["dp"] == dp and r["step"] > after for r in step_records(run_dir))

    # Trains at dp2 (it may have started at dp1 and grown) with a committed checkpoint.
    wait_for(lambda: trained(2, 2) and events(run_dir, "checkpoint"), "dp2 and a checkpoint", thread=thread)
    os.kill(workers(run_dir)[1]["pid"], signal.SIGKILL)  # from outside: recovery replaces the rank
    wait_for(lambda: events(run_dir, "restart"), "the restart after the kill", thread=thread)
    (restart,) = events(run_dir, "restart")
    wait_for(lambda: trained(2, restart["resume_step"] + 1), "dp2 after the restart", thread=thread)
    # The other rank's node goes: dp 2 -> 1, the survivor reading the whole batch.
    node_id = workers(run_dir)[0]["node_id"]
    (node,) = [n for n in cluster.list_all_nodes() if n.node_id == node_id]
    cluster.remove_node(node)
    wait_for(lambda: any(e["to_dp"] == 1 for e in events(run_dir, "resize")), "the shrink", thread=thread)
    # A node comes back: dp 1 -> 2 at a checkpoint.
    add_node(cluster, NODE_CPUS)
    thread.join(timeout=400)
    summary = result.get("summary")
    assert summary is not None, result.get("error")
    assert summary["status"] == "completed" and summary["steps"] == STEPS

    # The interruptions: the kill (a restart at dp2), the node's loss (2 -> 1), its return (1 -> 2).
    kill, *_ = summary["recoveries"]
    assert kill["replaced_ranks"] == [1] and (kill["dp_before"], kill["dp_after"]) == (2, 2)
    resizes = [(r["from_dp"], r["to_dp"]) for r in summary["resizes"]]
    shrink = resizes.index((2, 1))
    assert (1, 2) in resizes[shrink + 1 :], resizes
    assert [(e["from_dp"], e["to_dp"]) for e in events(run_dir, "resize")] == resizes
    steps = step_records(run_dir)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))  # each step once
    dps = [r["dp"] for r in steps]
    assert 1 in dps and dps[-1] == 2, dps
    assert all("data_wait_s" in r and r["data_wait_s"] >= 0 for r in steps)

    # What the ranks read: each (step, sample) by one rank, each step its G samples in order.
    rows = trace(run_dir)
    by_read = Counter((r["step"], r["sample"]) for r in rows)
    assert [k for k, n in by_read.items() if n > 1] == []
    per_step: dict[int, list[int]] = {}
    for r in rows:
        per_step.setdefault(r["step"], []).append(r["sample"])
    assert sorted(per_step) == list(range(1, STEPS + 1))
    for step, samples in per_step.items():
        assert sorted(samples) == list(range((step - 1) * GLOBAL, step * GLOBAL)), step
    # Every window of each dataset's first epoch exactly once; no window twice in any epoch.
    assert {r["dataset"] for r in rows} == set(datasets)
    for url, n in windows.items():
        starts = Counter((r["epoch"], r["start"]) for r in rows if r["dataset"] == url)
        assert [k for k, c in starts.items() if c > 1] == [], url
        assert sorted(s for e, s in starts if e == 0) == [k * SEQ_LEN for k in range(n)], url
        assert {e for e, _ in starts} == {0, 1}, url  # and part of a second epoch
        # The mixture's realised shares.
        share = sum(starts.values()) / len(rows)
        assert share == pytest.approx(datasets[url]["weight"], abs=0.01), url
    # The same samples as the uninterrupted run, and bit for bit the same losses.
    key = ("step", "sample", "dataset", "epoch", "start")
    assert {tuple(r[k] for k in key) for r in rows} == {tuple(r[k] for k in key) for r in trace(ref_dir)}
    assert losses(run_dir) == losses(ref_dir)
