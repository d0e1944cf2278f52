"""Recovery: a rank or a node lost, to the first step after it, rayhybrid's ways (peer heal,
checkpoint restore, a stopped rank, a node lost outright) against Ray Train's restart."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import common
from figures import fmt, header, table

RECOVERY = [
    "+topology=dp2_pp2_tp2",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "data.seq_len=32",
    "checkpoint.every=3",
    "train.steps=30",  # the kills wait for the warm standby: its imports take seconds on a busy machine
    "train.log_every=100",
]


def run(tmp: Path, quick: bool) -> dict:
    """Kill to the first step after it, broken down, in one invocation: dp2_pp2_tp2 with rank 5
    SIGKILLed after step 5 once the warm standby is ready, healed from its peer (the default),
    the same without standbys (fault.standby=0), and restored from the checkpoint
    (fault.heal=false); rank 3 SIGKILLed while a checkpoint uploads; rank 5 stopped
    (SIGSTOP, fault.step_timeout_s=5); a node killed outright (dp2 on a 2-node Cluster); and Ray
    Train with FailureConfig (8 DDP workers, a checkpoint every step)."""
    cases = {
        "peer heal": _recovery_case(tmp / "heal", [], _after_step(5, 5)),
        "peer heal, no standby": _recovery_case(tmp / "cold", ["fault.standby=0"], _after_step(5, 5, standby=False)),
        "checkpoint restore": _recovery_case(tmp / "restore", ["fault.heal=false"], _after_step(5, 5)),
        "upload in flight": _recovery_case(tmp / "upload", [], _uploading(3)),
        "stopped rank": _recovery_case(tmp / "stop", ["fault.step_timeout_s=5"], _after_step(5, 5, signal.SIGSTOP)),
        "node killed outright": _node_outright(tmp / "node"),
    }
    theirs = common.baseline(
        "raytrain_train.py",
        [
            "train.global_batch_size=8",
            "train.micro_batch_size=1",
            "data.seq_len=32",
            "--num-workers",
            "8",
            "--steps",
            "10",
            "--kill-at",
            "5",
        ],
    )
    return {"cases": cases, "raytrain": theirs}


RECORD = (
    "healed",
    "steps_redone",
    "bytes_sent",
    "total_s",
    "detect_s",
    "teardown_s",
    "place_s",
    "init_s",
    "restore_s",
    "first_step_s",
)


READY = "ready on node"  # the log line of a warm standby ready (rayhybrid/cluster/standby.py)


def _after_step(step: int, rank: int, sig: int = signal.SIGKILL, standby: bool = True):
    """After step `step` and (`standby`) once the warm standbys are ready (their imports take
    seconds after the first step), `sig` to rank `rank`."""

    def strike(run: common.Run) -> float:
        run.wait_for_step(step)
        if standby:
            run.wait_for_line(READY)
        return run.signal_rank(rank, sig)

    return strike


def _uploading(rank: int):
    def strike(run: common.Run) -> float:
        run.wait_for_line(READY)  # then the first upload after it
        seen = len(run.output)
        while not any(
            line.startswith("checkpoint step") and ": training blocked" in line for line in run.output[seen:]
        ):
            if run.proc.poll() is not None:
                raise RuntimeError(f"the run ended before an upload:\n{''.join(run.output[-30:])}")
            time.sleep(0.01)
        return run.signal_rank(rank, signal.SIGKILL)

    return strike


def _recovery_case(run_dir: Path, extra: list[str], strike) -> dict:
    """One run of RECOVERY with `strike` (which returns the wall time of the signal): the
    restart record and the wall time from the signal to the next step's record."""
    run = common.Run([*RECOVERY, *extra], run_dir)
    struck = strike(run)
    summary = run.finish()
    (rec,) = summary["recoveries"]
    after = next(r["time"] for r in common.steps_of(run_dir) if r["time"] > struck)
    return {"kill_to_next_step_s": round(after - struck, 2)} | {k: rec.get(k) for k in RECORD}


def _node_outright(run_dir: Path) -> dict:
    """dp2 (a rank per node) on a 2-node Cluster with the health checks docs/recovery-and-
    elasticity.md suggests; after step 4 the node of rank 0 dies at once (its raylet and its
    rank), as in a power loss; the run places the lost replica on the other node and heals it."""
    import threading

    import ray
    from clusters import add_node, local_cluster, lose_power

    sys.path.insert(0, str(common.ROOT))
    import rayhybrid

    with local_cluster(head_cpus=0, node_cpus=[2, 2]) as (cluster, _):
        out: dict = {}
        overrides = [o for o in RECOVERY if not o.startswith("+topology")] + ["+topology=dp2", "train.steps=9"]
        thread = threading.Thread(target=lambda: out.update(s=rayhybrid.train(overrides, run_dir=run_dir)))
        thread.start()
        while len(common.steps_of(run_dir)) < 4:
            time.sleep(0.02)
        workers = json.loads((run_dir / "workers.json").read_text())
        node = next(n for n in cluster.list_all_nodes() if n.node_id == workers[0]["node_id"])
        struck = time.time()
        cluster.remove_node(node, allow_graceful=False)
        lose_power(workers, node.node_id)
        add_node(cluster, 2)  # a spare comes up, as an autoscaler's would
        thread.join(timeout=600)
        ray.shutdown()
    (rec,) = out["s"]["recoveries"]
    after = next(r["time"] for r in common.steps_of(run_dir) if r["time"] > struck)
    return {"kill_to_next_step_s": round(after - struck, 2)} | {k: rec.get(k) for k in RECORD}


def section(r: dict) -> str:
    """Its section of BENCHMARKS.md."""
    out = (
        "## 4. Recovery: a rank or node lost, to the first step after it\n\nrayhybrid: dp2_pp2_tp2 (8 ranks), "
        "a checkpoint every 3 steps; rank 5 SIGKILLed after step 5 (healed from its data-parallel peer, the "
        "default, and with `fault.heal=false` restored from the checkpoint of step 3), rank 3 SIGKILLed while "
        "a checkpoint uploads, rank 5 stopped with SIGSTOP (`fault.step_timeout_s=5`); each once the warm "
        "standby (`fault.standby=1`, the default) is ready, so the replacement is the standby's process, and "
        "the peer heal once more with `fault.standby=0` (a new process started and importing); and dp2 on a "
        "2-node `Cluster` (health checks every 1 s, 3 failures) whose node of rank 0 dies outright after "
        "step 4 while a spare node comes up. Ray Train: 8 DDP workers, `FailureConfig(max_failures=1)`, a "
        "checkpoint reported every step, worker 5 killed after step 5's checkpoint is committed; Ray Train "
        "restarts the whole worker group. Kill to next step: from the signal to the driver's record of the "
        "next step.\n\n"
    )
    out += header(r)
    cases, theirs = r.get("cases") or {}, r.get("raytrain") or {}
    rows = []
    for name, c in cases.items():
        phases = ", ".join(
            f"{k[:-2].replace('_', ' ')} {fmt(c.get(k))}"
            for k in ("detect_s", "teardown_s", "place_s", "init_s", "restore_s", "first_step_s")
            if c.get(k) is not None
        )
        moved = f", {c['bytes_sent'] / 1e6:.2f} MB sent" if c.get("bytes_sent") else ""
        source = f"{c.get('healed')}, {c.get('steps_redone')}{moved}"
        rows.append([f"rayhybrid, {name}", fmt(c.get("kill_to_next_step_s"), 1), source, phases])
    if theirs:
        rows.append(
            [
                "Ray Train",
                fmt(theirs.get("kill_to_first_step_s"), 1),
                f"checkpoint, {theirs.get('steps_redone', '?')}",
                ", ".join(
                    f"{k[:-2].replace('_', ' ')} {fmt(v)}"
                    for k, v in (theirs.get("breakdown") or {}).items()
                    if v is not None
                ),
            ]
        )
    if rows:
        out += table(["", "kill to next step (s)", "state from, steps redone", "phases (s)"], rows)
    heal, ray_train = cases.get("peer heal", {}), theirs.get("kill_to_first_step_s")
    if heal.get("kill_to_next_step_s") and ray_train:
        out += f"Ray Train takes {ray_train / heal['kill_to_next_step_s']:.1f}x as long as a peer heal.\n\n"
    cold = cases.get("peer heal, no standby", {})
    if heal.get("init_s") and cold.get("init_s"):
        out += (
            f"A warm standby taking the rank over: init {fmt(heal['init_s'])} s against {fmt(cold['init_s'])} s for "
            f"a new process ({heal['init_s'] / cold['init_s']:.2f}x), kill to next step "
            f"{fmt(heal.get('kill_to_next_step_s'), 1)} s against {fmt(cold.get('kill_to_next_step_s'), 1)} s, "
            "in this invocation (timings on 2 cores are noisy: compare within this table). The node "
            "killed outright loses its standby with it: its rank starts anew on the spare node.\n\n"
        )
    return out


def summary(r: dict) -> str:
    """Its line of the printed table (after its name): the figures that matter."""
    return (
        ", ".join(f"{k} {fmt(c.get('kill_to_next_step_s'), 1)}s" for k, c in r["cases"].items())
        + f", Ray Train {fmt(r['raytrain'].get('kill_to_first_step_s'), 1)}s"
    )
