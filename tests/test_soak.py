"""A fault soak: a seeded random sequence of faults over the runs of one 3-node Cluster.

- fixed dp2_pp2_tp2: kills, a hang, a raise, a kill during a checkpoint save, two faults in
  quick succession (`fault.inject`), and a node killed outright;
- elastic replicas of tp2: a node removed gracefully and one killed outright, each coming back
  (shrink, then grow), and an injected kill;
- elastic replicas of pp2: random faults (`fault.inject_rate` with a seed) and a node lost;
- warm standbys (`fault.standby`), fixed dp2_pp2_tp2: one SIGKILLed from outside while idle (no
  restart), one SIGKILLed as it takes a lost rank's place (the recovery runs again);
- fencing (tests/test_fencing.py's `partitioned`): a node stopped whole during an upload,
  declared lost, continued; its rank commits nothing (last: it replaces the cluster's nodes).

Every run completes; every sample is read exactly once, in order; every checkpoint resumed
from had been published; every restart record's teardown is at most TEARDOWN_S; the fixed-dp
runs' losses are bitwise equal to an uninterrupted run (float32), the elastic runs' within
1e-5 of a fixed-dp run (a dp change changes the order of the gradient all-reduce's additions,
nothing else). The recovery time of each kind of fault, and the teardowns, are printed
(`pytest -s`).

A longer soak: `RAYHYBRID_SOAK_SCALE=3 python -m pytest -s tests/test_soak.py` (three times the
steps and faults of each run).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import statistics
import time
from pathlib import Path

import pytest
import ray

import rayhybrid
from benchmarks.clusters import add_node, local_cluster, lose_power
from rayhybrid.cluster import drain as drain_module
from rayhybrid.config.compose import compose, to_config
from rayhybrid.faults import FaultPlan
from rayhybrid.storage import checkpoints as checkpoint_store
from rayhybrid.trainer import upload
from tests.clusters import node_pids, warm_standbys
from tests.test_fencing import partitioned
from tests.test_recovery import in_background, losses, signal_rank

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("RAYHYBRID_SOAK_SEED", "7"))
SCALE = int(os.environ.get("RAYHYBRID_SOAK_SCALE", "1"))
G = 12  # splits for dp 1, 2 and 3
BASE = [
    "data.seq_len=32",
    f"train.global_batch_size={G}",
    "train.micro_batch_size=2",
    "checkpoint.every=2",
    "checkpoint.keep=2",
    "fault.step_timeout_s=10",
    "fault.max_restarts=20",
    "train.warmup_steps=2",
]
FIXED = ["+topology=dp2_pp2_tp2", "cluster.cpus_per_rank=0.5"]
TEARDOWN_S = 2.0
"""The most any recovery's teardown (its restart record's `teardown_s`) may take."""
ELASTIC = ["elastic.enabled=true", "elastic.min_dp=1", "elastic.max_dp=3", "elastic.reschedule_timeout_s=3"]
REPORT: dict[str, list[float]] = {}
TEARDOWNS: list[float] = []


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(head_cpus=0, node_cpus=[2, 2, 2]) as (c, _):
        yield c
    if REPORT:
        print("\nrecovery time by kind of fault (s): kind  count  median  worst")
        for kind, times in sorted(REPORT.items()):
            print(f"  {kind:<22} {len(times):>3}  {statistics.median(times):6.1f}  {max(times):6.1f}")
    if TEARDOWNS:
        print(
            f"teardown (s) over {len(TEARDOWNS)} recoveries: median {statistics.median(TEARDOWNS):.2f}, worst {max(TEARDOWNS):.2f}"
        )


def records(run_dir: Path) -> list[dict]:
    """metrics.jsonl as the run has written it so far (a line being written is left out)."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def steps_done(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if "event" not in r]


def wait_for(predicate, what: str, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def ended(run_dir: Path) -> bool:
    return (run_dir / "summary.json").exists()


def three_nodes(cluster) -> None:
    """Three worker nodes of 2 CPUs, all free (a run before may have ended with one short)."""
    alive = sum(n["Alive"] and n["Resources"].get("CPU", 0) > 0 for n in ray.nodes())
    for _ in range(3 - alive):
        add_node(cluster, 2)
    wait_for(lambda: ray.available_resources().get("CPU", 0) == 6, "the cluster's CPUs back")


def node_hosting(run_dir: Path, cluster, dp: int):
    workers = json.loads((run_dir / "workers.json").read_text())
    node_id = next(w["node_id"] for w in workers if w["dp"] == dp)
    return next(n for n in cluster.list_all_nodes() if n.node_id == node_id)


def lose_nodes(cluster, run_dir: Path, plan: list[tuple[int, bool]], elastic: bool) -> list[tuple[int, str]]:
    """While the run trains (in a background thread): at each (step, graceful) of `plan`,
    remove the node of the last replica, wait until the run has recovered, add a node back
    and (elastic) wait until the run has grown back to 3 replicas. Returns (the step that
    failed, what happened) for each. Runs in the main thread: Ray's Cluster sets signal
    handlers when it adds a node."""
    happened = []
    for at_step, graceful in plan:
        wait_for(lambda step=at_step: len(steps_done(run_dir)) >= step or ended(run_dir), f"step {at_step}")
        if ended(run_dir):
            break  # the test then fails on what the run says
        last = steps_done(run_dir)[-1]
        restarts = len([r for r in records(run_dir) if r.get("event") == "restart"])
        victim = node_hosting(run_dir, cluster, last["dp"] - 1)
        workers = json.loads((run_dir / "workers.json").read_text())
        cluster.remove_node(victim, allow_graceful=graceful)
        if not graceful:
            lose_power(workers, victim.node_id)
        happened.append((last["step"] + 1, "node lost gracefully" if graceful else "node killed outright"))
        wait_for(
            lambda n=restarts: ended(run_dir) or len([r for r in records(run_dir) if r.get("event") == "restart"]) > n,
            "the recovery",
        )
        add_node(cluster, 2)
        if elastic:
            wait_for(lambda: ended(run_dir) or steps_done(run_dir)[-1]["dp"] == 3, "the grow back to dp 3")
    return happened


def quick_teardowns(summary: dict) -> None:
    """Every recovery's teardown took at most TEARDOWN_S."""
    TEARDOWNS.extend(r["teardown_s"] for r in summary["recoveries"])
    slow = [(r["restart"], r["teardown_s"], r["cause"]) for r in summary["recoveries"] if r["teardown_s"] > TEARDOWN_S]
    assert not slow, f"teardowns over {TEARDOWN_S:g}s: {slow}"


def check_run(run_dir: Path, summary: dict, steps: int, whole: bool = True) -> None:
    """Completed; each step once; samples read exactly once, in order; only published
    checkpoints were resumed from; every teardown quick. `whole`: no partial checkpoint left."""
    assert summary["status"] == "completed" and summary["steps"] == steps, summary.get("error")
    done = steps_done(run_dir)
    assert [r["step"] for r in done] == list(range(1, steps + 1))
    for r in done:
        expected = G * (r["step"] - 1)
        assert sum(count for _, count in r["samples"]) == G
        for start, count in r["samples"]:
            assert start == expected
            expected += count
    published = set()
    for r in records(run_dir):
        if r.get("event") == "checkpoint":
            published.add(r["path"])
        if r.get("event") == "resume":
            assert r["checkpoint"] in published, f"resumed from {r['checkpoint']}, never published"
    ckpt_root = Path(summary["checkpoint_dir"])
    assert not whole or not checkpoint_store.uncommitted(ckpt_root), "a partial checkpoint was left"
    assert checkpoint_store.latest(ckpt_root).step == steps
    quick_teardowns(summary)


def tally(run_dir: Path, summary: dict, node_log: list) -> list[str]:
    """The kind of fault behind each restart (injected, or a node loss), into REPORT."""
    # A failure belongs to the step being trained; a kill in a save, to the step after the save.
    injected = {r["step"] + (r["phase"] == "save"): r["kind"] for r in summary["faults_injected"]}
    nodes = dict(node_log)
    kinds = []
    for rec in summary["recoveries"]:
        kind = injected.get(rec["failed_step"]) or nodes.get(rec["failed_step"]) or "other"
        kind = "kill in checkpoint save" if kind == "kill_save" else kind
        REPORT.setdefault(kind, []).append(rec["total_s"])
        kinds.append(kind)
    return kinds


def fixed_run_plan(rng: random.Random, steps: int, offset: int = 0) -> tuple[list[str], int]:
    """Kill, hang, raise, a kill during a save and two kills in quick succession (one step
    apart) at random steps, and the step after which a node is killed outright; no two close
    enough to fall into one recovery."""
    node = rng.randrange(5, steps - 3)
    free = [s for s in range(3, steps) if not node - 1 <= s <= node + 2]
    save = rng.choice([s for s in free if s % 2 == 0 and s + 1 in free])
    free = [s for s in free if s not in (save, save + 1)]
    pair = rng.choice([s for s in free if s + 1 in free])
    free = [s for s in free if not pair - 1 <= s <= pair + 2]
    kill, hang, raise_ = rng.sample(free, 3)
    kill, hang, raise_, save, pair, node = (step + offset for step in (kill, hang, raise_, save, pair, node))
    ranks = [rng.randrange(8) for _ in range(5)]  # dp2_pp2_tp2 has 8 ranks
    faults = [
        f"kill@{kill}:{ranks[0]}",
        f"hang@{hang}:{ranks[1]}",
        f"raise@{raise_}",
        f"kill_save@{save}:{ranks[2]}",
        f"kill@{pair}:{ranks[3]}",
        f"kill@{pair + 1}:{ranks[4]}",
    ]
    return faults, node


def reference_runs(tmp_path_factory, name: str, overrides: list[str]):
    """`losses_of(steps)`: the losses of an uninterrupted run of `overrides` and `steps` steps
    (each length run once)."""
    runs: dict[int, list[float]] = {}

    def losses_of(steps: int) -> list[float]:
        if steps not in runs:
            run_dir = tmp_path_factory.mktemp(name)
            summary = rayhybrid.train([*BASE, *overrides, f"train.steps={steps}"], run_dir=run_dir)
            runs[steps] = losses(Path(summary["run_dir"]))
        return runs[steps]

    return losses_of


@pytest.fixture(scope="module")
def fixed_reference(tmp_path_factory):
    """The losses of an uninterrupted dp2_pp2_tp2 run of `steps` steps (each length run once)."""
    return reference_runs(tmp_path_factory, "fixed", FIXED)


def test_fixed_dp2_pp2_tp2(cluster, tmp_path, capfd, fixed_reference):
    rng = random.Random(SEED)
    stretch = 16
    steps = stretch * SCALE
    overrides = [*BASE, *FIXED, f"train.steps={steps}"]
    faults, node_plan = [], []
    for k in range(SCALE):  # a longer soak repeats the pattern in each stretch of the run
        stretch_faults, node = fixed_run_plan(rng, stretch, offset=stretch * k)
        faults += stretch_faults
        node_plan.append((node, False))
    reference = fixed_reference(steps)
    run_dir = tmp_path / "run"
    thread, result = in_background([*overrides, f"fault.inject=[{','.join(faults)}]"], run_dir)
    node_log = lose_nodes(cluster, run_dir, node_plan, elastic=False)
    thread.join(timeout=900)
    summary = result.get("summary")
    assert summary is not None, result.get("error")
    check_run(run_dir, summary, steps)
    assert len(summary["faults_injected"]) == len(faults)
    kinds = tally(run_dir, summary, node_log)
    assert summary["restarts"] == len(faults) + len(node_plan), kinds  # one recovery each
    assert losses(run_dir) == reference  # bitwise
    # The terminal has rayhybrid's lines; Ray's paragraphs about the failures it handled went
    # to the run's ray.log (rayhybrid/driver/raytext.py).
    out, err = capfd.readouterr()
    for paragraph in ("A worker died", "(raylet)", "RayActorError"):
        assert paragraph not in out + err, paragraph
    assert "A worker died" in (run_dir / "ray.log").read_text()


@pytest.fixture(scope="module")
def dp1_reference(tmp_path_factory):
    """The losses of an uninterrupted one-replica run of `steps` steps (each length run once)."""
    return reference_runs(tmp_path_factory, "dp1", [])


def test_elastic_tp2_replicas(cluster, tmp_path, dp1_reference):
    """Two shrink-and-grow cycles. 24 steps, not 16: the run must outlast the second grow, which
    waits for a new Ray node to start (seconds on 2 busy cores); with 16 a contended CI run
    once ended at dp 2 before the node came (resizes [(3, 2), (2, 3), (3, 2)])."""
    rng = random.Random(SEED + 1)
    steps = 24 * SCALE
    three_nodes(cluster)
    kill_at = rng.randrange(3, 6)
    overrides = [
        *BASE,
        *ELASTIC,
        "topology.tp=2",
        "topology.dp=3",
        f"train.steps={steps}",
        f"fault.inject=[kill@{kill_at}]",
    ]
    run_dir = tmp_path / "run"
    thread, result = in_background(overrides, run_dir)
    plan = [(rng.randrange(6, 8), True), (rng.randrange(10 * SCALE, 12 * SCALE), False)]
    node_log = lose_nodes(cluster, run_dir, plan, elastic=True)
    thread.join(timeout=900)
    summary = result.get("summary")
    assert summary is not None, result.get("error")
    check_run(run_dir, summary, steps)
    tally(run_dir, summary, node_log)
    assert [(r["from_dp"], r["to_dp"]) for r in summary["resizes"]] == [(3, 2), (2, 3), (3, 2), (2, 3)]
    assert losses(run_dir) == pytest.approx(dp1_reference(steps), rel=1e-5)


def test_elastic_pp2_replicas_random_faults(cluster, tmp_path, dp1_reference):
    rng = random.Random(SEED + 2)
    steps = 16 * SCALE
    three_nodes(cluster)
    overrides = [
        *BASE,
        *ELASTIC,
        "topology.pp=2",
        "topology.dp=3",
        f"train.steps={steps}",
        "fault.inject_rate=0.15",
        f"fault.inject_seed={SEED}",
        "fault.inject_kinds=[kill,raise,kill_save]",
    ]
    # The node goes at a step no random fault is near, so the two make two recoveries.
    plan = FaultPlan(to_config(compose(overrides)).fault)
    drawn = {step for step in range(1, steps + 1) for phase in ("step", "save") if plan.due(step, phase, 6)}
    node = rng.choice([s for s in range(5, steps - 3) if not drawn & set(range(s - 1, s + 3))])
    run_dir = tmp_path / "run"
    thread, result = in_background(overrides, run_dir)
    node_log = lose_nodes(cluster, run_dir, [(node, True)], elastic=True)
    thread.join(timeout=900)
    summary = result.get("summary")
    assert summary is not None, result.get("error")
    check_run(run_dir, summary, steps)
    kinds = tally(run_dir, summary, node_log)
    assert len(summary["faults_injected"]) >= 2, "the seed should draw at least two random faults"
    assert summary["restarts"] == len(summary["faults_injected"]) + 1, kinds
    assert losses(run_dir) == pytest.approx(dp1_reference(steps), rel=1e-5)


def standby_per_node(cluster, nodes: set[str]) -> dict[str, tuple[str, int]]:
    """node id -> (name, pid) of a warm standby on each of `nodes`, once each has one."""
    deadline = time.monotonic() + 120
    while True:
        warm = warm_standbys()
        owners = {pid: node.node_id for node in cluster.list_all_nodes() for pid in node_pids(node)}
        found = {owners[pid]: (name, pid) for name, pid in warm.items() if pid in owners}
        if nodes <= set(found):
            return found
        assert time.monotonic() < deadline, f"no warm standby on every node of the ranks: {found}"
        time.sleep(0.2)


def test_standbys_killed(cluster, tmp_path, caplog, fixed_reference):
    """A warm standby SIGKILLed from outside (the run goes on: no restart), and a standby
    SIGKILLed from outside as it takes a rank over (the recovery fails in its join and runs
    again, with a new process), in a fixed dp2_pp2_tp2 run. The run is held for both by a hung
    rank (`hang`, found only after fault.step_timeout_s=60), so that the standbys are warm:
    one on another node is killed; the hung rank is SIGKILLed from outside, and as soon as the
    recovery has taken the standby of its node (the driver's log line), that one is SIGKILLed. Two recoveries in all; the losses are an uninterrupted run's."""
    caplog.set_level(logging.INFO, logger="rayhybrid")
    rng = random.Random(SEED + 3)
    steps, hang_at, victim = 16, 4, rng.randrange(8)
    three_nodes(cluster)
    base = [o for o in BASE if not o.startswith("fault.step_timeout_s=")]
    overrides = [
        *base,
        *FIXED,
        f"train.steps={steps}",
        "fault.step_timeout_s=60",
        f"fault.inject=[hang@{hang_at}:{victim}]",
    ]
    run_dir = tmp_path / "run"
    thread, result = in_background(overrides, run_dir)
    wait_for(lambda: ended(run_dir) or any(r.get("event") == "fault_injected" for r in records(run_dir)), "the hang")
    workers = json.loads((run_dir / "workers.json").read_text())
    standbys = standby_per_node(cluster, {w["node_id"] for w in workers})
    hung_node = workers[victim]["node_id"]
    killed_name, killed_pid = next(s for node, s in standbys.items() if node != hung_node)
    os.kill(killed_pid, signal.SIGKILL)  # (a) a warm standby, idle
    taker_name, taker_pid = standbys[hung_node]
    killed_rank = signal_rank(run_dir, victim, signal.SIGKILL)
    # The driver logs the take before the standby joins, builds and is healed (about 0.7 s at
    # the least, BENCHMARKS section 4); the kill follows the log line within milliseconds.
    deadline = time.monotonic() + 120
    while not any(f"taken over by warm standby {taker_name}" in r.getMessage() for r in list(caplog.records)):
        assert time.monotonic() < deadline, "timed out waiting for the standby taken over"
        time.sleep(0.005)
    os.kill(taker_pid, signal.SIGKILL)  # (b) a standby as it takes a rank over
    thread.join(timeout=900)
    summary = result.get("summary")
    assert summary is not None, result.get("error")
    check_run(run_dir, summary, steps)
    first, second = summary["recoveries"]  # none for the idle standby killed
    assert first["failed_step"] == hang_at and "in the recovery" in second["cause"], summary["recoveries"]
    assert json.loads((run_dir / "workers.json").read_text())[victim]["pid"] not in (killed_rank, taker_pid)
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"warm standby {killed_name}" in m and "died" in m for m in messages), (
        "the killed standby went unnoticed"
    )
    REPORT.setdefault("standby killed taking over", []).append(second["total_s"])
    assert losses(run_dir) == fixed_reference(steps)  # bitwise


def test_partitioned_node_fenced_off(cluster, tmp_path, caplog, monkeypatch):
    """The fencing case (tests/test_fencing.py's `partitioned`): dp2, one rank per node and a
    spare, on nodes whose store is slow; rank 0's node is stopped whole (SIGSTOP) while the
    final checkpoint uploads, declared lost, rank 0 healed on the spare node; continued, the
    old rank 0 exits without committing, and every checkpoint a reader takes is the run's. Last
    in this module: it replaces the cluster's nodes by 1-CPU nodes started with the slow store."""
    caplog.set_level(logging.INFO, logger="rayhybrid")
    monkeypatch.setattr(drain_module, "DRAIN_TIMEOUT_S", 5.0)  # as in test_fencing: a bound, not a wait
    monkeypatch.setenv(upload.DELAY_ENV, "1.5")  # the new raylets, and so their workers, inherit it
    old = [n for n in cluster.list_all_nodes() if n is not cluster.head_node]
    for _ in range(3):
        add_node(cluster, 1)
    for node in old:
        cluster.remove_node(node)
    monkeypatch.delenv(upload.DELAY_ENV)
    wait_for(lambda: ray.available_resources().get("CPU", 0) == 3, "the 1-CPU nodes")
    steps = 4
    base = [o for o in BASE if not o.startswith("fault.step_timeout_s=")]
    overrides = [
        *base,
        "+topology=dp2",
        "fault.step_timeout_s=4",
        "cluster.placement_timeout_s=15",
        f"train.steps={steps}",
    ]
    run_dir = tmp_path / "run"
    summary = partitioned(cluster, overrides, steps, run_dir, tmp_path / "ckpts", caplog)
    # The zombie's shards in its own generation's directory stay until a later retention.
    check_run(run_dir, summary, steps, whole=False)
    (recovery,) = summary["recoveries"]  # recorded although no step followed it
    REPORT.setdefault("node partitioned", []).append(recovery["total_s"])
