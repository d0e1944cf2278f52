"""Process group, backend choice and the named ("dp", "pp", "tp") device mesh (with HSDP, dp
split into ("dp_replicate", "dp_shard") as well).

torch is imported where it is used: the device choice (`choose_device`) needs none, so a rank
reports what it would choose (`TrainWorker.placement`, cluster/worker.py) without the seconds
that importing torch takes.

`joining`, `forget_group_names` and `forget_meshes` set or clear torch internals (c10d's
`_world`, DTensor's caches; tests/test_private_apis.py lists them). Each checks that they are
there first: in a torch where one was renamed, the feature is skipped after one warning line
naming what is lost, instead of an assignment that silently does nothing."""

from __future__ import annotations

import contextlib
import logging
import pkgutil
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from rayhybrid.errors import TESTED_TORCH

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("dp", "pp", "tp")

log = logging.getLogger(__name__)
_warned: set[str] = set()


def _lacking(what_is_lost: str, missing: list[str]) -> bool:
    """Whether torch lacks any of `missing` (the names not found); warns once per loss."""
    if missing and what_is_lost not in _warned:
        _warned.add(what_is_lost)
        log.warning(
            "%s: this torch lacks %s (rayhybrid is tested with %s)", what_is_lost, ", ".join(missing), TESTED_TORCH
        )
    return bool(missing)


_MISSING = object()


def _lookup(path: str):
    """The object at dotted `path` (a module, then attributes); `_MISSING` when it is not there."""
    try:
        return pkgutil.resolve_name(path)
    except (ImportError, AttributeError):
        return _MISSING


def _missing(paths) -> list[str]:
    return [path for path in paths if _lookup(path) is _MISSING]


C10D = "torch.distributed.distributed_c10d"
JOIN_INTERNALS = tuple(
    f"{C10D}.{name}"
    for name in (
        "default_pg_timeout",
        "default_pg_nccl_timeout",
        "_world.pg_map",
        "_set_pg_timeout",
        "_get_default_timeout",
        "GroupMember.WORLD",
    )
)
"""What `joining` sets and reads: without any, groups form under torch's own timeout."""
GROUP_COUNT = f"{C10D}._world.group_count"
"""What `forget_group_names` resets."""
MESH_CACHES = (
    "torch.distributed.tensor.debug._clear_sharding_prop_cache",
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear",
    "torch.distributed.tensor._redistribute._gen_transform_infos.cache_clear",
    "torch.distributed.tensor._redistribute.clear_redistribute_planner_cache",
    "torch.distributed.tensor._collective_utils.MeshTopoInfo.build_from_mesh.cache_clear",
)
"""The caches keyed by mesh that `forget_meshes` clears (each called)."""


def select_backend(device: torch.device | DeviceChoice) -> str:
    """NCCL for a CUDA device, gloo otherwise: chosen, never configured by hand."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True)
class DeviceChoice:
    """The device a rank trains on (`choose_device`), as torch names it: `type` and `index`."""

    type: str
    index: int | None
    cuda_visible_devices: str | None
    """CUDA_VISIBLE_DEVICES to set before CUDA starts; None on CPU (left as it is)."""

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device(self.type, self.index)

    @property
    def backend(self) -> str:
        return select_backend(self)

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


def choose_device(own: Sequence[str], visible: Sequence[str] = ()) -> DeviceChoice:
    """The device of a rank that holds the GPUs `own` (the ids Ray gave it; none: the CPU) on a
    node whose ranks hold `visible` together (empty: only its own). The rank sees every GPU in
    `visible`, so NCCL can use the peer-to-peer links between them, and uses its first own GPU,
    by its position there. Pure: it touches no CUDA, so a test can ask it on a machine without
    the GPUs that Ray declares."""
    if not own:
        return DeviceChoice("cpu", None, None)
    seen = [str(gpu) for gpu in (visible or own)]
    if str(own[0]) not in seen:
        raise ValueError(f"GPU {own[0]} of this rank is not among its node's GPUs {seen}")
    return DeviceChoice("cuda", seen.index(str(own[0])), ",".join(seen))


COLLECTIVE_TIMEOUT_S = 300.0
"""The default group's timeout for its collectives."""


def init_process_group(
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device: torch.device,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
    hosted: bool = False,
) -> None:
    """Join the default group at master_addr:master_port. `hosted`: a store is served there
    already (`host_store`) and every rank connects to it as a client; otherwise rank 0 serves
    it inside its process group (torch's tcp:// rendezvous)."""
    import torch.distributed as dist

    from rayhybrid.parallel.abort import formed, nccl_error_handling

    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if select_backend(device) == "nccl":
        nccl_error_handling()  # a dead peer raises, the survivor keeps its state
    timeout = timedelta(seconds=timeout_s)
    if hosted:
        kwargs["store"] = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
    else:
        kwargs["init_method"] = f"tcp://{master_addr}:{master_port}"
    dist.init_process_group(backend=select_backend(device), rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    formed()  # a new world: one abort may stop it (rayhybrid/parallel/abort.py)


def host_store(host: str, world_size: int, port: int = 0, timeout_s: float = COLLECTIVE_TIMEOUT_S):
    """A rendezvous store served by this process on `port` (0: a free one; every interface),
    until the object is dropped: then its server stops, and every rank waiting in it fails at
    once (`TrainWorker.close_store`)."""
    import torch.distributed as dist

    return dist.TCPStore(
        host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


JOIN_TIMEOUT_S = 20.0
"""How long a rank waits for the others while the process groups are formed. They start
together (the driver calls every rank's setup at once, imports done), so the rendezvous takes
seconds, and a rendezvous that cannot complete ends after this long instead of a collective's
timeout (minutes). A rank lost during a join costs far less than this: the others wait for it
in the rendezvous store, which the driver then closes (rayhybrid/cluster/drain.py), and they
fail at once."""


@contextlib.contextmanager
def joining(collective_s: float, timeout_s: float = JOIN_TIMEOUT_S):
    """Form process groups under a short timeout: the default group's rendezvous (pass
    `timeout_s` to `init_process_group`) and every group made meanwhile (a device mesh's, a
    `new_group`'s). On leaving, every group gets the timeout it would have had (`collective_s`
    for the default group, torch's default for the others): the short one is for forming a
    group, never for its collectives."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    lost = "process groups form under torch's default timeout, not the short join timeout"
    if _lacking(lost, _missing(JOIN_INTERNALS)):
        yield
        return
    defaults = c10d.default_pg_timeout, c10d.default_pg_nccl_timeout
    short = timedelta(seconds=timeout_s)
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = short
    try:
        yield
    finally:
        c10d.default_pg_timeout, c10d.default_pg_nccl_timeout = defaults
    if not dist.is_initialized():
        return
    for group in list(c10d._world.pg_map):
        if group is c10d.GroupMember.WORLD:
            c10d._set_pg_timeout(timedelta(seconds=collective_s), group)
        else:
            c10d._set_pg_timeout(c10d._get_default_timeout(dist.get_backend(group)), group)


HSDP_DIMS = ("dp_replicate", "dp_shard")
"""HSDP's split of dp (`topology.dp_shard=N`): dp = dp_replicate x dp_shard, shard fastest."""


def build_mesh(dp: int, pp: int, tp: int, device: torch.device) -> DeviceMesh:
    """The one mesh every sub-group comes from; rank order is tp fastest, dp outermost."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dp, pp, tp), mesh_dim_names=MESH_DIMS)


def split_dp(mesh: DeviceMesh, shard_group: int) -> DeviceMesh:
    """`mesh` for building the model: with HSDP (1 < shard_group < dp), dp split into
    ("dp_replicate", "dp_shard") = (dp / shard_group, shard_group) beside "pp" and "tp" (the
    same groups as `mesh`'s); else `mesh` itself. A shard group is `shard_group` consecutive dp
    ranks: dp rank d is in replica group d // shard_group at shard coordinate d % shard_group.
    `mesh` keeps its "dp" (the loss's all-reduce, the data's split, healing use it). Forms the
    new dimensions' process groups: call it once, on every rank."""
    dp = mesh["dp"].size()
    if not 1 < shard_group < dp:
        return mesh
    assert dp % shard_group == 0, (dp, shard_group)  # the config check refuses another
    return mesh._unflatten("dp", (dp // shard_group, shard_group), HSDP_DIMS)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh data parallelism runs on: ("dp_replicate", "dp_shard") for HSDP (FSDP2's
    `fully_shard` on a 2-D mesh shards over the second dimension and replicates over the
    first), else "dp"."""
    return mesh[HSDP_DIMS] if HSDP_DIMS[1] in (mesh.mesh_dim_names or ()) else mesh["dp"]


def forget_group_names() -> None:
    """Number the next world's groups from 0 again. torch names a group by a process-wide count
    it advances before the group forms and resets only when a formed world is destroyed; after a
    join that failed before its default group formed, this rank would name every group of the
    next world one higher than the others do, and wait for keys no other rank writes."""
    from torch.distributed import distributed_c10d as c10d

    lost = "after a failed join this rank may name the next world's groups unlike the others do (the join times out)"
    if not _lacking(lost, _missing([GROUP_COUNT])):
        c10d._world.group_count = 0


def leave_world() -> None:
    """Leave this process's world: destroy its process groups and forget its device meshes
    (`forget_meshes`); after a join that failed before its default group formed, which has
    counted that group, the count that names groups (`forget_group_names`)."""
    import gc

    import torch.distributed as dist

    from rayhybrid.parallel.abort import leaving

    if dist.is_initialized():
        leaving()  # no abort walks the groups while they go (rayhybrid/parallel/abort.py)
        dist.destroy_process_group()
        gc.collect()
        forget_meshes()
    else:
        forget_group_names()


def forget_meshes() -> None:
    """After `destroy_process_group`: forget every device mesh of the world just left.

    Two kinds of references outlive the world. Device meshes keep their groups in a registry,
    so the groups' connections stay open; clearing it closes them, and a peer blocked on this
    rank fails at once instead of waiting for the collective's timeout. And DTensor caches
    sharding decisions keyed by mesh, where two meshes are equal when their shape and dimension
    names are (group names do not count): a worker that later joins a world of the same shape
    under another rank would get back a cached mesh whose groups are the old world's, and fail
    with "Could not resolve the process group registered under the name N". The scan is short
    when the objects made by imports were frozen out of the collector (`gc.freeze`, see
    cluster/worker.py)."""
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    clears = {path: _lookup(path) for path in MESH_CACHES}  # the first: Python's cache and the C++ fast path's
    for clear in clears.values():
        if clear is not _MISSING:
            clear()
    lost = "a worker that joins a world of the same shape again may get a cached mesh of the old world's groups"
    _lacking(lost, [path for path, clear in clears.items() if clear is _MISSING])
    kept = 0
    for obj in gc.get_objects():
        if type(obj) is DeviceMesh:
            registry = getattr(obj, "_pg_registry", None)
            if registry is None:
                kept += 1
            else:
                registry.clear()
    lost = "the groups of a world left stay open, so a peer waits for its timeout instead of failing at once"
    _lacking(lost, ["torch.distributed.device_mesh.DeviceMesh._pg_registry"] if kept else [])
