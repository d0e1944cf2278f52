"""The cluster check (rayhybrid/check/, docs/clusters.md "Checking the cluster before a run") on
a `ray.cluster_utils.Cluster` of three nodes, each with its own environment (Cluster.add_node's
env_vars, the raylet's and so its workers'): one healthy; one whose PYTHONPATH starts with a
directory holding only numpy-0.0.1.dist-info, so importlib.metadata says numpy 0.0.1 there while
numpy still imports; one whose fsspec configuration (FSSPEC_CONFIG_DIR) points s3:// at a dead
loopback port, so the driver's bucket (moto's S3 server on 127.0.0.1) is out of its reach.

`python -m rayhybrid.check` names exactly those two nodes with their fixes and exits 1; a run's
start (cluster.check=brief) warns of the same version, records a `check` event and trains on;
once the two nodes are gone, the check exits 0 and prints its table. Pure tests of the rules
(what is fatal at a start, the bandwidth floor, the pairs measured) come first."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
from types import SimpleNamespace

import pytest

import rayhybrid
from benchmarks import s3 as s3_server
from benchmarks.clusters import add_node, local_cluster
from rayhybrid.check import bandwidth, join, run
from rayhybrid.check.__main__ import main
from rayhybrid.check.nodes import Node
from rayhybrid.check.problems import node_problems
from rayhybrid.config.compose import compose, to_config
from rayhybrid.driver.launcher import Launcher
from rayhybrid.driver.policies import ScalingPolicy
from rayhybrid.driver.state import RunState
from rayhybrid.errors import ConfigError, RunFailed
from tests.test_elastic import events, records
from tests.test_recovery import in_background, losses, when_step

DRIVER = {
    "python": "3.11.7",
    "packages": {"torch": "2.13.0+cpu", "rayhybrid": "0.1.0", "numpy": "2.1.0", "torchao": None},
    "code": "abc",
}


def facts(**packages) -> dict:
    return {
        "python": "3.11.9",
        "packages": {**DRIVER["packages"], **packages},
        "code": "abc",
        "devices": {"kind": "cpu"},
        "store": None,
        "datasets": {},
    }


def problems(f, **kw):
    args = {"tp": 1, "ray_gpus": 0.0, "gpu": False, "store": "s3://b/x", **kw}
    return node_problems("node 1a2b3c4d (10.0.0.5)", f, DRIVER, **args)


def test_the_rules_name_each_difference_with_its_fix():
    assert problems(facts(torch="2.13.0+cu128")) == []  # one torch release, another build
    (torch,) = problems(facts(torch="2.12.0"))
    assert torch.fatal and torch.line == (
        "node 1a2b3c4d (10.0.0.5): torch 2.12.0, the driver has 2.13.0+cpu; install torch==2.13.0 there, "
        "or run the driver with torch==2.12.0"
    )
    (numpy,) = problems(facts(numpy=None))
    assert not numpy.fatal and numpy.line.endswith("numpy is not installed; install numpy==2.1.0 there")
    (code,) = problems({**facts(), "code": "def"})
    assert "rayhybrid's code differs" in code.line and not code.fatal
    gpu = {**facts(), "devices": {"kind": "cuda", "count": 1, "names": ["H100"], "cuda": "12.8", "nccl": True}}
    seen, tp = problems(gpu, gpu=True, tp=2, ray_gpus=2.0)
    assert "torch sees 1 GPU(s) (CUDA 12.8), Ray gives the node 2" in seen.line
    assert "needs 2 GPUs on one node (topology.tp=2), torch sees 1" in tp.line
    (store,) = problems({**facts(), "store": "cannot write there (EndpointConnectionError: x)"})
    assert store.line.startswith("node 1a2b3c4d (10.0.0.5): checkpoint.dir s3://b/x: cannot write there")
    (silent,) = problems("its check did not answer within 60s")
    assert "did not answer" in silent.line and "Ray logs" in silent.fix


def test_bandwidth_under_half_of_the_setting_is_a_problem():
    cfg = to_config(compose(["cluster.intra_node_gbps=10"]))
    node = Node("1a2b3c4d" * 4, "10.0.0.5", 0.0)
    assert bandwidth.expected(cfg, gpu=False) == (10.0, bandwidth.DEFAULT_GBPS["gloo"][1])
    assert bandwidth.bandwidth_problems(node, {"intra_gbps": 5.0, "inter_gbps": None}, cfg, False) == []
    (slow,) = bandwidth.bandwidth_problems(node, {"intra_gbps": 4.9, "inter_gbps": None}, cfg, False)
    assert "inside the node at 4.9 GB/s, under 50% of the 10 GB/s the run counts on (cluster.intra_node_gbps)" in (
        slow.line
    )
    assert bandwidth.rounds(2) == [[(0, 1)]]
    assert bandwidth.rounds(4) == [[(0, 1), (2, 3)], [(1, 2), (3, 0)]]
    assert sorted(p for r in bandwidth.rounds(3) for p in r) == [(0, 1), (1, 2), (2, 0)]


def test_a_fatal_problem_stops_the_start_and_off_skips_the_check(monkeypatch):
    cfg = to_config(compose([]))
    fatal = problems(facts(rayhybrid="0.0.9"))
    checked = run.Checked([], {}, DRIVER, False, problems=fatal)
    monkeypatch.setattr(run, "check_cluster", lambda *a, **k: checked)
    events = []
    with pytest.raises(ConfigError) as caught:
        run.startup_check(cfg, None, events.append)
    assert caught.value.setting == "cluster.check" and "rayhybrid 0.0.9" in str(caught.value)
    assert "cluster.check=off" in str(caught.value) and events[0]["event"] == "check"
    monkeypatch.setattr(run, "check_cluster", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no Ray")))
    assert run.startup_check(cfg, None, events.append) is None and len(events) == 1  # the run goes on
    off = to_config(compose(["cluster.check=off"]))
    assert run.startup_check(off, None, events.append) is None and len(events) == 1
    with pytest.raises(ConfigError, match="cluster.check: unknown value 'never'"):
        rayhybrid.preflight.load_config(["cluster.check=never"])


# -- on a cluster ---------------------------------------------------------------------------------

BUCKET = "checked"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three nodes (the head holds no ranks): healthy, `odd` (numpy 0.0.1 by its metadata) and
    `far` (s3:// at a dead port); the driver has moto's endpoint and credentials."""
    tmp = tmp_path_factory.mktemp("nodes")
    fake = tmp / "fake" / "numpy-0.0.1.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: numpy\nVersion: 0.0.1\n")
    conf = tmp / "fsspec"
    conf.mkdir()
    (conf / "s3.json").write_text(json.dumps({"s3": {"endpoint_url": s3_server.DEAD_ENDPOINT}}))
    path = os.pathsep.join(p for p in [str(fake.parent), os.environ.get("PYTHONPATH", "")] if p)
    with s3_server.loopback_aws(), local_cluster(head_cpus=0, node_cpus=[2]) as (c, (good,)):
        odd = c.add_node(num_cpus=2, include_dashboard=False, env_vars={"PYTHONPATH": path})
        far = c.add_node(num_cpus=2, include_dashboard=False, env_vars={"FSSPEC_CONFIG_DIR": str(conf)})
        c.wait_for_nodes()
        with s3_server.moto_server() as endpoint, s3_server.env(AWS_ENDPOINT_URL=endpoint, **s3_server.CREDENTIALS):
            s3_server.make_bucket(BUCKET, endpoint)
            yield c, {"good": good, "odd": odd, "far": far}


def check(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    return exited.value.code, capsys.readouterr().out


LOW = ["cluster.intra_node_gbps=0.001", "cluster.inter_node_gbps=0.001"]
"""What the bandwidth is held against here: four helpers' jobs share two cores, so the
figures say nothing of a link; the floor itself is tested above."""


@pytest.mark.slow
def test_the_check_names_the_two_odd_nodes_with_their_fixes(cluster, capsys, tmp_path):
    _, nodes = cluster
    odd, far = nodes["odd"], nodes["far"]
    code, out = check(capsys, *LOW, f"checkpoint.dir=s3://{BUCKET}/run", f"check.json={tmp_path / 'check.json'}")
    lines = out.splitlines()
    problems = lines[: lines.index("")] if "" in lines else []
    numpy = importlib.metadata.version("numpy")
    assert len(problems) == 2, out
    by_node = {line.split(":", 1)[0]: line for line in problems}
    assert by_node[f"node {odd.node_id[:8]} ({odd.node_ip_address})"].endswith(
        f": numpy 0.0.1, the driver has {numpy}; install numpy=={numpy} there, or run the driver with numpy==0.0.1"
    )
    unreachable = by_node[f"node {far.node_id[:8]} ({far.node_ip_address})"]
    assert f"checkpoint.dir s3://{BUCKET}/run: cannot write there (EndpointConnectionError" in unreachable
    assert unreachable.endswith("or use a mount every node shares")
    assert code == 1 and lines[-1].startswith("2 problem(s) on 3 node(s)")
    record = json.loads((tmp_path / "check.json").read_text())
    assert record["event"] == "check" and len(record["nodes"]) == 3 and record["problems"] == problems
    assert all(isinstance(n["intra_gbps"], float) and isinstance(n["inter_gbps"], float) for n in record["nodes"])
    assert s3_server.CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in json.dumps(record)


@pytest.mark.slow
def test_a_run_start_warns_records_the_check_and_trains_on(cluster, tmp_path, caplog):
    _, nodes = cluster
    steps = ["train.steps=2", "train.global_batch_size=2", "train.micro_batch_size=1", "data.seq_len=16"]
    summary = rayhybrid.train([*steps, "checkpoint.every=0"], run_dir=tmp_path / "run")
    assert summary["status"] == "completed"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (event,) = [r for r in records if r.get("event") == "check"]
    odd = nodes["odd"].node_id[:8]
    assert [p.split(":")[0] for p in event["problems"]] == [f"node {odd} ({nodes['odd'].node_ip_address})"]
    assert any("cluster check: " in r.message and "numpy 0.0.1" in r.message for r in caplog.records)
    assert len(event["nodes"]) == 3 and 0 < event["seconds"] < summary["startup_s"], (event, summary["startup_s"])


@pytest.mark.slow
def test_a_healthy_cluster_passes_with_its_table(cluster, capsys):
    c, nodes = cluster
    for name in ("odd", "far"):
        c.remove_node(nodes.pop(name))
    nodes["other"] = add_node(c, 2)
    c.wait_for_nodes()
    code, out = check(capsys, *LOW)
    lines = out.splitlines()
    assert code == 0, out
    assert lines[0].split() == ["node", "ip", "python", "torch", "ray", "rayhybrid", "devices", "store", "data"] + [
        "intra",
        "GB/s",
        "inter",
        "GB/s",
    ]
    assert {line.split()[0] for line in lines[2:5]} == {"driver", *(n.node_id[:8] for n in nodes.values())}
    assert "cpu, gloo" in lines[3] and lines[-1].startswith("no problem on 2 node(s)")


# -- nodes a run starts using later (rayhybrid/check/join.py) -------------------------------------


def test_a_joining_node_is_checked_once_and_a_fatal_one_kept_off(monkeypatch, caplog):
    cfg = to_config(compose([]))
    torch = problems(facts(torch="2.0.0"))  # on "node 1a2b3c4d (10.0.0.5)"
    bad = Node("1a2b3c4d" + "0" * 24, "10.0.0.5", 0.0)
    asked, drained = [], []

    def check_cluster(cfg, shape, *, bandwidth, store, only):
        assert not bandwidth and not store
        asked.append(set(only))
        answer = {bad.id: {**facts(torch="2.0.0"), "host": "h"}}
        return run.Checked([bad] if bad.id in only else [], answer, DRIVER, False, torch)

    monkeypatch.setattr(run, "check_cluster", check_cluster)
    monkeypatch.setattr(join, "keep_off", drained.append)
    events = []
    start = run.Checked([Node("a" * 32, "10.0.0.1", 0.0)], {}, DRIVER, False)
    joins = join.JoinCheck(cfg, None, events.append, start)
    assert joins.refused(["a" * 32]) == frozenset() and asked == []  # the start checked it: no check
    assert joins.refused(["a" * 32, bad.id]) == {bad.id} and asked == [{bad.id}] and drained == [bad.id]
    (event,) = events
    assert event["event"] == "check" and event["joined"] is True and event["problems"] == [torch[0].line]
    assert any(r.message == f"cluster check: {torch[0].line}" for r in caplog.records)
    assert joins.refused([bad.id, "a" * 32]) == {bad.id} and len(asked) == 1 and len(events) == 1  # once
    # A check that cannot run warns once and lets the node in; cluster.check=off asks nothing.
    monkeypatch.setattr(run, "check_cluster", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no Ray")))
    assert joins.refused(["c" * 32]) == frozenset() and len(events) == 1
    assert sum("could not run on the joining node(s) (RuntimeError: no Ray)" in r.message for r in caplog.records) == 1
    assert joins.refused(["c" * 32]) == frozenset()
    off = join.JoinCheck(to_config(compose(["cluster.check=off"])), None, events.append, None)
    assert off.refused([bad.id]) == frozenset() and len(events) == 1
    # The start's check could not run: the nodes of the first start go unchecked as well.
    unchecked = join.JoinCheck(cfg, None, events.append, None)
    assert unchecked.refused([bad.id]) == frozenset() and len(asked) == 1


class Placed:
    """A worker group's placement: slot -> node; a slot replaced goes to `elsewhere` (None: stays pending)."""

    def __init__(self, nodes: dict[int, str], elsewhere: str | None) -> None:
        self.nodes, self.elsewhere, self.replaced = dict(nodes), elsewhere, []

    def nodes_of(self, slots):
        return [self.nodes[s] for s in slots]

    def replace(self, slots):
        self.replaced += slots

    def wait_placed(self, slots, timeout_s):
        for s in slots:
            self.nodes[s] = self.elsewhere
        return set() if self.elsewhere else set(slots)


@pytest.mark.parametrize("elastic", [False, True])
def test_the_launcher_moves_replicas_off_a_refused_node(elastic, caplog):
    cfg = to_config(compose(["elastic.enabled=true", "elastic.max_dp=2"] if elastic else ["topology.dp=2"]))
    launcher = Launcher(cfg, ScalingPolicy.of(cfg), None, None, None, None)
    launcher.joins = SimpleNamespace(refused=lambda nodes: frozenset(set(nodes) & {"bad"}))
    group = Placed({0: "good", 1: "good"}, elsewhere=None)
    assert launcher.keep_off(RunState(), group, (0, 1)) == (RunState(), (0, 1)) and group.replaced == []
    group = Placed({0: "good", 1: "bad"}, elsewhere="other")  # placed again elsewhere: all slots kept
    run_state, slots = launcher.keep_off(RunState(), group, (0, 1))
    assert slots == (0, 1) and group.replaced == [1] and run_state.evacuated == {"bad"}
    group = Placed({0: "good", 1: "bad"}, elsewhere=None)  # no room elsewhere
    if elastic:
        assert launcher.keep_off(RunState(), group, (0, 1))[1] == (0,)
        wait = cfg.elastic.reschedule_timeout_s
        line = f"cluster check: 1 replica(s) not placed off node(s) bad within {wait:.0f}s; the run goes on at dp 1"
        assert [r.getMessage() for r in caplog.records] == [line]
    else:
        launcher.ledger = SimpleNamespace(last_good=lambda: "no checkpoint yet")
        with pytest.raises(RunFailed, match="could not be placed again"):
            launcher.keep_off(RunState(), group, (0, 1))


@pytest.mark.slow
def test_a_node_joining_with_another_torch_is_kept_off_and_the_run_goes_on(cluster, tmp_path, caplog):
    """On the healthy cluster (good and other, a replica each: cluster.cpus_per_rank=2), an elastic run starts at dp 2; a node whose torch is 2.0.0 by its metadata joins and holds
    the third replica's placement group. At the grow, the check warns, records the event and
    drains the node: no rank starts there, the run goes on at dp 2 with the reference's losses."""
    c, nodes = cluster
    for name in ("odd", "far"):  # gone already when the healthy-cluster test ran first
        if name in nodes:
            c.remove_node(nodes.pop(name))
    if "other" not in nodes:
        nodes["other"] = add_node(c, 2)
        c.wait_for_nodes()
    fake = tmp_path / "fake" / "torch-2.0.0.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.0.0\n")
    common = ["cluster.cpus_per_rank=2", "train.global_batch_size=6", "train.micro_batch_size=1", "data.seq_len=16"]
    common += ["train.steps=30", "checkpoint.every=3"]
    reference = rayhybrid.train([*common, "topology.dp=2"], run_dir=tmp_path / "ref")
    assert reference["status"] == "completed"
    elastic = ["elastic.enabled=true", "elastic.min_dp=1", "elastic.max_dp=3", "elastic.reschedule_timeout_s=3"]
    thread, result = in_background([*common, *elastic], tmp_path / "run")
    when_step(tmp_path / "run", 1)
    path = os.pathsep.join(p for p in [str(fake.parent), os.environ.get("PYTHONPATH", "")] if p)
    bad = c.add_node(num_cpus=2, include_dashboard=False, env_vars={"PYTHONPATH": path})
    thread.join(timeout=300)
    assert result.get("summary", {}).get("status") == "completed", result
    name = f"node {bad.node_id[:8]} ({bad.node_ip_address})"
    line = f"{name}: torch 2.0.0, the driver has {importlib.metadata.version('torch')}; install torch=="
    assert any(r.message.startswith(f"cluster check: {line}") for r in caplog.records)
    gone = f"cluster check: 1 replica(s) not placed off node(s) {bad.node_id[:8]} within 3s; the run goes on at dp 2"
    assert gone in [r.message for r in caplog.records]
    checks = [e for e in events(tmp_path / "run", "check") if e.get("joined")]
    assert [[p.split(";")[0] for p in e["problems"]] for e in checks] == [[line.split(";")[0]]]
    assert [n["node"] for n in checks[0]["nodes"]] == [bad.node_id]
    workers = json.loads((tmp_path / "run" / "workers.json").read_text())
    assert bad.node_id not in {w["node_id"] for w in workers} and len(workers) == 2
    assert {r["dp"] for r in records(tmp_path / "run") if "loss" in r} == {2}  # no step at dp 3
    assert losses(tmp_path / "run") == pytest.approx(losses(tmp_path / "ref"), rel=1e-5)
    with contextlib.suppress(Exception):  # Ray may have shut the drained node down already
        c.remove_node(bad)
