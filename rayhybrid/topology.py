"""Pure topology math: rank <-> (dp, pp, tp) coordinates, replicas, stage layer split.

Rank order (DESIGN invariant 1): ``rank = (dp_i * pp + pp_i) * tp + tp_i``; tp varies fastest.
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
    """Pipeline micro-batches = gradient-accumulation steps per replica (DESIGN invariant 3)."""
    per_replica, rem = divmod(global_batch_size, dp * micro_batch_size)
    if rem or per_replica == 0:
        raise ValueError(
            f"train.global_batch_size={global_batch_size} is not a multiple of "
            f"dp * train.micro_batch_size = {dp} * {micro_batch_size}"
        )
    return per_replica
