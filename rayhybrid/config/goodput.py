"""The settings of `python -m rayhybrid.goodput`, composed with Hydra from `conf/goodput.yaml`
like the trainer's (`compose.py`) into a frozen `GoodputConfig`.

    cfg = compose_goodput(["gpus=16384", "days=54", "failures=llama3", "strategy=all"])

`failures` is a config group whose options are the failure presets (`exponential`, `llama3`, `meta`),
kept in Hydra's config store; `failures.mtbf_hours=...` then changes a field of the chosen
one. Every mistake is a one-line `ConfigError` naming the setting: an unknown key, a value of
the wrong type, a preset or strategy that does not exist, a value out of range.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rayhybrid.config.compose import _unfreeze, compose_tool, quote_value, tool_override_error
from rayhybrid.errors import ConfigError

CONFIG_NAME = "goodput"
PRESETS = ("exponential", "llama3", "meta")


@dataclass(frozen=True)
class Strategy:
    """One option of the `strategy` setting: how a run recovers (rayhybrid/goodput/engine.py runs it)."""

    name: str
    fallback_cost: str
    """The costs.* field that is the downtime of going back to the checkpoint."""
    heal: bool = False
    """Heal failed ranks from a data-parallel peer when one holds the state (no work lost)."""
    elastic: bool = False
    """Shrink when no node replaces a failed one, grow back at a save (rayhybrid's elastic.*)."""
    spares: bool = True
    """Starts with spares.nodes spare nodes (else only repaired nodes come back)."""


STRATEGIES = {
    s.name: s
    for s in (
        Strategy("restart_all", "restart_s"),
        Strategy("replace_failed", "replace_s"),
        Strategy("peer_heal", "replace_s", heal=True),
        Strategy("elastic", "restart_s", elastic=True),
        Strategy("elastic_no_spares", "restart_s", elastic=True, spares=False),
    )
}
"""The strategies, by name: the one list that `strategy=` is checked against and the simulator runs."""


@dataclass(frozen=True)
class FailuresConfig:
    preset: str = "exponential"
    mtbf_hours: float = 3.09
    hang_share: float = 0.0


@dataclass(frozen=True)
class CostsConfig:
    detect_s: float = 30.0
    hang_detect_s: float = 300.0
    restart_s: float = 600.0
    replace_s: float = 300.0
    heal_s: float = 60.0
    save_s: float = 10.0
    step_s: float = 10.0
    checkpoint_gb: float = 0.0
    storage_gbps: float = 0.0


@dataclass(frozen=True)
class CheckpointConfig:
    interval_s: float = 0.0


@dataclass(frozen=True)
class SparesConfig:
    nodes: int = 32
    repair_hours: float = 24.0


@dataclass(frozen=True)
class ElasticConfig:
    min_dp: int = 1


@dataclass(frozen=True)
class FaultConfig:
    max_restarts: int = 1_000_000


@dataclass(frozen=True)
class GoodputConfig:
    """One simulated training run: its size, its failures, its costs and what to compare."""

    gpus: int = 16384
    days: float = 54.0
    seed: int = 0
    seeds: int = 1
    strategy: str = "all"
    gpus_per_node: int = 8
    replica_gpus: int = 128
    output_dir: str = ""
    from_run: str = ""
    failures: FailuresConfig = field(default_factory=FailuresConfig)
    costs: CostsConfig = field(default_factory=CostsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    spares: SparesConfig = field(default_factory=SparesConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)


FAILURE_PRESETS = {
    "exponential": FailuresConfig(preset="exponential"),
    "llama3": FailuresConfig(preset="llama3", mtbf_hours=0.0),
    "meta": FailuresConfig(preset="meta", mtbf_hours=0.0),
}
"""The options of the `failures` group. llama3's and meta's mtbf_hours is 0: the rates are the
published ones per GPU (rayhybrid/goodput/failures.py); a value rescales them to that job MTBF."""

SETTINGS = {
    "gpus": "GPUs of the simulated job (whole replicas of replica_gpus are used; the rest idle)",
    "days": "wall-clock days simulated",
    "seed": "seeds the failure trace (every strategy runs on the same trace)",
    "seeds": "traces simulated (seed, seed+1, ...); the figures are their means",
    "strategy": f"all, or one of {', '.join(STRATEGIES)}",
    "gpus_per_node": "GPUs of one node; a hardware failure takes one node out",
    "replica_gpus": "GPUs of one data-parallel replica (tp x pp), a multiple of gpus_per_node",
    "output_dir": "where goodput.json and goodput.png go; empty: a new outputs/goodput/<date>/<time> under the "
    "current directory",
    "from_run": "a rayhybrid run directory: costs.* from the medians of its metrics.jsonl restart, checkpoint "
    "and step records, scaled to gpus (docs/goodput.md); costs given on the command line win; and the run's "
    "measured goodput (its summary.json's) beside a simulation of the run itself",
    "failures": f"the failure preset: {', '.join(PRESETS)} (llama3: Llama 3 405B's published breakdown; meta: "
    "Meta's research clusters, 7.9 h job MTTF at 1,024 GPUs; both per GPU)",
    "failures.mtbf_hours": "exponential: the whole job's mean time between failures; llama3, meta: 0 keeps the "
    "published rates, a value rescales them to this job MTBF",
    "failures.hang_share": "exponential, meta: the share of failures that hang (found after costs.hang_detect_s)",
    "costs.detect_s": "seconds from a crash to the driver knowing it",
    "costs.hang_detect_s": "seconds from a hang to its detection (rayhybrid's fault.step_timeout_s)",
    "costs.restart_s": "downtime of restarting every rank from the checkpoint (restart_all, elastic)",
    "costs.replace_s": "downtime of replacing the failed ranks only and restoring the checkpoint",
    "costs.heal_s": "downtime of healing the failed ranks from a data-parallel peer (peer_heal)",
    "costs.save_s": "seconds a checkpoint save blocks training",
    "costs.step_s": "seconds of one optimizer step (peer_heal loses the step in progress)",
    "costs.checkpoint_gb": "from_run: the simulated model's checkpoint size in GB (restore and save scale with "
    "its bytes per rank); 0: the run's own newest committed checkpoint",
    "costs.storage_gbps": "from_run: the storage's total bandwidth in GB/s (a restore, or a synchronous save, "
    "takes at least checkpoint bytes / it); 0: unlimited",
    "checkpoint.interval_s": "seconds of work between saves; 0: each strategy's recommended interval",
    "spares.nodes": "spare nodes that replace failed ones at once (elastic_no_spares has none)",
    "spares.repair_hours": "hours until a failed node is back in the spare pool",
    "elastic.min_dp": "elastic strategies never continue with fewer replicas (rayhybrid's elastic.min_dp)",
    "fault.max_restarts": "restarts before the run gives up (rayhybrid's fault.max_restarts; "
    "high by default so that long runs are not cut off)",
}
"""One line per setting: what `--help` prints (every field of GoodputConfig is here)."""


def _defaults() -> dict[str, object]:
    out: dict[str, object] = {}
    for f in dataclasses.fields(GoodputConfig):
        if f.default is dataclasses.MISSING:  # a group of settings
            group = f.default_factory()  # type: ignore[misc]
            out.update({f"{f.name}.{g.name}": g.default for g in dataclasses.fields(group)})
        else:
            out[f.name] = f.default
    out["failures"] = "exponential"
    return out


def usage() -> str:
    """The settings, their defaults and what each does, for `--help`."""
    defaults = _defaults()
    return "\n".join(f"  {name}={defaults[name]}: {text}" for name, text in SETTINGS.items())


@functools.cache
def register_goodput_schema() -> None:
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    node = OmegaConf.structured(GoodputConfig)
    _unfreeze(node)  # frozen dataclasses become read-only nodes; Hydra must merge into them
    store.store(name="goodput_schema", node=node)
    for name, preset in FAILURE_PRESETS.items():
        option = OmegaConf.structured(preset)
        _unfreeze(option)
        store.store(group="failures", name=name, node=option)


def normalize(overrides: Sequence[str]) -> list[str]:
    """Check that every override is `key=value` of a known setting and that `failures=` names
    a preset; quote the paths for Hydra's grammar."""
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(item, "is not a setting; give key=value (python -m rayhybrid.goodput --help lists them)")
        if key not in SETTINGS:
            raise ConfigError(
                key, "is not a setting of rayhybrid.goodput; python -m rayhybrid.goodput --help lists them"
            )
        if key == "failures" and value not in PRESETS:
            raise ConfigError("failures", f"{value!r} is not a preset; choose one of {', '.join(PRESETS)}")
        if key in ("output_dir", "from_run"):  # paths: as typed (quoted for Hydra's grammar)
            item = f"{key}={quote_value(value)}"
        out.append(item)
    return out


def compose_node(overrides: Sequence[str] = ()) -> DictConfig:
    """`conf/goodput.yaml` with the command line's overrides, not yet checked."""
    register_goodput_schema()
    return compose_tool(CONFIG_NAME, "rayhybrid.goodput", normalize(overrides))


def _at_least(name: str, value: float, low: float, example: str) -> None:
    if value < low:
        raise ConfigError(name, f"is {value}; give a value of at least {low}, e.g. {name}={example}")


def check(cfg: GoodputConfig) -> None:
    """The settings' own checks, each naming the setting and the fix."""
    if cfg.strategy != "all" and cfg.strategy not in STRATEGIES:
        raise ConfigError(
            "strategy", f"{cfg.strategy!r} is not a strategy; choose all or one of {', '.join(STRATEGIES)}"
        )
    for name, low, example in (("gpus_per_node", 1, "8"), ("replica_gpus", 1, "128"), ("seeds", 1, "10")):
        _at_least(name, getattr(cfg, name), low, example)
    if cfg.replica_gpus % cfg.gpus_per_node:
        raise ConfigError(
            "replica_gpus", f"is {cfg.replica_gpus}; give a multiple of gpus_per_node={cfg.gpus_per_node} (whole nodes)"
        )
    _at_least("gpus", cfg.gpus, cfg.replica_gpus, str(cfg.replica_gpus))
    if cfg.days <= 0:
        raise ConfigError("days", f"is {cfg.days}; give a positive number of days, e.g. days=54")
    for name, value in dataclasses.asdict(cfg.costs).items():
        _at_least(f"costs.{name}", value, 0.0, "10")
    if cfg.costs.step_s <= 0:
        raise ConfigError("costs.step_s", f"is {cfg.costs.step_s}; give the seconds of one step, e.g. costs.step_s=10")
    _at_least("checkpoint.interval_s", cfg.checkpoint.interval_s, 0.0, "600")
    _at_least("failures.mtbf_hours", cfg.failures.mtbf_hours, 0.0, "3.09")
    if cfg.failures.preset == "exponential" and cfg.failures.mtbf_hours <= 0:
        raise ConfigError("failures.mtbf_hours", "is 0; exponential failures need the job's MTBF, e.g. 3.09")
    if cfg.failures.preset == "llama3" and cfg.failures.hang_share:
        raise ConfigError(
            "failures.hang_share", "applies to failures=exponential and meta only (llama3 has its own hangs); remove it"
        )
    if not 0.0 <= cfg.failures.hang_share <= 1.0:
        raise ConfigError("failures.hang_share", f"is {cfg.failures.hang_share}; give a share in [0, 1], e.g. 0.1")
    _at_least("spares.nodes", cfg.spares.nodes, 0, "32")
    _at_least("spares.repair_hours", cfg.spares.repair_hours, 0.0, "24")
    _at_least("elastic.min_dp", cfg.elastic.min_dp, 1, "1")
    _at_least("fault.max_restarts", cfg.fault.max_restarts, 0, "1000000")


def given(overrides: Sequence[str]) -> set[str]:
    """The settings the command line gives explicitly (they win over from_run's costs)."""
    return {item.partition("=")[0] for item in overrides}


def compose_goodput(overrides: Sequence[str] = ()) -> GoodputConfig:
    """Compose and check the settings of `python -m rayhybrid.goodput`; raises `ConfigError`."""
    node = compose_node(overrides)
    try:
        cfg = OmegaConf.to_object(node)
    except OmegaConfBaseException as err:
        raise tool_override_error(err, "rayhybrid.goodput") from None
    assert isinstance(cfg, GoodputConfig)
    check(cfg)
    return cfg
