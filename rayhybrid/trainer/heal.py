"""Peer healing (`fault.heal`): a rank's state kept in memory across a failure, and sent over the
new process group to the ranks of other replicas that lost theirs (no Ray here).

    kept = keep(trainer)                 # on a failure, before the trainer and its groups go
    kept.shape == shape_of(new_trainer)  # the same shards: same pp and tp coordinates and sizes
    restore(new_trainer, kept)           # a rank that kept the step the run heals to
    send(new_trainer, [3, 7])            # ...and gives it to the ranks that did not
    receive(new_trainer, src=1)          # a replacement, or a survivor a step behind
    step_record(new_trainer, kept.record)  # this rank's results of the step it now holds

What a rank holds is its local shards (`DTensor.to_local()`) of the model and optimizer state,
its RNG state, the step and the samples consumed (which fix the data position: sample i is a
function of the data, the seed and i). With the same pipeline and tensor-parallel coordinates,
a rank of another data-parallel replica holds the same shards, whatever dp is. With HSDP
(`topology.dp_shard=N`, 1 < N < dp) a parameter is sharded over a group of N dp ranks, and
the rank with the same shard coordinate (dp % N) in another group holds the same shards; with
FSDP over all of dp (`topology.dp_shard=true`) no rank holds another's, and heal is off. The tensors go rank to rank with
`torch.distributed` point-to-point sends on the run's all-ranks group, in the order of their
names, which both sides list from the same model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rayhybrid.data.streams import replica_shard, trace_rows
from rayhybrid.faults import pause
from rayhybrid.trainer.checkpoint import apply, state_dict
from rayhybrid.trainer.results import StepResult


def heal_enabled(cfg) -> bool:
    """Whether this layout votes before each optimizer step and keeps its state on a failure:
    fault.heal, with a second copy of every shard (two replica groups or more: dp >= 2
    replicated, dp / N >= 2 with HSDP; never with FSDP over all of dp)."""
    t = cfg.topology
    return bool(cfg.fault.heal) and t.dp // t.shard_group >= 2


class VoteFailed(RuntimeError):
    """The commit vote's sum is not the world size: a rank did not finish the step."""


def commit_vote(group, device: torch.device, step: int) -> None:
    """The commit vote of `step` (`Trainer.commit_vote`): one all-reduce of a 1 from every rank
    of `group` (all ranks), read on the host; raises `VoteFailed` unless the sum is the world
    size, and the rank then does not step.

    Why a rank that passes knows that every rank has the step's gradients, on NCCL too: a
    rank's collectives run in the order it issued them, on its stream, so its vote starts only
    once its gradient all-reduce, clipping norm and loss have completed there; and an all-reduce
    completes on any rank only once every rank has started it. A sum equal to the world size,
    read on the host, thus says that every rank finished its collectives of the step. A rank
    that steps never holds a step that a live peer could not have taken; when a rank dies after
    voting, the ranks that passed hold the next step and heal the others. The host must read
    it: NCCL returns from an unread all-reduce once it is queued, and a vote whose peer died ends
    with a smaller sum once its communicator is aborted (by the watchdog, or the drain's
    `abort_collectives`: rayhybrid/parallel/abort.py), without raising; gloo's raises. Its cost:
    one small all-reduce and one host sync (`Trainer.global_loss` syncs already)."""
    if pause.ARMED:
        pause.at("vote")
    votes = torch.ones(1, device=device)
    dist.all_reduce(votes, group=group)
    counted, world = int(votes.item()), dist.get_world_size(group)
    if counted != world:
        raise VoteFailed(f"commit vote of step {step}: {counted} of {world} ranks voted; not stepping")


def shape_of(trainer) -> tuple:
    """What a rank's shards are: its pp and tp coordinates, its shard coordinate within its dp
    shard group and that group's size (0 and 1 when replicated), the pp and tp sizes and its
    stages."""
    t, c = trainer.cfg.topology, trainer.coord
    n = t.shard_group
    return (c.pp, c.tp, c.dp % n, n, t.pp, t.tp, tuple(i for i, _ in trainer.stages))


@dataclass
class Kept:
    """A rank's state at the end of step `step`, outliving its trainer and process groups."""

    step: int
    consumed_samples: int
    val_loss: tuple[int, float] | None
    shape: tuple
    tensors: dict[str, torch.Tensor]
    """"model/<name>", "optim/<name>" (local shards, on the CPU) and "rng"."""
    record: StepResult | None
    """This rank's result of step `step`, as `train_step` returned it (the driver may not have
    had it: see `step_record`); None when it has none of that step."""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def keep(trainer) -> Kept:
    """The trainer's state, detached from its meshes and groups. On a GPU the shards are copied
    to host memory, so the new trainer's own fit beside them; on the CPU they are the tensors
    themselves, which the trainer no longer needs."""
    tensors = {key: _host(t) for key, t in _local_tensors(trainer).items()}
    tensors["rng"] = torch.get_rng_state()
    return Kept(
        trainer.step,
        trainer.consumed_samples,
        trainer.evaluation.val_loss,
        shape_of(trainer),
        tensors,
        _step_record(trainer),
    )


def state_digest(trainer) -> str:
    """A digest of the rank's local shards of the model and optimizer state, and its RNG state:
    equal on two ranks (or runs) exactly when those are bitwise equal."""
    digest = hashlib.sha256()
    for key, tensor in sorted(_local_tensors(trainer).items()):
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    digest.update(torch.get_rng_state().numpy().tobytes())
    return digest.hexdigest()


def _step_record(trainer) -> StepResult | None:
    """The last step's result, as this rank's `train_step` returned it, if it is this state's:
    when a rank dies after the commit vote, the others step, but the driver never has that
    step's results (`step_record` gives them after the heal)."""
    last = trainer.last_result
    return last if last is not None and last.metrics["step"] == trainer.step else None


def step_record(trainer, record: StepResult | None) -> StepResult:
    """This rank's record of the step it holds after a heal, for the driver's one merge of a
    step's results (rayhybrid/cluster/merge.py): `record`, the one it kept of that step, or
    else what follows from its position (the samples it read, and with data.trace where they
    came from: sample i is a function of the data, the seed and i), with no figures."""
    if record is not None and record.metrics["step"] == trainer.step:
        return record
    t, global_batch = trainer.cfg.topology, trainer.cfg.train.global_batch_size
    metrics = {"step": trainer.step, "consumed_samples": trainer.consumed_samples, "samples_read": None}
    if trainer.has_first or trainer.has_last:
        shard = replica_shard(trainer.consumed_samples - global_batch, global_batch, t.dp, trainer.coord.dp)
        metrics["samples_read"] = [shard.start, shard.count]
        if trainer.cfg.data.trace:
            metrics["data_read"] = trace_rows(trainer.stream, trainer.step, shard)
    return StepResult(metrics)


def restore(trainer, kept: Kept) -> None:
    """Set `trainer` (built anew, with the same shards) to the kept state."""
    trainer.settled = False
    state, keys = state_dict(trainer)
    for key, local in _locals_of(state).items():
        local.copy_(kept.tensors[key])
    state["extra"]["rng"] = kept.tensors["rng"]
    apply(trainer, state, keys)
    _set_position(trainer, kept.step, kept.consumed_samples, kept.val_loss)


def send(trainer, receivers: list[int]) -> int:
    """Send this rank's state (restored, or trained) to each of `receivers` (ranks of the new
    world with this rank's pp and tp); returns the bytes sent."""
    group, device = trainer.world_group, trainer.device
    tensors = [t.to(device).contiguous() for t in _payload(trainer, _local_tensors(trainer))]
    sent = 0
    for dst in receivers:
        works = [dist.isend(t, dst=dst, group=group, tag=i) for i, t in enumerate(tensors)]
        for work in works:
            work.wait()
        sent += sum(t.nbytes for t in tensors)
    return sent


def receive(trainer, src: int) -> int:
    """Receive the state `send` sends from rank `src` into this rank's trainer; returns the
    bytes received. The shards arrive in the trainer's own tensors, so the rank never holds a
    second copy of its model and optimizer state; only a tensor that cannot be filled in place
    (not on the device, or not contiguous: the optimizer's step counts) and the RNG and
    position pass through a buffer of their own size."""
    trainer.settled = False
    group, device = trainer.world_group, trainer.device
    state, keys = state_dict(trainer)
    targets = _payload(trainer, _locals_of(state))
    direct = [t.device == device and t.is_contiguous() for t in targets[:-2]] + [False, False]
    into = [t if ok else torch.empty(t.shape, dtype=t.dtype, device=device) for t, ok in zip(targets, direct)]
    works = [dist.irecv(b, src=src, group=group, tag=i) for i, b in enumerate(into)]
    for work in works:
        work.wait()
    for target, got, ok in zip(targets[:-2], into, direct):
        if not ok:
            target.copy_(got)
    state["extra"]["rng"] = into[-2].cpu()
    step, consumed, has_val, val_step, val_bits = into[-1].cpu().tolist()
    val_loss = (val_step, _float_of(val_bits)) if has_val else None
    apply(trainer, state, keys)
    _set_position(trainer, step, consumed, val_loss)
    return sum(b.nbytes for b in into)


def _payload(trainer, locals_: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """What `send` sends and `receive` fills, in one order: the shards by name, the RNG, the
    position."""
    return [*(locals_[key] for key in sorted(locals_)), torch.get_rng_state(), _position(trainer)]


def _position(trainer) -> torch.Tensor:
    """step, samples consumed and the latest held-out loss (its step and float64 bits)."""
    val = trainer.evaluation.val_loss
    bits = torch.tensor([val[1]], dtype=torch.float64).view(torch.int64).item() if val else 0
    return torch.tensor(
        [trainer.step, trainer.consumed_samples, int(val is not None), val[0] if val else 0, bits], dtype=torch.int64
    )


def _float_of(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int64).view(torch.float64).item()


def _set_position(trainer, step: int, consumed: int, val_loss) -> None:
    trainer.step, trainer.consumed_samples = int(step), int(consumed)
    trainer.evaluation.val_loss = val_loss
    trainer.settled = True


def _local_tensors(trainer) -> dict[str, torch.Tensor]:
    state, _ = state_dict(trainer)
    return _locals_of(state)


def _locals_of(state: dict) -> dict[str, torch.Tensor]:
    """ "model/<name>" and "optim/<name>" -> the local shard of each tensor in `state`."""
    out = {}
    for section in ("model", "optim"):
        for name, value in state[section].items():
            if isinstance(value, torch.Tensor):
                out[f"{section}/{name}"] = value.to_local() if isinstance(value, DTensor) else value
    return out


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True) if t.device.type != "cpu" else t.detach()
