"""After a failed call: what is dead, which replica slots are broken and which nodes are lost.

Every worker that still answers leaves its process group; the ones that died, hang or do not
answer are killed. `WorkerGroup.drain` runs `drain` on its state and the tracker of its calls,
and keeps the state it returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayhybrid.cluster.calls import DRAIN_TIMEOUT_S, PING_TIMEOUT_S, Calls
from rayhybrid.cluster.placement import dead_nodes, wait_for_node_verdicts
from rayhybrid.cluster.state import GroupState

log = logging.getLogger("rayhybrid.cluster.group")

# How long the drain waits for a SIGKILL sent through a hung worker's node (a frozen node never
# runs it: `ray.kill` and the node's health checks take over).
SIGKILL_WAIT_S = 1.0


@dataclass(frozen=True)
class Drained:
    """What a failed call left: the ranks whose workers are gone (dead, hung or on a lost
    node; numbered in the world that failed) and the replica slots they belonged to."""

    dead: frozenset[int]
    broken: frozenset[int]
    nodes_lost: frozenset[str]
    """Nodes of dead workers that the cluster has declared dead."""
    found_s: float = 0.0
    """Seconds spent finding what failed, which is detection, not teardown: pinging the workers
    of a call that made no progress, and waiting for Ray's verdict on the nodes of workers that
    cannot be reached (its health checks)."""


def drain(state: GroupState, calls: Calls) -> tuple[Drained, GroupState]:
    """After a failed call: every worker that still answers leaves the process group (a
    worker whose call failed has left already, closing its connections, so the peers
    blocked on it fail too, in a cascade); the ones that died, hang, or do not answer are
    killed. Waits (bounded) until the cluster has decided about the nodes of the workers
    that do not answer: a node that lost power is declared dead only after Ray's health
    checks, and until then its placement group looks placed. Returns what it found and the
    group's state after it: the actors gone marked None, the rendezvous closed."""
    topo, workers, infos = state.layout.topology, state.workers, state.infos
    closing = close_rendezvous(state.store_host)
    start = time.perf_counter()
    hung = unresponsive(workers, calls.busy(), calls.probes) if calls.hung else set()
    found_s = time.perf_counter() - start
    alive = sigkill([infos[rank] for rank in hung])  # their connections close: blocked peers fail
    stop([workers[rank] for rank in hung])
    abort_collectives([workers[rank] for rank in calls.busy() if rank not in hung])  # saves abandoned; NCCL aborted
    dead = hung | leave(workers, skip=hung)
    stop([workers[rank] for rank in dead - hung])
    calls.settle(closing)
    # The nodes of the workers gone: one that lost power looks alive for a while yet, and
    # its placement groups placed; a worker started there again would never start.
    suspects = {infos[rank].node_id for rank in dead} - alive
    start = time.perf_counter()
    nodes_lost = wait_for_node_verdicts(suspects, state.cfg.cluster.placement_timeout_s)
    found_s += time.perf_counter() - start
    nodes_lost |= {infos[rank].node_id for rank in dead} & dead_nodes()
    replicas = {slot: list(actors) for slot, actors in state.replicas.items()}
    for rank in dead:
        replicas[state.slots[topo.coord(rank).dp]][rank % topo.replica_size] = None
    log.info(
        "kept %d worker(s), replacing %d (ranks %s)%s",
        len(workers) - len(dead),
        len(dead),
        ",".join(map(str, sorted(dead))) or "none",
        f"; {len(nodes_lost)} node(s) lost" if nodes_lost else "",
    )
    broken = frozenset(state.slots[topo.coord(rank).dp] for rank in dead)
    after = state.but(replicas={slot: tuple(actors) for slot, actors in replicas.items()}, store_host=None)
    return Drained(frozenset(dead), broken, frozenset(nodes_lost), found_s), after


def leave(workers: list, skip: set[int]) -> set[int]:
    """Every worker but those in `skip` leaves its process group after the failure (`TrainWorker.reset`,
    failed: on NCCL it aborts, and keeps its state for a heal); returns
    the ranks that died meanwhile, or did not leave within DRAIN_TIMEOUT_S, or cannot be reached."""
    resets = {rank: workers[rank].reset.remote(failed=True) for rank in range(len(workers)) if rank not in skip}
    done, _ = ray.wait(list(resets.values()), num_returns=len(resets), timeout=DRAIN_TIMEOUT_S)
    gone = set()
    for rank, ref in resets.items():
        if ref not in done:
            log.warning("rank %d did not leave the process group within %.0fs; replacing it", rank, DRAIN_TIMEOUT_S)
            gone.add(rank)
            continue
        try:
            ray.get(ref)
        except RayError:  # dead, or (ActorUnavailableError) cannot be reached and Ray does not know why yet
            gone.add(rank)
    return gone


def abort_collectives(workers: list) -> None:
    """From the control threads of `workers` (ranks still busy in the failed call;
    `TrainWorker.abort_collectives`): abandon the save in flight, so one waiting on its upload
    (rank 0, for a dead rank's results) returns at once instead of at the drain's 30 s, and
    abort the NCCL communicators, so one blocked in a collective on a dead peer raises within
    seconds instead of at NCCL's watchdog timeout (minutes); both then leave as the others do.
    The abort is a no-op on gloo, where a dead peer already raises. Waits at most
    PING_TIMEOUT_S; a worker that does not answer is dealt with by `leave`."""
    refs = [worker.abort_collectives.remote() for worker in workers if worker is not None]
    if not refs:
        return
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=PING_TIMEOUT_S)
    for ref in done:
        with contextlib.suppress(RayError):
            ray.get(ref)


def close_rendezvous(host) -> list:
    """Stop the rendezvous store of the world that failed (served by its rank 0 `host`, see
    `TrainWorker.host_store`); returns the call's ref. Ranks blocked in a join waiting there
    for a rank that is gone fail at once, instead of after JOIN_TIMEOUT_S (and gloo's retries
    on top): in torch 2.13 a process group forms by each rank waiting in the store for every
    other rank's address. The world is joined again anyway, with a new store."""
    return [host.close_store.remote()] if host is not None else []


def pinger(workers: list):
    """`probe` for `Calls.get`: ranks -> a ping sent to each of `workers` of those ranks."""
    return lambda ranks: {rank: workers[rank].ping.remote() for rank in ranks}


def unresponsive(workers: list, busy: list[int], sent: dict | None = None) -> set[int]:
    """Ranks of `busy` whose process does not answer a ping within PING_TIMEOUT_S (stopped,
    wedged, holding the GIL). `sent`: rank -> (ping ref, when sent) of pings sent already
    (`Calls.probes`, ahead of a step's timeout), whose wait has run that long already."""
    sent, now = sent or {}, time.perf_counter()
    pings = {rank: sent[rank][0] if rank in sent else workers[rank].ping.remote() for rank in busy}
    asked = now if any(rank not in sent for rank in busy) else min((sent[rank][1] for rank in busy), default=now)
    wait_s = max(0.0, PING_TIMEOUT_S - (now - asked))
    done, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=wait_s)
    silent = set()
    for rank, ref in pings.items():
        try:
            if ref not in done:
                raise TimeoutError
            ray.get(ref)
        except (RayError, TimeoutError):
            silent.add(rank)
    return silent


def stop(actors: list) -> None:
    """Kill `actors` (None: none there)."""
    for actor in actors:
        if actor is not None:
            ray.kill(actor, no_restart=True)


def sigkill(infos: list) -> set[str]:
    """SIGKILL the processes of hung workers at once, each on its own node: `ray.kill` first asks
    a worker to exit and waits about 5 s before it kills one that does not answer (a stopped
    process never does), and until the process is gone its peers stay blocked on it. A worker
    on the driver's node is signalled directly, one elsewhere by a task pinned to its node.
    Best effort: a node that cannot run the task leaves the worker to `ray.kill`. Returns the
    nodes known alive: the driver's, and those that ran the task (no verdict to wait for)."""
    here = ray.get_runtime_context().get_node_id()
    remote = {}
    for info in infos:
        if info.node_id == here:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(info.pid, signal.SIGKILL)
        else:
            strategy = NodeAffinitySchedulingStrategy(node_id=info.node_id, soft=False)
            remote[_sigkill.options(scheduling_strategy=strategy).remote(info.pid)] = info.node_id
    alive = {here}
    if remote:
        done, _ = ray.wait(list(remote), num_returns=len(remote), timeout=SIGKILL_WAIT_S)
        for ref in done:
            with contextlib.suppress(RayError):
                ray.get(ref)
                alive.add(remote[ref])
    return alive


@ray.remote(num_cpus=0, max_retries=0)
def _sigkill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
