"""The nodes a run will use and what each says of itself: `probe.node_facts` in a task pinned to
each node (NodeAffinitySchedulingStrategy, soft=False; no CPU asked, so a busy node answers
too), in the environment the run's workers get (the driver's storage settings forwarded).

    nodes = used_nodes(shape)                     # [Node]: alive, able to hold a stage
    answers = ask_nodes(nodes, request, env)      # node id -> facts (a dict) or why none came
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayhybrid.check.probe import Request, node_facts
from rayhybrid.cluster.connect import inherited_env
from rayhybrid.cluster.placement import ReplicaShape, alive_nodes, bundles_that_fit
from rayhybrid.storage.store import forwarded_env, one_line

ASK_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Node:
    id: str
    ip: str
    gpus: float
    """GPUs Ray gives the node (its resources)."""

    @property
    def name(self) -> str:
        return f"node {self.id[:8]} ({self.ip})"


def used_nodes(shape: ReplicaShape) -> list[Node]:
    """The alive nodes that can hold at least one pipeline stage of the run (its tp ranks'
    CPUs, and GPUs on GPUs): those its ranks may be placed on."""
    return [
        Node(n["NodeID"], n["NodeManagerAddress"], float(n.get("Resources", {}).get("GPU", 0.0)))
        for n in alive_nodes()
        if bundles_that_fit(shape, [n]) >= 1
    ]


def workers_env(gpu: bool, storage: bool = True) -> dict[str, str]:
    """The environment the run's workers get on top of a node's (spawn.py's: the driver's
    storage settings not inherited already), when the task reaches a store (`storage`): a task
    with an environment of its own starts a Ray worker of its own (about a second), one
    without takes one Ray started ahead. On GPUs, Ray leaves CUDA_VISIBLE_DEVICES alone, so a
    task that asks for no GPU sees the node's devices."""
    inherited = inherited_env()
    env = {k: v for k, v in forwarded_env().items() if inherited.get(k) != v} if storage else {}
    if gpu:
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    return env


@ray.remote(num_cpus=0, max_retries=0)
def _facts(req: Request) -> dict:
    return node_facts(req)


def ask_nodes(nodes: list[Node], req: Request, env: dict[str, str], timeout_s: float = ASK_TIMEOUT_S) -> dict:
    """Node id -> its facts (a dict), or the reason it gave none (a str: the task failed or did
    not answer within `timeout_s`). The tasks run at once."""
    if not nodes:
        return {}
    runtime_env = {"env_vars": env} if env else None
    refs = {
        n.id: _facts.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n.id, soft=False), runtime_env=runtime_env
        ).remote(req)
        for n in nodes
    }
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    out: dict = {}
    for node, ref in refs.items():
        if ref not in ready:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.cancel(ref, force=True)
            out[node] = f"its check did not answer within {timeout_s:g}s"
            continue
        try:
            out[node] = ray.get(ref)
        except ray.exceptions.RayError as err:
            out[node] = f"its check could not run ({one_line(err)})"
    return out
