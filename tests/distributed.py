"""Run a function on `world` gloo ranks on CPU, each in its own spawned process.

    results = run_ranks(fn, world, *args)   # [fn(0, *args), fn(1, *args), ...]

`fn` must be a picklable top-level function. Every rank initialises the default process group
with `rayhybrid.parallel.mesh.init_process_group`, calls `fn(rank, *args)` and sends back its
return value. A rank that raises sends back its traceback; the parent then terminates the
other ranks (which would otherwise wait in a collective) and raises `RankError` with it. A run
that outlives `timeout` is terminated the same way, so a broken rank never hangs the test run.

The rank workers the tests use (`train_many`, `grads_many`, ...) live here too, so they pickle by
reference to this module whatever import mode pytest uses for the test files.
"""

from __future__ import annotations

import dataclasses
import gc
import pickle
import queue as queue_mod
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 240.0


class RankError(RuntimeError):
    """A rank raised, died or did not finish in time."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank: int, world: int, port: int, args: tuple, out) -> None:
    import torch.distributed as dist

    from rayhybrid.parallel.mesh import init_process_group

    try:
        torch.set_num_threads(1)
        init_process_group(
            rank=rank,
            world_size=world,
            master_addr="127.0.0.1",
            master_port=port,
            device=torch.device("cpu"),
            timeout_s=DEFAULT_TIMEOUT_S,
        )
        result = fn(rank, *args)
        # Plain pickle copies tensor data into the bytes: nothing depends on shared memory
        # that would vanish with this process.
        payload = pickle.dumps(result)
    except BaseException:  # noqa: BLE001 - reported to the parent, whatever it is
        out.put((rank, False, f"rank {rank} failed:\n{traceback.format_exc()}"))
        return  # do not wait on peers in destroy_process_group; the parent ends them
    out.put((rank, True, payload))
    dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = DEFAULT_TIMEOUT_S) -> list:
    """`[fn(rank, *args) for rank in range(world)]`, each rank in its own process. A world
    whose free port was taken by another process before rank 0's store bound it (EADDRINUSE,
    seen twice in a full run beside other Ray jobs) starts again on another port: nothing of
    `fn` ran yet."""
    for attempt in range(3):
        try:
            return _run_ranks(fn, world, *args, timeout=timeout)
        except RankError as err:
            if "EADDRINUSE" not in str(err) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_ranks(fn, world: int, *args, timeout: float) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, args, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    problem = ""
    deadline = time.monotonic() + timeout
    quiet_since: float | None = None  # when ranks were first seen dead without a result
    try:
        while len(results) < world and not errors and not problem:
            try:
                rank, ok, payload = out.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                if time.monotonic() > deadline:
                    problem = f"ranks {sorted(set(range(world)) - set(results))} did not finish within {timeout:.0f} s"
                elif dead:
                    # A rank that exited cleanly may have its result still in the pipe.
                    quiet_since = quiet_since or time.monotonic()
                    if time.monotonic() - quiet_since > 3:
                        problem = "ranks exited without a result"
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
        if errors or problem:
            # A failing rank usually makes its peers fail too (connection reset): collect
            # their reports for a moment, so that the first cause is among them.
            grace = time.monotonic() + 2
            while time.monotonic() < grace:
                try:
                    rank, ok, payload = out.get(timeout=0.2)
                except queue_mod.Empty:
                    continue
                if not ok:
                    errors[rank] = payload
    finally:
        if errors or problem:
            _stop(procs)
        else:
            for p in procs:
                p.join(timeout=30)
            _stop(procs)
        out.close()
        out.join_thread()
    if errors or problem:
        silent = {r: p.exitcode for r, p in enumerate(procs) if r not in results and r not in errors}
        head = problem or f"{len(errors)} of {world} ranks failed"
        lines = [f"{head}; ranks without a report (exit codes): {silent}"]
        lines += [errors[r] for r in sorted(errors)]
        raise RankError("\n".join(lines))
    return [results[r] for r in range(world)]


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


# --------------------------------------------------------------------------------------------
# Rank workers used by the tests.


def world_size(cfg) -> int:
    t = cfg.topology
    return t.dp * t.pp * t.tp


def run_configs(fn, cfgs: dict, *args, timeout: float = DEFAULT_TIMEOUT_S) -> list[dict]:
    """Run `fn(rank, cfgs, *args)` on the world size all the labelled configs share; one
    result per rank."""
    (world,) = {world_size(cfg) for cfg in cfgs.values()}
    return run_ranks(fn, world, cfgs, *args, timeout=timeout)


def steady_peak_mb(steps: list[dict], last: int = 3) -> float:
    """A rank's memory peak from its `train_step()` metrics: each step's highest phase peak, the
    lowest of the last `last` steps (which run the same tensors). gloo's worker threads drop
    their reference to a finished collective's buffers a moment after `wait()` returns; on a
    busy 2-core machine that can be after the next operator has allocated, so one step in
    several reads the buffers of a few of DTensor's all-reduces still live (seen: tp2 +0.375 MB,
    a micro-batch's gathered logits and their shard; +192 KiB, six bfloat16 block outputs).
    The lowest of three steps has not been seen disturbed."""
    return min(max(step["peak_mb"].values()) for step in steps[-last:])


def settled() -> None:
    """Give gloo's worker threads a moment to drop finished collectives' buffers (see
    `steady_peak_mb`) before reading what a forward left live."""
    time.sleep(0.05)


def first_step(rank: int, cfgs: dict) -> dict[str, dict]:
    """For each labelled config (one stage, no pipeline): the first step's loss as the trainer
    reports it, beside the untrained model's logits for that step's whole batch and its
    targets, so the test can compute the loss directly."""
    from rayhybrid.trainer.loop import Trainer

    out = {}
    for label, cfg in cfgs.items():
        tr = Trainer(cfg, rank=rank, device=torch.device("cpu"))
        ((_, model),) = tr.stages
        inputs, targets = tr.stream.batch(0, cfg.train.global_batch_size)
        with torch.no_grad():
            logits = model(inputs)
        out[label] = {"loss": tr.train_step().metrics["loss"], "logits": logits, "targets": targets}
        del tr
    return out


def train_many(rank: int, cfgs: dict, steps: int) -> dict[str, list[dict]]:
    """For each labelled config in turn: a fresh `Trainer`, `steps` calls of `train_step()`;
    {label: every step's metrics}. All configs need the same world size. Running several
    configs in one set of processes saves the start-up (spawn, imports, rendezvous), which
    dominates on a small CPU machine."""
    from rayhybrid.trainer.loop import Trainer

    out = {}
    for label, cfg in cfgs.items():
        try:
            tr = Trainer(cfg, rank=rank, device=torch.device("cpu"))
            out[label] = [dict(tr.train_step().metrics) for _ in range(steps)]
        except Exception as exc:
            raise RuntimeError(f"config {label!r} failed on rank {rank}") from exc
        del tr
    return out


def local_shards(rank: int, cfg, steps: int) -> dict:
    """After `steps` steps of `cfg` (one stage): the data-parallel mesh's shape and dimension
    names, and each parameter's placements and local shard (a copy)."""
    from torch.distributed.tensor import DTensor

    from rayhybrid.trainer.loop import Trainer

    tr = Trainer(cfg, rank=rank, device=torch.device("cpu"))
    for _ in range(steps):
        tr.train_step()
    out = {"params": {}}
    for name, p in tr.named_parameters():
        assert isinstance(p, DTensor), name
        out["mesh"] = (tuple(p.device_mesh.shape), p.device_mesh.mesh_dim_names)
        out["params"][name] = ([str(x) for x in p.placements], p.to_local().detach().clone())
    del tr
    return out


def grads_many(rank: int, cfgs: dict) -> dict[str, dict]:
    """For each labelled config: a fresh `Trainer`, one `forward_backward()`; {label: {"names":
    every parameter name this rank holds, "grads": {name: full gradient}}}."""
    from torch.distributed.tensor import DTensor

    from rayhybrid.trainer.loop import Trainer

    out = {}
    for label, cfg in cfgs.items():
        try:
            tr = Trainer(cfg, rank=rank, device=torch.device("cpu"))
            tr.forward_backward()
            names, grads = [], {}
            # Same parameter order on every rank of a stage, so DTensor collectives line up.
            for name, p in tr.named_parameters():
                names.append(name)
                g = p.grad
                if g is None:
                    continue
                if isinstance(g, DTensor):
                    g = g.full_tensor()
                grads[name] = g.detach().clone().float()
            out[label] = {"names": names, "grads": grads}
        except Exception as exc:
            raise RuntimeError(f"config {label!r} failed on rank {rank}") from exc
        del tr
    return out


def backend_and_sum(rank: int) -> tuple[str, float]:
    """The default group's backend and an all-reduced sum of rank + 1."""
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return dist.get_backend(), float(t)


def fail_on_rank(rank: int, bad: int, how: str = "raise") -> None:
    """Rank `bad` fails (raises, or dies without a word) while the others wait in a collective."""
    import os

    import torch.distributed as dist

    if rank == bad:
        if how == "exit":
            os._exit(3)
        raise ValueError(f"rank {rank} breaks on purpose")
    dist.all_reduce(torch.ones(1))


def replace_topology(cfg, **topology):
    return dataclasses.replace(cfg, topology=dataclasses.replace(cfg.topology, **topology))


def checkpoint_then_continue(rank: int, cfg, root: str, before: int, after: int) -> dict:
    """Train `before` steps, save a checkpoint into `root`, train `after` more; the losses."""
    from rayhybrid.trainer.loop import Trainer

    tr = Trainer(cfg, rank=rank, device=torch.device("cpu"))
    first = [tr.train_step().metrics["loss"] for _ in range(before)]
    saved = tr.save_checkpoint(root, keep=2)  # uploads while the next steps train
    results = [tr.train_step() for _ in range(after)]
    # An upload that ended during a step is reported with that step's result, else by the wait.
    reported = [s for r in results for s in r.saves] + tr.finished_checkpoints(wait=True)
    (done,) = reported if saved.pending else [saved, *reported]  # once: async, or already committed
    assert done.error is None, done
    rest = [r.metrics["loss"] for r in results]
    return {"before": first, "after": rest, "path": saved.path, "saved": saved, "done": done}


def resume_many(rank: int, cfgs: dict, root: str, steps: int) -> dict[str, dict]:
    """For each labelled config: a fresh `Trainer` restored from the newest checkpoint in
    `root` (whatever topology wrote it), then `steps` steps; {label: {"start", "restored" (the
    RestoreResult), "losses", "consumed"}}."""
    from rayhybrid.storage import checkpoints as checkpoint_store
    from rayhybrid.trainer.loop import Trainer

    ckpt = checkpoint_store.latest(root)
    out = {}
    for label, cfg in cfgs.items():
        try:
            tr = Trainer(cfg, rank=rank, device=torch.device("cpu"))
            restored = tr.load_checkpoint(str(ckpt.path), ckpt.meta)
            start = tr.step
            metrics = [tr.train_step().metrics for _ in range(steps)]
            out[label] = {
                "start": start,
                "restored": restored,
                "losses": [m["loss"] for m in metrics],
                "consumed": [m["consumed_samples"] for m in metrics],
            }
        except Exception as exc:
            raise RuntimeError(f"config {label!r} failed on rank {rank}") from exc
        del tr
    return out


def forward_memory(rank: int, cfgs: dict) -> dict[str, dict]:
    """For each labelled config (metrics.memory on): two training steps (so optimizer state
    exists), then one forward of the whole replica batch as one micro-batch, measured by the
    trainer's memory meter; {label: {"live_before", "live_after", "categories" (bytes at the
    end of the forward), "losses" (of the two steps)}}."""
    from rayhybrid.trainer.loop import Trainer
    from rayhybrid.trainer.memory_meter import _by_category

    out = {}
    for label, cfg in cfgs.items():
        tr = Trainer(cfg, rank=rank, device=torch.device("cpu"))
        losses = [tr.train_step().metrics["loss"] for _ in range(2)]
        ((_, model),) = tr.stages
        x, y = tr.stream.batch(0, cfg.train.micro_batch_size)
        tracker = tr.memory.tracker
        with tr.memory.step():
            tr.memory.phase(0, "forward")
            before = tracker.live_bytes()
            loss = tr.loss_fn(model(x), y)
            settled()
            after = tracker.live_bytes()
            categories = _by_category(tracker._curr_mem_snap)
            loss.backward()
        out[label] = {"live_before": before, "live_after": after, "categories": categories, "losses": losses}
        del tr, loss
    return out


# --------------------------------------------------------------------------------------------
# Long-lived worker processes that join several worlds one after another, as Ray actors do
# when recovery keeps the survivors and an elastic resize renumbers them.


def run_worlds(cfgs: list, ranks: list[dict[int, int]], num_procs: int, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """Process p joins world i as rank `ranks[i][p]` (when it is in that world) with config
    `cfgs[i]`, trains one step through `TrainWorker` and leaves; returns {p: [loss per world it
    joined]}, or raises `RankError` with the first failure."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = [free_port() for _ in cfgs]
    procs = [
        ctx.Process(target=_worlds_child, args=(p, cfgs, ranks, ports, out), daemon=True) for p in range(num_procs)
    ]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < num_procs:
            try:
                proc, ok, payload = out.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_mod.Empty:
                raise RankError(f"processes {sorted(set(range(num_procs)) - set(results))} did not finish") from None
            if not ok:
                raise RankError(f"process {proc}: {payload}")
            results[proc] = payload
    finally:
        _stop(procs)
    return results


def _worlds_child(proc: int, cfgs: list, ranks: list[dict[int, int]], ports: list[int], out) -> None:
    try:
        from rayhybrid.cluster.worker import TrainWorker, WorkerInfo

        class LocalWorker(TrainWorker):  # no Ray: one CPU process
            def info(self) -> WorkerInfo:
                return WorkerInfo(self.rank, "local", "127.0.0.1", 0, ())

        torch.set_num_threads(1)
        worker, losses = LocalWorker(cfgs[0], 0, 1), []
        for cfg, world, port in zip(cfgs, ranks, ports):
            if proc in world:
                worker.setup("127.0.0.1", port, (), rank=world[proc], cfg=cfg)
                (result,) = worker.train(1)
                losses.append(result.metrics["loss"])
                worker.reset()
        out.put((proc, True, losses))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        out.put((proc, False, f"{type(err).__name__}: {err}"))


# --------------------------------------------------------------------------------------------
# One set of rank processes for a save and its resumes (saves a spawn and a rendezvous).


def shared_parameters(trainer) -> list[tuple[str, str]]:
    """(name, the earlier name of the same tensor) for every parameter a stage of `trainer`
    holds twice: a tied output is ("output.weight", "tok_embeddings.weight")."""
    pairs = []
    for _, module in trainer.stages:
        first: dict[int, str] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            if id(param) in first:
                pairs.append((name, first[id(param)]))
            else:
                first[id(param)] = name
    return pairs


def train_save_resume(
    rank: int, fresh: dict, source: str, root: str, before: int, after: int, resume: dict, tensors: tuple = ()
) -> dict:
    """Each labelled config of `fresh` trains `before + after` steps from scratch (the one
    labelled `source` saves a checkpoint into `root` after `before` steps); then each config of
    `resume` is restored from that checkpoint and trains `after` steps. All configs need the
    same world size. {"fresh": {label: every step's metrics}, "path": the checkpoint,
    "resumed": {label: {"start", "restored" (the RestoreResult), "losses", "consumed", "shared"
    (see shared_parameters)}},
    "tensors": {label: {name: full tensor}} of the parameters named in `tensors` this rank
    holds at the end of each fresh run, per stage: [(stage index, name, tensor)]}."""
    from torch.distributed.tensor import DTensor

    from rayhybrid.storage import checkpoints as checkpoint_store
    from rayhybrid.trainer.loop import Trainer

    out: dict = {"fresh": {}, "resumed": {}, "tensors": {}}
    for label, cfg in fresh.items():
        try:
            tr = Trainer(cfg, rank=rank, device=torch.device("cpu"))
            metrics = [dict(tr.train_step().metrics) for _ in range(before)]
            if label == source:
                saved = tr.save_checkpoint(root, keep=2)  # uploads while the next steps train
            metrics += [dict(tr.train_step().metrics) for _ in range(after)]
            if label == source:
                (done,) = tr.finished_checkpoints(wait=True) or [saved]
                assert done.error is None, done
                out["path"] = saved.path
                tr.close_checkpoints()
            out["fresh"][label] = metrics
            # Every rank of a stage asks for the same tensors in the same order (DTensor gathers).
            out["tensors"][label] = [
                (index, name, (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone())
                for index, module in tr.stages
                for name, p in module.named_parameters()
                if name in tensors
            ]
        except Exception as exc:
            raise RuntimeError(f"config {label!r} failed on rank {rank}") from exc
        del tr
    # Rank 0 commits once every rank's upload is done: the others wait for that before they look.
    torch.distributed.barrier()
    ckpt = checkpoint_store.latest(root) if resume else None
    for label, cfg in resume.items():
        try:
            tr = Trainer(cfg, rank=rank, device=torch.device("cpu"))
            restored = tr.load_checkpoint(str(ckpt.path), ckpt.meta)
            start, shared = tr.step, shared_parameters(tr)
            metrics = [tr.train_step().metrics for _ in range(after)]
            out["resumed"][label] = {
                "start": start,
                "restored": restored,
                "losses": [m["loss"] for m in metrics],
                "consumed": [m["consumed_samples"] for m in metrics],
                "shared": shared,
            }
        except Exception as exc:
            raise RuntimeError(f"resuming config {label!r} failed on rank {rank}") from exc
        del tr
    return out


def hf_reads(rank: int, cfg) -> dict[str, int]:
    """Build a `Trainer` for `cfg` (with model.init_from) while recording what this rank asks
    DCP's HuggingFaceStorageReader for: {Hugging Face tensor name: elements read}."""
    import math

    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from rayhybrid.trainer.loop import Trainer

    reads: dict[str, int] = {}
    original = HuggingFaceStorageReader.read_data

    def read_data(self, plan, planner):
        for item in plan.items:
            fqn = item.storage_index.fqn
            reads[fqn] = reads.get(fqn, 0) + math.prod(item.lengths)
        return original(self, plan, planner)

    HuggingFaceStorageReader.read_data = read_data
    try:
        Trainer(cfg, rank=rank, device=torch.device("cpu"))
    finally:
        HuggingFaceStorageReader.read_data = original
    return reads


def heal_memory(rank: int, cfgs: dict, steps: int) -> dict:
    """Peer healing's memory (metrics.memory), as after a failure: both ranks of a dp2 world
    train `steps` steps; then every rank builds its trainer anew (a new world), rank 0 takes
    the state it kept and sends it, and rank 1, whose state was lost, receives it under its
    meter. {"steady_mb": a steady step's peak, "heal_mb": the receive's peak (rank 1), "state":
    the parameters after, "step": rank 1's step after}."""
    from rayhybrid.trainer import heal
    from rayhybrid.trainer.loop import Trainer

    (cfg,) = cfgs.values()
    tr = Trainer(cfg, rank=rank, device=torch.device("cpu"))
    trained = [dict(tr.train_step().metrics) for _ in range(steps)]
    out = {"steady_mb": steady_peak_mb(trained)}
    kept = heal.keep(tr) if rank == 0 else None
    del tr, trained
    gc.collect()
    fresh = Trainer(cfg, rank=rank, device=torch.device("cpu"))
    if rank == 0:
        heal.restore(fresh, kept)
        heal.send(fresh, [1])
    else:
        settled()
        with fresh.memory.step():
            fresh.memory.phase(fresh.stages[0][0], "heal")
            heal.receive(fresh, 0)
        out["heal_mb"] = max(fresh.memory.peaks_mb().values())
    out["state"] = {name: _local_of(p).detach().clone() for name, p in fresh.named_parameters()}
    out["step"] = fresh.step
    return out


def _local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor pickles without a process group)."""
    return t.to_local() if hasattr(t, "to_local") else t


def heal_records(rank: int, cfgs: dict, steps: int) -> dict:
    """What a rank reports of its step after a heal (`trainer.heal.step_record`): without the
    results it kept (a rank that received its state), beside what `train_step` returned."""
    from rayhybrid.trainer import heal
    from rayhybrid.trainer.loop import Trainer

    (cfg,) = cfgs.values()
    tr = Trainer(cfg, rank=rank, device=torch.device("cpu"))
    for _ in range(steps):
        result = tr.train_step()
    return {
        "trained": dict(result.metrics),
        "received": heal.step_record(tr, None).metrics,
        "kept": heal.step_record(tr, result).metrics,
    }


def v_warmup_peers(rank: int) -> list[int]:
    """The group ranks this rank's warm-up messages go to, on pp2 with zbv's stages (0 and 3 on
    rank 0, 1 and 2 on rank 1): rayhybrid's `Stage`, as torch 2.11's schedules ask for them."""
    from rayhybrid.parallel.pipeline import Stage

    own = (0, 3) if rank == 0 else (1, 2)
    stages = [Stage(torch.nn.Linear(2, 2), i, 4, torch.device("cpu"), group=torch.distributed.group.WORLD) for i in own]
    peers = []
    for stage in stages:
        stage.stage_index_to_group_rank = {0: 0, 1: 1, 2: 1, 3: 0}
        peers += [op.group_peer for op in stage._get_init_p2p_neighbors_ops()]
    return peers


def offload_steps(rank: int, cfgs: dict, steps: int) -> dict[str, dict]:
    """For each labelled config: a fresh Trainer, `steps` steps; losses, the meter's peaks and
    what each block of the rank's stages sent to the host."""
    from rayhybrid.trainer.loop import Trainer

    out = {}
    for label, cfg in cfgs.items():
        tr = Trainer(cfg, rank=rank, device=torch.device("cpu"))
        metrics = [dict(tr.train_step().metrics) for _ in range(steps)]
        offloads = [
            m.activation_offload for _, stage in tr.stages for m in stage.modules() if hasattr(m, "activation_offload")
        ]
        out[label] = {
            "losses": [m["loss"] for m in metrics],
            "steps": metrics,
            "moved": [o.moved for o in offloads],
            "returned": [o.returned for o in offloads],
        }
        del tr
    return out


def loss_grads_eval_many(rank: int, cfgs: dict) -> dict[str, dict]:
    """For each labelled config: a fresh `Trainer`, one `forward_backward()` (its global loss and
    every parameter's full gradient, as `grads_many`), then `evaluate()` (the held-out loss)."""
    out = grads_many(rank, cfgs)
    from torch.distributed.tensor import DTensor

    from rayhybrid.trainer.loop import Trainer

    for label, cfg in cfgs.items():
        tr = Trainer(cfg, rank=rank, device=torch.device("cpu"))
        out[label]["loss"] = tr.global_loss(tr.forward_backward())
        out[label]["val_loss"] = tr.evaluate()
        out[label]["chunk"] = tr.loss.chunk  # the tokens per chunk the loss ran (0: whole logits)
        # After evaluation, how many elements each output projection holds here (FSDP2: its
        # shard when resharded, the whole matrix when left gathered).
        out[label]["held_after_eval"] = [
            (w.to_local() if isinstance(w, DTensor) else w).numel()
            for _, module in tr.stages
            if (w := getattr(getattr(module, "output", None), "weight", None)) is not None
        ]
        del tr
    return out


def build_shards(rank: int, cfgs: dict, without_offsets: tuple[str, ...] = ()) -> dict[str, dict]:
    """For each labelled config: this rank's stages built (`trainer.build.build_stages`, no
    trainer around them) under torch's `MemTracker`, for the labels in `without_offsets` with
    DTensor's private `compute_local_shape_and_global_offset` taken away (as in a torch where it
    moved); {label: {"warnings": what rayhybrid/parallel/materialise.py warned, "peak": the most
    CPU tensor bytes live during the build, "local": {name: this rank's local tensor}, "placements": {name: its
    DTensor placements, or None}, "full": {name: the whole tensor, gathered}, "tied": the
    stage's shared parameters, "tp": this rank's tp coordinate}}."""
    import logging.handlers

    import torch.distributed.tensor._utils as dtensor_utils
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
    from torch.distributed.tensor import DTensor

    from rayhybrid.config.topology import Layout
    from rayhybrid.models.registry import get_spec
    from rayhybrid.parallel import materialise
    from rayhybrid.parallel.materialise import shared_parameters
    from rayhybrid.parallel.mesh import build_mesh
    from rayhybrid.trainer.build import build_stages

    cpu, out = torch.device("cpu"), {}
    for label, cfg in cfgs.items():
        t, layout = cfg.topology, Layout.of(cfg)
        mesh = build_mesh(t.dp, t.pp, t.tp, cpu)
        coord = layout.topology.coord(rank)
        gc.collect()
        tracker, saved = MemTracker(), dtensor_utils.compute_local_shape_and_global_offset
        handler = logging.handlers.BufferingHandler(capacity=100)
        logging.getLogger(materialise.__name__).addHandler(handler)
        if label in without_offsets:
            del dtensor_utils.compute_local_shape_and_global_offset
        try:
            with tracker:
                stages = build_stages(
                    cfg, get_spec(cfg.model), layout, mesh, cpu, pp_rank=coord.pp, loss_parallel=False
                )
        finally:
            dtensor_utils.compute_local_shape_and_global_offset = saved
            logging.getLogger(materialise.__name__).removeHandler(handler)
        peak = tracker.get_tracker_snapshot("peak")[cpu][_TOTAL_KEY]
        got: dict = {
            "warnings": [r.getMessage() for r in handler.buffer],
            "peak": peak,
            "local": {},
            "placements": {},
            "full": {},
            "tied": [],
            "tp": coord.tp,
        }
        for _, module in stages:
            got["tied"] += shared_parameters(module)
            for name, p in module.named_parameters():  # the same order on every rank: gathers line up
                is_d = isinstance(p, DTensor)
                got["local"][name] = (p.to_local() if is_d else p).detach().clone()
                got["placements"][name] = tuple(p.placements) if is_d else None
                got["full"][name] = (p.full_tensor() if is_d else p).detach().clone()
        out[label] = got
        del stages
    return out
