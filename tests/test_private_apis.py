"""Every private name of Ray, torch and the other dependencies that rayhybrid uses, in one table
(`PRIVATE`), checked against the installed versions in a few seconds, without a Ray cluster.

A private name can move in any release, and then not one feature but every run may stop: so
upgrading Ray or torch starts with this test. For each entry the name must be there (imported,
then looked up attribute by attribute) and, for what rayhybrid calls, must still accept the
arguments rayhybrid passes (`inspect.signature(...).bind`). A second test reads rayhybrid's
source and fails on a private use the table lacks, so the table stays complete.

What a missing name costs is written beside it. The features that would otherwise break every
run check theirs when they run and degrade with one warning line: Ray's own text stays on the
terminal (rayhybrid/driver/raytext.py), code shipping is off (rayhybrid/cluster/code.py), the
join timeout and the forgetting of a world's meshes are skipped (rayhybrid/parallel/mesh.py);
the tests of those modules take the names away and check the warning and that the run goes on.

A path is a module and its attributes (`ray._private.worker._global_node`); `Class#name` is an
attribute the class sets on its instances (`self.name = ...` in it or a base), looked up in
the source since building one would need a process group or a cluster.
"""

from __future__ import annotations

import ast
import inspect
import logging
import pkgutil
import re
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rayhybrid"


class Private(NamedTuple):
    path: str
    feature: str
    """What uses it (the module) and what stops without it."""
    call: tuple[int, tuple[str, ...]] | None = None
    """For what is called: the positional arguments rayhybrid passes (self counted for a
    method looked up on its class) and the keywords."""


RAY_TEXT = "driver/raytext.py: Ray's own text into the run's log (without: on the terminal, one warning)"
CODE = "cluster/code.py: shipping the model's code (without: shipping off, one warning naming the fix)"
AUTH = "cluster/connect.py: token authentication when joining a cluster"
DRAIN = "cluster/spot_watch.py: a spot notice (or fault.straggler=evacuate) drains its node in Ray"
PLACE = "cluster/placement.py: whether the cluster can add nodes; Ray's drain state"
JOIN = "parallel/mesh.py joining: the short join timeout (without: torch's, one warning)"
FORGET = "parallel/mesh.py forget_*: a rank rejoining after a failure (without: one warning)"
ABORT = "parallel/abort.py: the drain aborts a rank's NCCL communicators (without: a survivor waits for the watchdog)"
PIPE = "parallel/pipeline.py: forward-only passes of the multi-stage schedules (evaluation)"
COMPILE = "parallel/compile.py: train.compile's cache folder and settings"
MEMORY = "trainer/memory_meter.py: the memory meter (tune.memory_budget_mb, the planner's check)"
C10D = "torch.distributed.distributed_c10d"
SCHEDULES = "torch.distributed.pipelining.schedules"
MEM_TRACKER = "torch.distributed._tools.mem_tracker.MemTracker"
PACKAGING = "ray._private.runtime_env"
TOKEN = "ray._private.authentication.authentication_token_setup"
FUNCOL = "torch.distributed._functional_collectives"
FSDP_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup"
SPLIT = "trainer/split.py: the MFU split's waits, hooked (without: counted as compute, one warning)"

PRIVATE = (
    # Ray
    Private("ray._private.worker.print_to_stdstream", RAY_TEXT, (2, ())),
    Private("ray._private.worker.filter_autoscaler_events", RAY_TEXT, (1, ())),
    Private("ray._private.worker.global_worker.connected", RAY_TEXT),
    Private("ray._private.worker.RAY_TQDM_MAGIC", RAY_TEXT),
    Private("ray._private.worker._global_node", f"{RAY_TEXT}; {PLACE}"),
    Private("ray._private.ray_constants.LOG_PREFIX_INFO_MESSAGE", RAY_TEXT),
    Private("ray._private.ray_logging.global_worker_stdstream_dispatcher.handlers", RAY_TEXT),
    Private("ray._private.ray_logging.global_worker_stdstream_dispatcher.add_handler", RAY_TEXT, (2, ())),
    Private("ray._private.ray_logging.global_worker_stdstream_dispatcher.remove_handler", RAY_TEXT, (1, ())),
    Private("ray._private.ray_constants.get_runtime_env_default_excludes", CODE, (0, ())),
    Private("ray._private.ray_constants.RAY_RUNTIME_ENV_IGNORE_GITIGNORE", CODE),
    Private(f"{PACKAGING}.packaging._dir_travel", CODE, (3, ("include_gitignore", "logger"))),
    Private(f"{PACKAGING}.packaging._get_excludes", CODE, (2, ())),
    Private(f"{PACKAGING}.py_modules.upload_py_modules_if_needed", CODE, (2, ("scratch_dir", "logger"))),
    Private(f"{PACKAGING}.working_dir.upload_working_dir_if_needed", CODE, (2, ("scratch_dir", "logger"))),
    Private(f"{TOKEN}._get_default_token_path", AUTH, (0, ())),
    Private(f"{TOKEN}.maybe_enable_token_auth_if_token_available", AUTH, (0, ("warn_if_disabled",))),
    Private("ray._raylet.GcsClient", f"{AUTH}; {DRAIN}", (0, ("address", "cluster_id"))),
    Private("ray._raylet.InnerGcsClient.drain_node", DRAIN, (5, ())),  # GcsClient hands its calls to it
    Private("ray.core.generated.autoscaler_pb2.DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION", DRAIN),
    Private("ray._private.state.state.get_draining_nodes", PLACE, (0, ())),
    Private("ray._private.ray_constants.DEBUG_AUTOSCALING_STATUS", PLACE),
    Private("ray.autoscaler._private.util.format_readonly_node_type", PLACE, (1, ())),
    Private("ray.experimental.internal_kv._internal_kv_get", PLACE, (1, ())),
    # torch
    Private(f"{C10D}.default_pg_timeout", JOIN),
    Private(f"{C10D}.default_pg_nccl_timeout", JOIN),
    Private(f"{C10D}._world.pg_map", f"{JOIN}; {ABORT}"),
    Private(f"{C10D}._set_pg_timeout", JOIN, (2, ())),
    Private(f"{C10D}._get_default_timeout", JOIN, (1, ())),
    Private(f"{C10D}._world.group_count", FORGET),
    Private("torch.distributed.tensor.debug._clear_sharding_prop_cache", FORGET, (0, ())),
    Private(
        "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear",
        FORGET,
        (0, ()),
    ),
    Private("torch.distributed.tensor._redistribute._gen_transform_infos.cache_clear", FORGET, (0, ())),
    Private("torch.distributed.tensor._redistribute.clear_redistribute_planner_cache", FORGET, (0, ())),
    Private("torch.distributed.tensor._collective_utils.MeshTopoInfo.build_from_mesh.cache_clear", FORGET, (0, ())),
    Private("torch.distributed.device_mesh.DeviceMesh#_pg_registry", FORGET),
    Private(
        "torch.distributed.device_mesh.DeviceMesh._unflatten",
        "parallel/mesh.py split_dp: HSDP's 2-D mesh (topology.dp_shard=N; without: HSDP cannot run)",
        (4, ()),
    ),
    Private(
        "torch.distributed._composable.replicate_with_fsdp.replicate", "parallel/data_parallel.py: dp", (1, ("mesh",))
    ),
    Private("torch._foreach_mul_", "parallel/grad.py: gradient clipping", (2, ())),
    Private("torch._inductor.runtime.cache_dir_utils.default_cache_dir", COMPILE, (0, ())),
    Private("torch._inductor.config.fx_graph_cache", COMPILE),
    Private("torch._functorch.config.enable_autograd_cache", COMPILE),
    Private("torch._functorch.config.donated_buffer", COMPILE + " (off: the zero-bubble schedules)"),
    Private(
        f"{FUNCOL}.AsyncCollectiveTensor.wait",
        f"parallel/compile.py: a compiled block's lazily waited input (llama3 under tp); {SPLIT}",
        (1, ()),
    ),
    Private(f"{SCHEDULES}._ComputationType.FORWARD", PIPE),
    Private(f"{SCHEDULES}._PipelineScheduleRuntime", PIPE),
    Private(f"{SCHEDULES}._PipelineScheduleRuntime#_num_stages", PIPE),
    Private(f"{SCHEDULES}._add_send_recv", PIPE, (1, ("stage_to_rank", "num_stages"))),
    Private(f"{SCHEDULES}._add_unshard_reshard", PIPE, (1, ())),
    Private(
        "torch.distributed.pipelining.PipelineStage._get_init_p2p_neighbors_ops",
        "parallel/pipeline.py Stage: zbv on gloo under torch 2.11 (overridden; 2.13 does not call it)",
        (1, ()),
    ),
    Private(
        f"{SCHEDULES}._wait_batch_p2p", f"trainer/instrument.py: trace.json's p2p waits (swapped); {SPLIT}", (1, ())
    ),
    Private(f"{FUNCOL}.AsyncCollectiveTensor.trigger_wait", SPLIT, (1, ())),
    *(Private(f"{FSDP_GROUP}.{name}", SPLIT) for name in ("unshard", "wait_for_unshard", "post_backward")),
    Private(f"{FSDP_GROUP}.finalize_backward", SPLIT, (1, ())),
    Private("torch.distributed.checkpoint._fsspec_filesystem.FsspecReader", "trainer/checkpoint.py: loading"),
    Private("torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter", "trainer/checkpoint.py: saving"),
    Private(
        "torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
        "parallel/materialise.py: a shard cut from the whole on the CPU (without: on the device, one warning)",
        (3, ()),
    ),
    Private(MEM_TRACKER, MEMORY),
    Private("torch.distributed._tools.mem_tracker._TOTAL_KEY", MEMORY),
    Private(f"{MEM_TRACKER}#_curr_mem_snap", MEMORY),
    Private(f"{MEM_TRACKER}#_mod_tracker", MEMORY + " (replaced)"),
    Private(f"{MEM_TRACKER}._update_peak_stats", MEMORY + " (overridden: the per-operator hook)", (2, ())),
    Private(f"{MEM_TRACKER}._track_module_params_and_buffers", MEMORY, (2, ("install_grad_hooks",))),
    Private("torch._C._current_graph_task_id", MEMORY, (0, ())),
    # Hydra, OmegaConf, fsspec
    Private("hydra._internal.config_loader_impl.ConfigLoaderImpl", "__main__.py: --cfg", (0, ("config_search_path",))),
    Private("hydra._internal.core_plugins.basic_sweeper.BasicSweeper.split_arguments", "__main__.py", (2, ())),
    Private("hydra._internal.utils.create_config_search_path", "__main__.py", (1, ())),
    Private("omegaconf.DictConfig._get_node", "config/compose.py: the schema, required settings", (2, ())),
    Private("omegaconf.Node._get_full_key", "config/compose.py: a required setting's name", (2, ())),
    Private("omegaconf.Node._value", "config/compose.py: required settings", (1, ())),
    Private("omegaconf.Node._is_interpolation", "config/compose.py: required settings", (1, ())),
    Private("omegaconf.Node._is_missing", "config/compose.py: required settings", (1, ())),
    Private("fsspec.AbstractFileSystem._strip_protocol", "storage/store.py: paths in a store", (1, ())),
)

_MISSING = object()


def lookup(path: str):
    """The object at `path` (a module, then attributes), or _MISSING."""
    try:
        return pkgutil.resolve_name(path)
    except (ImportError, AttributeError):
        return _MISSING


def sets_on_instances(cls: type, name: str) -> bool:
    """Whether `cls` or a base declares `name` or assigns `self.name` (in its source)."""
    assigned = re.compile(rf"self\.{re.escape(name)}\s*(:[^=\n]*)?=[^=]")
    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            return True
        try:
            if assigned.search(inspect.getsource(klass)):
                return True
        except (OSError, TypeError):
            continue
    return False


def problem(entry: Private) -> str | None:
    """What is wrong with `entry` under the installed versions; None when nothing is."""
    path, _, instance_attr = entry.path.partition("#")
    obj = lookup(path)
    if obj is _MISSING:
        return "missing"
    if instance_attr:
        return None if sets_on_instances(obj, instance_attr) else f"{instance_attr} is no longer set on instances"
    if entry.call is None:
        return None
    positional, keywords = entry.call
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: the lookup is all that can be checked
    try:
        signature.bind(*[None] * positional, **dict.fromkeys(keywords))
    except TypeError as err:
        return f"no longer accepts what rayhybrid passes ({positional} positional, {keywords}): {err}"
    return None


@pytest.mark.parametrize("entry", PRIVATE, ids=[entry.path for entry in PRIVATE])
def test_each_private_name_is_there_and_takes_what_rayhybrid_passes(entry):
    assert problem(entry) is None, f"{entry.path} ({entry.feature}): {problem(entry)}"


def test_problem_finds_a_missing_name_an_unset_attribute_and_a_changed_signature():
    """The checks themselves: each kind of breakage is reported."""
    assert problem(Private("ray._private.worker.no_such_name", "x")) == "missing"
    assert problem(Private("ray._private.no_such_module.name", "x")) == "missing"
    assert "no longer set" in problem(Private(f"{MEM_TRACKER}#_no_such_attribute", "x"))
    assert "no longer accepts" in problem(Private(f"{PACKAGING}.packaging._get_excludes", "x", (3, ())))
    assert "no longer accepts" in problem(Private(f"{PACKAGING}.packaging._dir_travel", "x", (3, ("gitignore",))))


# -- the table is complete -----------------------------------------------------------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> what it names, for every import of another package (at any depth)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "rayhybrid":
                    names[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and node.module.split(".")[0] not in ("rayhybrid", "__future__")
        ):
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _own_names(trees) -> set[str]:
    """The names rayhybrid defines itself: functions, classes, variables, arguments, and the
    attributes it assigns on objects other than imported modules."""
    own: set[str] = set()
    for tree in trees.values():
        imported = _imports(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if not (isinstance(root, ast.Name) and root.id in imported):
                    own.add(node.attr)
    return own


def private_uses(trees) -> set[tuple[str, str]]:
    """(file, use): each private name of another package that rayhybrid's source uses. A use is
    a dotted path through a private part (`ray._private.worker._global_node`), or `*._name`
    for a private attribute of an object whose type the source does not say (not one of
    rayhybrid's own names), including getattr/setattr/hasattr with a literal name."""
    own, found = _own_names(trees), set()
    for path, tree in trees.items():
        where, imported = str(path.relative_to(PACKAGE.parent)), _imports(tree)
        found |= {(where, full) for full in imported.values() if any(map(_private, full.split(".")))}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                chain, root = [node.attr], node.value
                while isinstance(root, ast.Attribute):
                    chain.insert(0, root.attr)
                    root = root.value
                if isinstance(root, ast.Name) and root.id in imported:
                    parts = imported[root.id].split(".") + chain
                    last = max(i for i, part in enumerate(parts) if _private(part))
                    found.add((where, ".".join(parts[: last + 1])))
                elif node.attr not in own:
                    found.add((where, f"*.{node.attr}"))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and _private(str(node.args[1].value))
                and node.args[1].value not in own
            ):
                found.add((where, f"*.{node.args[1].value}"))
    return found


def overrides(trees) -> set[tuple[str, str]]:
    """(file, Base#name): the private names a class of rayhybrid defines or sets on `self`
    that its imported base class has too (an override of another package's internals)."""
    found = set()
    for path, tree in trees.items():
        imported = _imports(tree)
        for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
            bases = [imported[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in imported]
            names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and _private(n.name)}
            names |= {
                n.attr
                for n in ast.walk(cls)
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and _private(n.attr)
                if isinstance(n.value, ast.Name) and n.value.id == "self"
            }
            for base in bases:
                klass = lookup(base)
                for name in sorted(names):
                    if hasattr(klass, name) or sets_on_instances(klass, name):
                        found.add((str(path.relative_to(PACKAGE.parent)), f"{base}#{name}"))
    return found


def listed(use: str) -> bool:
    paths = [entry.path for entry in PRIVATE]
    if use.startswith("*."):
        name = use[2:]
        return any(p.endswith((f".{name}", f"#{name}")) for p in paths)
    if "#" in use:
        base, name = use.split("#")
        return f"{base}.{name}" in paths or use in paths
    return any(p == use or p.startswith((f"{use}.", f"{use}#")) for p in paths)


def test_the_table_lists_every_private_use_in_the_source():
    trees = _trees()
    uses = private_uses(trees) | overrides(trees)
    assert len(uses) > 40  # the scan sees the uses (a broken scan would pass an empty list)
    missing = sorted(f"{where}: {use}" for where, use in uses if not listed(use))
    assert missing == [], "add these to PRIVATE in tests/test_private_apis.py:\n" + "\n".join(missing)


def test_the_scan_sees_each_kind_of_private_use(tmp_path):
    """An import from a private module, an attribute of an imported module, an attribute of an
    unknown object, a getattr with a literal name, and an override of a base's internals."""
    source = (
        "import torch.distributed as dist\n"
        "from ray._private import thing\n"
        "from torch.distributed._tools.mem_tracker import MemTracker\n"
        "class Mine(MemTracker):\n"
        "    def _update_peak_stats(self, state):\n"
        "        self._own = 1\n"
        "def f(x):\n"
        "    dist._world.pg_map\n"
        "    getattr(x, '_hidden', None)\n"
        "    return x._internal\n"
    )
    trees = {PACKAGE / "example.py": ast.parse(source)}
    uses = {use for _, use in private_uses(trees) | overrides(trees)}
    assert uses == {
        "ray._private.thing",
        "torch.distributed._tools.mem_tracker.MemTracker",
        "torch.distributed._world",
        "*._hidden",
        "*._internal",
        f"{MEM_TRACKER}#_update_peak_stats",
    }
    assert not listed("*._internal") and listed(f"{MEM_TRACKER}#_update_peak_stats")


CORE = {
    "rayhybrid/parallel/data_parallel.py: torch.distributed._composable.replicate_with_fsdp",
    "rayhybrid/trainer/memory_meter.py: torch.distributed._tools.mem_tracker",
}
"""Private modules imported at module level on purpose: what a layout cannot run without
(`replicate` is data parallelism itself, with no public twin in torch 2.13: a torch that moved
it fails at the workers' import, and the table test names it first), and the memory meter's
module, which only `build_memory_meter` imports, when metrics.memory is on (metrics.memory is
then off after one warning line)."""


def test_no_private_module_is_imported_at_module_level_but_the_core():
    """Ray's and torch's private modules are imported where they are used, so one that moved
    stops the feature that needs it (which says so in one line), never the import of rayhybrid
    or every run; the exceptions are CORE's."""
    found = []
    for path, tree in _trees().items():
        for node in tree.body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [
                f"{path.relative_to(PACKAGE.parent)}: {n}"
                for n in names
                if n.startswith(("ray.", "torch.")) and "._" in n
            ]
    assert set(found) == CORE


# -- each feature that uses a private name degrades on its own --------------------------------


def _gone(monkeypatch, *modules: str) -> None:
    """Imports of `modules` fail from now on, as in a Ray or torch that moved them."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_drain_notices_are_off_with_one_warning_in_a_ray_without_its_state_api(monkeypatch, caplog):
    from rayhybrid.cluster import placement

    _gone(monkeypatch, "ray._private.state")
    monkeypatch.setattr(placement, "_drain_warned", [])
    assert placement.draining_nodes() == {} and placement.draining_nodes() == {}
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert line.startswith("drain notices are off: this Ray's state API moved") and "\n" not in line


def test_an_autoscaler_that_cannot_be_asked_leaves_a_fixed_cluster_with_one_warning(monkeypatch, caplog):
    from rayhybrid.cluster import placement

    _gone(monkeypatch, "ray._private.ray_constants")
    assert placement.autoscaled(wait_s=0) is False
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "autoscaler status moved" in line and "capacity checked" in line


def test_joining_a_cluster_without_rays_token_setup_connects_as_ray_does_with_one_warning(monkeypatch, caplog):
    from rayhybrid.cluster import connect

    _gone(monkeypatch, "ray._private.authentication.authentication_token_setup")
    assert connect._token_setup() is None
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "token setup moved" in line and "RAY_AUTH_MODE=token" in line


def test_the_memory_meter_is_off_with_one_warning_in_a_torch_without_its_tracker(monkeypatch, caplog):
    import torch

    from rayhybrid.preflight import load_config
    from rayhybrid.trainer.build import build_memory_meter

    _gone(monkeypatch, "rayhybrid.trainer.memory_meter", "torch.distributed._tools.mem_tracker")
    cfg = load_config(["metrics.memory=true"])
    assert build_memory_meter(cfg, torch.device("cpu"), [], []) is None
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert line.startswith("metrics.memory is off: this torch's memory tracker moved")


def test_checkpoints_to_a_store_are_refused_in_one_line_in_a_torch_without_dcps_fsspec_io(monkeypatch):
    from rayhybrid.errors import ConfigError
    from rayhybrid.storage.store import Store
    from rayhybrid.trainer import checkpoint

    _gone(monkeypatch, "torch.distributed.checkpoint._fsspec_filesystem")
    store = Store.open("memory://ckpt")
    with pytest.raises(ConfigError, match="checkpoint.dir: this torch cannot write checkpoints to a store") as err:
        checkpoint.writer(store, store.join("step_00000001"))
    assert "\n" not in str(err.value)
    local = Store.open("/tmp/rayhybrid-private-apis")  # a local path needs none of it
    assert checkpoint.writer(local, "/tmp/rayhybrid-private-apis/step_00000001") is not None
