"""The check of a cluster for one config: the nodes the run will use, what each says of itself
against the driver and the topology, the bandwidth of its all-reduces (the command only), and
the problems found. Two callers:

    checked = check_cluster(cfg, shape, bandwidth=True)     # python -m rayhybrid.check
    startup_check(cfg, shape, runlog.event)                   # every run's start (cluster.check=brief)

The nodes a run starts using later get the same brief check (rayhybrid/check/join.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from rayhybrid.check.bandwidth import bandwidth_problems, measure
from rayhybrid.check.nodes import Node, ask_nodes, used_nodes, workers_env
from rayhybrid.check.probe import PACKAGES, Request, node_facts, store_package
from rayhybrid.check.problems import Problem, node_problems
from rayhybrid.cluster.placement import ReplicaShape
from rayhybrid.config.schema import Config
from rayhybrid.data.sources import KINDS
from rayhybrid.errors import ConfigError
from rayhybrid.storage.store import is_remote, one_line, redact, redact_url

log = logging.getLogger("rayhybrid")


@dataclass
class Checked:
    """What a check found: the nodes, their answers (a dict, or why none came), the driver's
    own facts, the bandwidth figures by node (empty without the test) and the problems."""

    nodes: list[Node]
    facts: dict
    driver: dict
    gpu: bool
    problems: list[Problem] = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    seconds: float = 0.0

    def record(self) -> dict:
        """The `check` event of metrics.jsonl (and --json's object): figures and problems."""
        nodes = []
        for n in self.nodes:
            facts = self.facts.get(n.id)
            entry = {"node": n.id, "ip": n.ip, **(_brief(facts) if isinstance(facts, dict) else {"error": facts})}
            nodes.append(redact({**entry, **self.figures.get(n.id, {})}))
        return {
            "event": "check",
            "seconds": round(self.seconds, 3),
            "backend": "nccl" if self.gpu else "gloo",
            "driver": {
                "python": self.driver["python"],
                "packages": self.driver["packages"],
                "code": self.driver["code"],
            },
            "nodes": nodes,
            "problems": [p.line for p in self.problems],
        }


def _brief(facts: dict) -> dict:
    return {k: facts[k] for k in ("host", "python", "packages", "code", "devices", "store", "datasets")}


def datasets(cfg: Config) -> tuple[tuple[str, str], ...]:
    """(setting, path or URL) of the data the config reads: data.path, data.val_path and each
    data.mix entry's path (none for synthetic data)."""
    d = cfg.data
    if not KINDS[d.name].reads_path:
        return ()
    found = [("data.path", d.path), ("data.val_path", d.val_path)]
    found += [(f"data.mix[{i}].path", entry.path) for i, entry in enumerate(d.mix)]
    return tuple((setting, path) for setting, path in found if path)


def request(cfg: Config, gpu: bool, store: bool) -> Request:
    """What each node checks: the packages (with the store's own), its devices, the checkpoint
    store when `store` and checkpoint.dir is set, and the datasets."""
    ck = cfg.checkpoint
    extra = store_package(ck.dir) if ck.dir else None
    packages = PACKAGES + ((extra,) if extra and extra not in PACKAGES else ())
    where = (ck.dir, dict(ck.storage_options)) if store and ck.dir else None
    return Request(packages, gpu, where, datasets(cfg), dict(cfg.data.storage_options))


def check_cluster(
    cfg: Config, shape: ReplicaShape, *, bandwidth: bool, store: bool = True, only: frozenset[str] | None = None
) -> Checked:
    """Ask every node the run will use (`used_nodes`; with `only`, those of these ids) and the
    driver; with `bandwidth`, measure the all-reduces too. No node (an autoscaler has not added
    them yet): nothing checked."""
    start = time.perf_counter()
    nodes = [n for n in used_nodes(shape) if only is None or n.id in only]
    req = request(cfg, shape.use_gpu, store)
    driver = node_facts(Request(req.packages))
    env = workers_env(shape.use_gpu, storage=req.store is not None or any(is_remote(u) for _, u in req.datasets))
    checked = Checked(nodes, ask_nodes(nodes, req, env), driver, shape.use_gpu)
    display = redact_url(cfg.checkpoint.dir)
    for n in nodes:
        checked.problems += node_problems(
            n.name, checked.facts[n.id], driver, tp=shape.tp, ray_gpus=n.gpus, gpu=shape.use_gpu, store=display
        )
    if bandwidth:
        checked.figures = measure(nodes, shape.use_gpu)
        for n in nodes:
            checked.problems += bandwidth_problems(n, checked.figures[n.id], cfg, shape.use_gpu)
    checked.seconds = time.perf_counter() - start
    return checked


def brief_check(cfg: Config, shape: ReplicaShape, record, only: frozenset[str] | None = None) -> Checked | None:
    """The per-node checks without the store (the run's own storage check refuses a node that
    cannot reach it) and without the bandwidth test, of the nodes the run will use (`only`: those
    of these ids, which it starts using later: its event says `"joined": true`); each problem a
    warning, the whole a `check` event given to `record`. None when cluster.check=off, or when
    the check could not run (one warning: the check's own failure never stops a run)."""
    if str(cfg.cluster.check).lower() == "off":
        return None
    try:
        checked = check_cluster(cfg, shape, bandwidth=False, store=False, only=only)
    except Exception as err:  # noqa: BLE001 - the check's own failure never stops a run
        where, after = ("", " unchecked") if only is None else (" on the joining node(s)", "")
        log.warning("cluster check: could not run%s (%s); the run goes on%s", where, one_line(err), after)
        return None
    for problem in checked.problems:
        log.warning("cluster check: %s", problem.line)
    record(checked.record() if only is None else {**checked.record(), "joined": True})
    log.debug("cluster check: %d node(s) in %.2fs", len(checked.nodes), checked.seconds)
    return checked


def startup_check(cfg: Config, shape: ReplicaShape, record) -> Checked | None:
    """At a run's start (cluster.check=brief): `brief_check` of every node. A node whose torch or
    rayhybrid differs from the driver's stops the run (ConfigError naming cluster.check)."""
    checked = brief_check(cfg, shape, record)
    if checked is None:
        return None
    fatal = [p for p in checked.problems if p.fatal]
    if fatal:
        raise ConfigError(
            "cluster.check",
            f"{fatal[0].line} ({len(fatal)} such problem(s): ranks on other versions run other code); "
            "or set cluster.check=off to run anyway",
        )
    return checked
