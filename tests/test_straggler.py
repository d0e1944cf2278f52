"""Stragglers (fault.straggler, rayhybrid/driver/stragglers.py): the rule on synthetic per-rank
compute times (named within exactly fault.straggler_steps steps, not at 1.19x, a dip resets the
count, peers by pipeline stage, a node's TP group named as one node), then real runs on CPU
gloo on a three-node `ray.cluster_utils.Cluster` (one spare node): a rank slowed from outside
(its process stopped and continued on a duty cycle) is named with its node; with `evacuate`
the run moves off that node with losses bitwise equal to an uninterrupted run's; a run with
no slow rank names none over 200 steps."""

from __future__ import annotations

import contextlib
import json
import logging
import types

import pytest
import ray

from rayhybrid.driver.stragglers import StragglerPolicy, StragglerWatch
from rayhybrid.errors import ConfigError
from rayhybrid.preflight import load_config


def placement(dp: int, pp: int = 1, tp: int = 1, nodes: dict[int, str] | None = None) -> list[dict]:
    """Ranks in rank order (dp-major, then pp, then tp, as the layout numbers them); by default
    one node per replica."""
    out = []
    for d in range(dp):
        for p in range(pp):
            for t in range(tp):
                rank = len(out)
                node = (nodes or {}).get(rank, f"node{d:02d}" + "f" * 26)
                out.append({"rank": rank, "dp": d, "pp": p, "tp": t, "node_id": node, "ip": f"10.0.0.{d}"})
    return out


def feed(policy: StragglerPolicy, rows: list[list[float]], first: int = 1) -> list:
    named = []
    for i, row in enumerate(rows):
        named += policy.observe(first + i, row)
    return named


def test_named_within_exactly_the_configured_steps_and_once_per_episode():
    policy = StragglerPolicy(placement(4), slowdown=1.2, steps=5)
    rows = [[1.0, 1.0, 1.0, 1.0]] * 3 + [[1.0, 1.0, 1.5, 1.0]] * 20
    named_at = [(n.step, n.rank) for n in feed(policy, rows)]
    assert named_at == [(8, 2)]  # slow from step 4: its fifth slow step is step 8; once, not every step
    (n,) = feed(StragglerPolicy(placement(4), 1.2, 5), rows)
    assert n.node == "node02" + "f" * 26 and n.ip == "10.0.0.2" and n.coords == (2, 0, 0) and n.slowdown == 1.5


def test_just_below_the_ratio_is_never_named():
    policy = StragglerPolicy(placement(4), slowdown=1.2, steps=5)
    assert feed(policy, [[1.0, 1.19, 1.0, 1.0]] * 100) == []
    policy = StragglerPolicy(placement(4), slowdown=1.2, steps=5)
    assert [n.rank for n in feed(policy, [[1.0, 1.2, 1.0, 1.0]] * 5)] == [1]  # exactly 1.2x counts


def test_a_dip_below_for_one_step_resets_the_count():
    policy = StragglerPolicy(placement(2), slowdown=1.2, steps=5)
    slow, dip = [1.0, 1.5], [1.0, 1.1]
    rows = [slow] * 4 + [dip] + [slow] * 4 + [dip] + [slow] * 5
    assert [n.step for n in feed(policy, rows)] == [15]
    # Once named, a one-step dip does not end the episode (no second name); `steps` calm steps do.
    rows = [dip] * 3 + [slow] * 2 + [dip] * 5 + [slow] * 5
    assert [n.step for n in feed(policy, rows, first=16)] == [30]  # calm 21-25 ends it; slow 26-30


def test_peers_are_the_ranks_of_the_same_pipeline_stage():
    # dp2 x pp2: stage 1 is twice as slow as stage 0 everywhere (its work, not a straggler).
    policy = StragglerPolicy(placement(2, pp=2), slowdown=1.2, steps=3)
    assert feed(policy, [[1.0, 2.0, 1.0, 2.0]] * 10) == []
    # Rank 3 (dp 1, stage 1) slower than rank 1, its one peer: named; rank 2 (stage 0) is not.
    named = feed(StragglerPolicy(placement(2, pp=2), 1.2, 3), [[1.0, 2.0, 1.0, 3.0]] * 10)
    assert [(n.rank, n.coords) for n in named] == [(3, (1, 1, 0))]


def test_a_nodes_tp_group_slowed_together_is_one_node():
    # dp2 x tp2, a replica per node; node 1's two TP ranks slowed together (the second one step later).
    policy = StragglerPolicy(placement(2, tp=2), slowdown=1.2, steps=4)
    rows = [[1.0, 1.0, 1.6, 1.0]] + [[1.0, 1.0, 1.6, 1.7]] * 10
    (n,) = feed(policy, rows)
    assert n.node.startswith("node01") and n.step == 4 and n.ranks == (2,)
    # Both at once: one name, both ranks, the slower one first.
    (n,) = feed(StragglerPolicy(placement(2, tp=2), 1.2, 4), [[1.0, 1.0, 1.6, 1.7]] * 10)
    assert n.ranks == (2, 3) and n.rank == 3 and n.slowdown == 1.7


def test_one_rank_per_stage_has_no_peers_and_says_so_once(caplog):
    runlog = types.SimpleNamespace(event=lambda record: None)
    watch = StragglerWatch(load_config([]).fault, runlog)
    with caplog.at_level(logging.INFO, logger="rayhybrid"):
        watch.after_workers_start(placement(1), {})
        watch.after_workers_start(placement(1), {})  # a restart: not said again
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "no rank has peers" in caplog.records[0].message
    for step in range(1, 20):
        watch.after_step({"step": step, "compute_s_by_rank": [5.0]})
    assert watch.named == []


def test_watch_writes_the_event_and_the_summary_and_drains_on_evacuate(caplog):
    events, drained = [], []
    fault = load_config(["fault.straggler=evacuate", "fault.straggler_steps=2"]).fault
    watch = StragglerWatch(
        fault, types.SimpleNamespace(event=events.append), drain=lambda *a: drained.append(a) or True
    )
    watch.after_workers_start(placement(2), {})
    with caplog.at_level(logging.WARNING, logger="rayhybrid"):
        for step in range(1, 6):
            watch.after_step({"step": step, "compute_s_by_rank": [0.1, 0.25]})
    (event,) = events
    assert {k: event[k] for k in ("event", "rank", "dp", "pp", "tp", "slowdown", "steps", "action")} == {
        "event": "straggler", "rank": 1, "dp": 1, "pp": 0, "tp": 0, "slowdown": 2.5, "steps": 2, "action": "evacuate"
    }  # fmt: skip
    assert event["node"] == "node01" + "f" * 26 and event["step"] == 2
    ((node, message),) = drained
    assert node == event["node"] and "straggler" in message and node in watch.drained
    (line,) = [r.message for r in caplog.records if "straggler" in r.message]
    assert "rank 1 (dp 1, pp 0, tp 0)" in line and "node node01ff (10.0.0.1)" in line and "2.50x" in line
    summary: dict = {}
    watch.before_close(summary, [])
    assert summary["stragglers"] == [{k: v for k, v in event.items() if k != "event"}]
    json.dumps(summary)


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [
        (["fault.straggler=kill"], "fault.straggler"),
        (["fault.straggler_slowdown=1.0"], "fault.straggler_slowdown"),
        (["fault.straggler_slowdown=0.5"], "fault.straggler_slowdown"),
        (["fault.straggler_steps=0"], "fault.straggler_steps"),
    ],
)
def test_bad_settings_name_the_setting(overrides, setting):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    assert info.value.setting == setting and "\n" not in str(info.value)


def test_a_drain_ray_refuses_leaves_the_action_warn():
    events = []
    fault = load_config(["fault.straggler=evacuate", "fault.straggler_steps=1"]).fault
    watch = StragglerWatch(fault, types.SimpleNamespace(event=events.append), drain=lambda node, why: False)
    watch.after_workers_start(placement(3), {})
    watch.after_step({"step": 1, "compute_s_by_rank": [0.1, 0.1, 0.3]})
    assert [e["action"] for e in events] == ["warn"] and watch.drained == {}


# -- real runs: CPU gloo on a three-node Cluster (one replica per node, one node spare) --------

# dp2, a replica per node (a rank takes a node's 2 CPUs), on two of the three nodes.
RUN = [
    "+topology=dp2",
    "cluster.cpus_per_rank=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "data.seq_len=256",  # steps of ~70 ms: 5 in a row outlast most of a shared machine's blips
    "checkpoint.every=1000",  # the move's own checkpoint is the one restored (and the last step's)
    "train.steps=200",
    # No warm standby: its start (torch imported beside the ranks, on this machine's 2 cores) is
    # a real noisy neighbour, which made one rank 1.2x slower up to 4 steps in a row (3 runs).
    "fault.standby=0",
]
STOP_S, RUN_S = 0.014, 0.006  # the slowed rank's duty cycle: stopped 70% of every 20 ms
# The slowed rank computes ~3x its peer's: 1.5x names it as surely as 1.2x, and a neighbour's
# blip on this shared 2-core machine (measured: up to 1.4x for 7 steps) does not name the peer
# (with evacuate, a second drain with no node spare would stop the run).
SLOWED = ["fault.straggler_slowdown=1.5"]
SLACK = 2  # steps: the one in progress when the slowing starts, and a record written meanwhile


@pytest.fixture(scope="module")
def cluster():
    from benchmarks.clusters import local_cluster

    with local_cluster(head_cpus=0, node_cpus=[2, 2, 2]) as (c, _):
        yield c


@pytest.fixture(scope="module")
def quiet_run(cluster, tmp_path_factory):
    """An uninterrupted run with no slow rank: the reference losses, and its summary."""
    import rayhybrid

    run_dir = tmp_path_factory.mktemp("quiet")
    summary = rayhybrid.train(RUN, run_dir=run_dir)
    assert summary["status"] == "completed"
    return run_dir, summary


class DutyCycle:
    """Slows one process from outside: SIGSTOP for STOP_S, SIGCONT for RUN_S, until `stop()`
    (it always leaves the process continued)."""

    def __init__(self, pid: int) -> None:
        import threading

        self.pid, self.done = pid, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import os
        import signal
        import time

        try:
            while not self.done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(STOP_S)
                os.kill(self.pid, signal.SIGCONT)
                time.sleep(RUN_S)
        except ProcessLookupError:
            return
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(timeout=5)


def records(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(predicate, timeout: float = 240.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    raise TimeoutError("not seen in time")


def steps_done(run_dir) -> int:
    return sum("event" not in r for r in records(run_dir))


def slowed_run(overrides: list[str], run_dir, victim_dp: int = 1):
    """A run of RUN + `overrides` whose replica `victim_dp` is slowed from step 10 until the run
    names a straggler: (summary, the victim's placement entry, the last step before the slowing)."""
    from tests.test_recovery import in_background, when_step

    thread, result = in_background([*RUN, *overrides], run_dir)
    when_step(run_dir, 10)
    victim = next(w for w in json.loads((run_dir / "workers.json").read_text()) if w["dp"] == victim_dp)
    before = steps_done(run_dir)
    with DutyCycle(victim["pid"]):
        wait_for(lambda: [r for r in records(run_dir) if r.get("event") == "straggler"] or not thread.is_alive())
    thread.join(timeout=400)
    assert "summary" in result, result.get("error")
    return result["summary"], victim, before


@pytest.mark.slow
def test_no_slow_rank_names_none_over_200_steps(quiet_run):
    run_dir, summary = quiet_run
    assert summary["stragglers"] == [] and not [r for r in records(run_dir) if r.get("event") == "straggler"]
    assert summary["steps"] == 200
    assert all(len(r["compute_s_by_rank"]) == 2 for r in records(run_dir) if "event" not in r)


@pytest.mark.slow
def test_a_rank_slowed_from_outside_is_named_with_its_node(cluster, tmp_path):
    summary, victim, before = slowed_run(SLOWED, tmp_path / "run")
    (named,) = summary["stragglers"]
    assert (named["rank"], named["dp"], named["node"], named["action"]) == (
        victim["rank"],
        1,
        victim["node_id"],
        "warn",
    )
    assert named["ip"] == victim["ip"] and named["slowdown"] >= 1.2 and named["steps"] == 5
    assert before < named["step"] <= before + 5 + SLACK
    assert summary["preemptions"] == [] and summary["restarts"] == 0


@pytest.mark.slow
def test_evacuate_moves_off_the_slow_node_losing_nothing(cluster, quiet_run, tmp_path):
    from tests.test_recovery import losses

    run_dir = tmp_path / "run"
    summary, victim, before = slowed_run([*SLOWED, "fault.straggler=evacuate"], run_dir)
    (named,) = summary["stragglers"]
    assert (named["node"], named["action"]) == (victim["node_id"], "evacuate")
    assert before < named["step"] <= before + 5 + SLACK
    (move,) = summary["preemptions"]
    assert move["node"] == victim["node_id"] and move["reason"] == "straggler" and move["lost_steps"] == 0
    assert summary["status"] == "completed" and summary["restarts"] == 0
    assert victim["node_id"] not in {w["node_id"] for w in summary["placement"]}
    assert losses(run_dir) == losses(quiet_run[0])  # each step once, bitwise
    # Ray shuts a drained node down once nothing runs on it (docs/observability.md#stragglers).
    alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
    wait_for(
        lambda: not alive.update({n["NodeID"]: n["Alive"] for n in ray.nodes()}) and not alive[victim["node_id"]], 60
    )


def test_peers_computing_next_to_nothing_count_neither_way():
    """Against peers whose median compute is below max(1 ms, 1% of the step) a rank's ratio is
    huge and meaningless: that stage's step counts neither for nor against (no evacuation)."""
    policy = StragglerPolicy(placement(4), slowdown=1.2, steps=2)
    for step in range(1, 11):  # peers at 0.5 ms (below 1 ms): rank 2's 0.4 s is not a straggler
        assert policy.observe(step, [0.0005, 0.0005, 0.4, 0.0005], 0.5) == []
    for step in range(11, 21):  # 5 ms peers, but under 1% of a 1 s step: still skipped
        assert policy.observe(step, [0.005, 0.005, 0.4, 0.005], 1.0) == []
    # The skipped steps counted neither way: two real slow steps name it, at the second.
    assert policy.observe(21, [0.2, 0.2, 0.4, 0.2], 1.0) == []
    assert [n.rank for n in policy.observe(22, [0.2, 0.2, 0.4, 0.2], 1.0)] == [2]
