"""Pure topology math: rank <-> (dp, pp, tp) coordinates, replicas, stage layer split.

Rank order (docs/design.md, invariant 1): ``rank = (dp_i * pp + pp_i) * tp + tp_i``; tp varies fastest.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Coord:
    dp: int
    pp: int
    tp: int

    def __str__(self) -> str:
        return f"dp{self.dp}|pp{self.pp}|tp{self.tp}"


@dataclass(frozen=True)
class Topology:
    dp: int
    pp: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def replica_size(self) -> int:
        return self.pp * self.tp

    def rank(self, dp: int, pp: int, tp: int) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside world of {self.world_size}")
        tp = rank % self.tp
        pp = (rank // self.tp) % self.pp
        return Coord(dp=rank // (self.tp * self.pp), pp=pp, tp=tp)

    def replica_ranks(self, dp: int) -> list[int]:
        """The pp*tp ranks of data-parallel replica `dp`, stage by stage."""
        return [self.rank(dp, p, t) for p in range(self.pp) for t in range(self.tp)]

    def __str__(self) -> str:
        return f"dp{self.dp}_pp{self.pp}_tp{self.tp}"


def shard_group_size(dp_shard: bool | int, dp: int) -> int:
    """The data-parallel ranks that shard each parameter, gradient and optimizer state
    (`topology.dp_shard`): 1 for false or 1 (replicated), dp for true (FSDP2 over all of dp),
    N for an integer 1 < N < dp (HSDP: groups of N consecutive dp ranks, each group holding
    every shard, replicated across the dp / N groups). A validated config's N divides dp; here
    N is only bounded to [1, dp] (an elastic run's dp is always a multiple of N)."""
    if dp_shard is True:
        return dp
    if dp_shard is False:
        return 1
    return max(1, min(int(dp_shard), dp))


def describe_data_parallel(dp: int, shard_group: int) -> str:
    """How data parallelism runs, in words: "replicated dp", "FSDP2" (over all of dp) or
    "HSDP (2 replicas x 4 shards)" (dp 8 in shard groups of 4)."""
    if shard_group <= 1:
        return "replicated dp"
    if shard_group >= dp:
        return "FSDP2"
    return f"HSDP ({dp // shard_group} replicas x {shard_group} shards)"


def groups_across_nodes(placement: list[dict], shard_group: int) -> list[list[int]]:
    """HSDP: the shard groups that span nodes, each as its ranks. `placement`: one row per
    rank with its "rank", "dp", "pp", "tp" and "node_id" (`GroupState.placement`). A shard
    group is the `shard_group` ranks of the same pp and tp coordinates whose dp ranks are
    consecutive from a multiple of `shard_group` (rank order, docs/design.md invariant 1)."""
    groups: dict[tuple[int, int, int], list[dict]] = {}
    for row in placement:
        groups.setdefault((row["dp"] // shard_group, row["pp"], row["tp"]), []).append(row)
    return [sorted(r["rank"] for r in rows) for rows in groups.values() if len({r["node_id"] for r in rows}) > 1]


def dp_multiple(dp_shard: bool | int) -> int:
    """What dp must be a multiple of under `dp_shard`: N for an integer N > 1 (whole shard
    groups; an elastic run grows and shrinks by groups), else 1 (true shards over any dp)."""
    if isinstance(dp_shard, bool):
        return 1
    return max(1, int(dp_shard))


def split_layers(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous layer ranges for `n_stages` pipeline stages; earlier stages take the remainder.

    >>> split_layers(5, 2)
    [range(0, 3), range(3, 5)]
    """
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, style: str = "loop") -> list[int]:
    """Global stage indices owned by pipeline rank `pp_rank`.

    `loop` (interleaved schedules): stages pp_rank, pp_rank + pp, ...;
    `v` (ZBV): pp_rank and 2*pp - 1 - pp_rank, so the first and last stage share rank 0.
    """
    if style == "v":
        assert stages_per_rank == 2, "V-shaped schedules place exactly two stages per rank"
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def num_microbatches(global_batch_size: int, dp: int, micro_batch_size: int) -> int:
    """Pipeline micro-batches = gradient-accumulation steps per replica (docs/design.md, invariant 3)."""
    per_replica, rem = divmod(global_batch_size, dp * micro_batch_size)
    if rem or per_replica == 0:
        raise ValueError(
            f"train.global_batch_size={global_batch_size} is not a multiple of "
            f"dp * train.micro_batch_size = {dp} * {micro_batch_size}"
        )
    return per_replica


@dataclass(frozen=True)
class Schedule:
    """What the layout needs to know of a pipeline schedule (`topology.schedule`)."""

    stages_per_rank: int | None
    """The stages each pipeline rank holds: exactly this many, or None for any number."""
    v_shaped: bool = False
    """A rank's two stages sit in a V (the first and the last stage on rank 0)."""
    zero_bubble: bool = False
    """The backward pass is split into input and weight gradients (zero-bubble schedules)."""

    @property
    def default_stages_per_rank(self) -> int:
        """The stages per rank a search tries first: the fixed number, else 2."""
        return self.stages_per_rank or 2


SCHEDULE_TABLE: dict[str, Schedule] = {
    "gpipe": Schedule(stages_per_rank=1),
    "1f1b": Schedule(stages_per_rank=1),
    "interleaved_1f1b": Schedule(stages_per_rank=None),
    "interleaved_zb": Schedule(stages_per_rank=None, zero_bubble=True),
    "zbv": Schedule(stages_per_rank=2, v_shaped=True, zero_bubble=True),
}
"""The one table of the schedules rayhybrid runs (torch.distributed.pipelining's)."""


def bubble_fraction(schedule: str, pp: int, m: int, v: int = 1) -> tuple[float, str]:
    """Theoretical idle fraction of a pipeline step, assuming equal stage times; (value, formula).
    The planner's estimate (plan/estimate.py) and the MFU split's ideal bubble (trainer/split.py)."""
    if pp == 1:
        return 0.0, "no pipeline"
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / (m + pp - 1), "(pp-1)/(m+pp-1)"
    if schedule == "interleaved_1f1b":
        return (pp - 1) / (v * m + pp - 1), "(pp-1)/(v*m+pp-1), v stages per rank (Narayanan et al. 2021)"
    if schedule == "interleaved_zb":
        # ZB-H1 (Qi et al. 2024): splitting backward into B (inputs) and W (weights) and
        # filling the cool-down with W leaves (pp-1)(T_F + T_B - T_W) idle, a third of 1F1B's
        # (pp-1)(T_F + T_B + T_W) when T_F = T_B = T_W; interleaving v stages per rank divides it by v.
        return (pp - 1) / (3 * v * m + pp - 1), "(pp-1)/(3*v*m+pp-1): ZB-H1 with T_F=T_B=T_W, interleaved v-way"
    if schedule == "zbv":
        # ZB-V (Qi et al. 2024) has no bubble when T_F = T_B = T_W and m >= 2pp-1; torch pads
        # the schedule to 2pp-1 micro-batches, so fewer leave their slots idle.
        if m >= 2 * pp - 1:
            return 0.0, "0: ZB-V with T_F=T_B=T_W and m >= 2pp-1"
        n = 2 * pp - 1
        return (n - m) / n, "(2pp-1-m)/(2pp-1): ZB-V padded to 2pp-1 micro-batches"
    raise ValueError(schedule)


def stage_style(schedule: str) -> str:
    """How stages are assigned to pipeline ranks: `v` for V-shaped schedules, else `loop`."""
    return "v" if SCHEDULE_TABLE[schedule].v_shaped else "loop"


@dataclass(frozen=True)
class Layout:
    """What a config's topology and batch imply, computed here and asked for everywhere else.

    layout = Layout.of(cfg)
    layout.world_size, layout.num_microbatches, layout.stages_of(pp_rank), layout.stage_layers
    """

    dp: int
    pp: int
    tp: int
    schedule: str
    stages_per_rank: int
    n_layers: int
    global_batch_size: int
    micro_batch_size: int

    @classmethod
    def of(cls, cfg) -> Layout:
        """From a `rayhybrid.config.schema.Config` (its topology, model and train sections)."""
        t, tr = cfg.topology, cfg.train
        return cls(
            t.dp,
            t.pp,
            t.tp,
            t.schedule,
            t.stages_per_rank,
            cfg.model.n_layers,
            tr.global_batch_size,
            tr.micro_batch_size,
        )

    @property
    def topology(self) -> Topology:
        return Topology(self.dp, self.pp, self.tp)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def replica_batch_size(self) -> int:
        """Samples each data-parallel replica reads per step."""
        return self.global_batch_size // self.dp

    @property
    def num_microbatches(self) -> int:
        """Pipeline micro-batches = gradient-accumulation steps per replica (docs/design.md,
        invariant 3); a validated config divides exactly."""
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages per pipeline rank (1 without a pipeline)."""
        return self.stages_per_rank if self.pp > 1 else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def stage_layers(self) -> list[range]:
        """The layers of each pipeline stage, in stage order."""
        return split_layers(self.n_layers, self.num_stages)

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank `pp_rank` owns, as the trainer builds them."""
        if self.pp == 1:
            return [0]
        return stage_ids(pp_rank, self.pp, self.stages_per_rank, stage_style(self.schedule))

    def summary(self) -> dict:
        """The topology as summary.json and the step records report it."""
        return {
            "dp": self.dp,
            "pp": self.pp,
            "tp": self.tp,
            "world_size": self.world_size,
            "num_microbatches": self.num_microbatches,
        }
