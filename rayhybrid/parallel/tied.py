"""Parameters tied across pipeline stages: an output projection tied to the token embedding
(Llama 3.2 1B and 3B) when the two are on different stages.

As in Megatron, the last stage holds its own copy of the embedding (the model's
`tied_copies()`: {copy's name: the embedding's name}). Both start equal (initialised by the
embedding's name, or read from the embedding's tensor in a checkpoint or a Hugging Face model),
and every step, after the data-parallel reduction and before clipping, the two copies'
gradients are summed: on one all-reduce between the rank of the first stage and the rank of the
last stage with the same dp and tp coordinates, or in place where one rank holds both stages
(ZBV's V). Both copies then take the same optimizer step from the same state, so they stay
bitwise equal, and the sum is the gradient of the single tied tensor a one-stage model has. The
gradient norm counts the embedding once (`uncounted`).

The two gradients are summed as the parameters are sharded, not as autograd left them: under
tp, DTensor's embedding backward gives the vocab-parallel embedding a Replicate gradient (the
whole table on each tp rank) while the output's is Shard(0) like its weight. Data parallelism
(FSDP2 or replicate) reduces gradients into the parameter's placement; at dp1 nothing does, so
`sum_grads` redistributes them first (Replicate to Shard is a local slice).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rayhybrid.config.topology import Layout


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _as_param(param: torch.nn.Parameter) -> None:
    """Give a DTensor parameter's gradient the parameter's placements (collective over its
    mesh where that needs one; every rank of the mesh calls this for the same parameters)."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def tied_copies(module: torch.nn.Module) -> dict[str, str]:
    """The stage's `tied_copies()` ({a parameter's name: the one it is tied to}; {} without)."""
    copies = getattr(module, "tied_copies", None)
    return dict(copies()) if callable(copies) else {}


class TiedCopies:
    """This rank's side of the tied parameters (nothing to do when the model has none, or when
    this rank holds neither end)."""

    def __init__(self, stages: list[tuple[int, torch.nn.Module]], layout: Layout) -> None:
        """Every rank of the world calls this: the groups are made collectively, when the
        stages' `tied_copies()` name any pair (every stage of a model names the same ones)."""
        self.sources: dict[str, torch.nn.Parameter] = {}  # on the first stage, by name
        self.copies: dict[str, torch.nn.Parameter] = {}  # on the last stage, by the name they copy
        self.group: dist.ProcessGroup | None = None
        last = layout.num_stages - 1
        if last == 0 or not any(tied_copies(module) for _, module in stages):
            return
        for index, module in stages:
            params = dict(module.named_parameters())
            for name, source in tied_copies(module).items():
                if index == last and name in params:
                    self.copies[source] = params[name]
                if index == 0 and source in params:
                    self.sources[source] = params[source]
        topo = layout.topology
        first_pp, last_pp = _owner(layout, 0), _owner(layout, last)
        if first_pp == last_pp:
            return
        pairs = [
            [topo.rank(dp, first_pp, tp), topo.rank(dp, last_pp, tp)] for dp in range(topo.dp) for tp in range(topo.tp)
        ]
        # Every rank takes part in making every pair's group; each gets its own (or none).
        self.group, _ = dist.new_subgroups_by_enumeration(pairs)

    @property
    def uncounted(self) -> list[torch.nn.Parameter]:
        """The copies: clipped with the rest, not counted again in the gradient norm."""
        return list(self.copies.values())

    @torch.no_grad()
    def sum_grads(self, waiting: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
        """Sum the gradients of each tied pair (its two copies hold the sum afterwards). The
        all-reduce between the first and the last stage runs inside `waiting()` (the MFU split
        counts it as a wait, not compute: a rank blocked there on a slow peer is not slow)."""
        for param in [*self.sources.values(), *self.copies.values()]:
            _as_param(param)
        if self.sources and self.copies:  # one rank holds both ends
            for name in sorted(self.copies):
                source, copy = self.sources[name], self.copies[name]
                _local(source.grad).add_(_local(copy.grad))
                _local(copy.grad).copy_(_local(source.grad))
            return
        if self.group is None:
            return
        held = self.sources or self.copies
        with waiting():
            for name in sorted(held):
                dist.all_reduce(_local(held[name].grad), group=self.group)


def _owner(layout: Layout, stage: int) -> int:
    """The pipeline rank that holds `stage`."""
    return next(pp for pp in range(layout.topology.pp) if stage in layout.stages_of(pp))
