"""The user's code on every node (`cluster.code`): what the driver ships with Ray's runtime
environment, so that workers on nodes where only rayhybrid is installed import the model that
`model.module` names.

- `auto`: the top-level package (its directory) or the single-file module that defines the
  model, when the driver imports it from a plain directory. Nothing when it is installed
  (site-packages, the standard library), is rayhybrid itself, or was shipped by Ray already (a
  Ray Job's `working_dir` or `py_modules`: it lies under Ray's `runtime_resources`, and the
  workers inherit the job's runtime environment). Shipped as Ray's `py_modules`.
- `off`: nothing.
- a directory: shipped as Ray's `working_dir` (the workers run in it, with it on `sys.path`).

Ray takes local paths only in a job's runtime environment (`ray.init`, `ray job submit`); an
actor's must name packages already in the cluster. So the driver uploads them itself, with
Ray's own packaging: content-addressed (unchanged code is not uploaded again), `.gitignore`,
`.rayignore` and Ray's default excludes (`.git`, `__pycache__`, ...) apply. An actor's
`py_modules` replaces its parent's, so the job's own `py_modules` are kept in the list.

`shipment(cfg)` decides what to ship and checks its files' sizes (no Ray: a file over
`cluster.code_max_file_mb` is a one-line ConfigError); `runtime_env` uploads it and returns the
workers' runtime environment.

Ray's packaging is private (`ray._private.runtime_env`, tests/test_private_apis.py lists what
is used). In a Ray where it moved or changed its signature, shipping is off after one warning
line that names the fixes (install the code on every node, or the tested Ray), and the run goes
on without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import site
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rayhybrid.config.schema import Config
from rayhybrid.errors import ConfigError
from rayhybrid.storage.store import one_line

log = logging.getLogger(__name__)
# Ray's packaging logs each upload and ignore file at info: keep its errors only (what is
# shipped is logged here, once; files over the limit never reach it).
_RAY_LOG = logging.getLogger(__name__ + ".ray")
_RAY_LOG.setLevel(logging.ERROR)

OFF = ("off", "false")
_announced: set[tuple[str, ...]] = set()

RAY_CHANGED = (ImportError, AttributeError, TypeError)
"""What a moved or changed private part of Ray's packaging raises (TypeError: a signature)."""
_warned: set[str] = set()


class PackagingChanged(Exception):
    """One of Ray's private packaging calls failed as a moved or changed one does (RAY_CHANGED,
    raised by that call itself, not by rayhybrid's code around it)."""


@contextlib.contextmanager
def _ray_packaging():
    """Around calls of Ray's private packaging only: what RAY_CHANGED says becomes PackagingChanged."""
    try:
        yield
    except RAY_CHANGED as err:
        raise PackagingChanged(one_line(err)) from err


def shipping_off(err: BaseException, paths) -> None:
    """Ray's packaging changed: one warning line (once per cause) naming the fixes."""
    why = one_line(err)
    if why not in _warned:
        _warned.add(why)
        log.warning(
            "cluster.code: shipping is off, this Ray's packaging (ray._private.runtime_env) changed (%s); "
            "install %s on every node, or use the Ray rayhybrid is tested with (ray==2.60.*)",
            why,
            " and ".join(paths) or "the model's code",
        )


@dataclass(frozen=True)
class Shipment:
    """One path to ship: a package directory or a .py file (`py_modules`), or a directory to
    run in (`working_dir`); what Ray will pack of it, in files and bytes; what to leave out
    besides Ray's own excludes (gitwildmatch patterns)."""

    path: str
    field: str
    files: int = 0
    bytes: int = 0
    excludes: tuple[str, ...] = ()


def shipment(cfg: Config) -> list[Shipment]:
    """What `cluster.code` ships for this config, its sizes checked (ConfigError naming the
    files over `cluster.code_max_file_mb`). Reads the file system only."""
    choice = str(cfg.cluster.code)
    if choice.lower() in OFF:
        return []
    if choice.lower() == "auto":
        wanted = [Shipment(path, "py_modules") for path in auto_paths(cfg)]
    else:
        root = Path(choice).expanduser().resolve()
        wanted = [Shipment(str(root), "working_dir", excludes=own_outputs(cfg, root))]
    try:
        return [_measured(s, cfg.cluster.code_max_file_mb) for s in wanted]
    except PackagingChanged as err:
        shipping_off(err, [s.path for s in wanted])
        return []


def auto_paths(cfg: Config) -> list[str]:
    """`cluster.code=auto`: the directories and .py files that define the model's module(s) and
    that the workers may lack."""
    out: list[str] = []
    for top in _top_modules(cfg):
        for path in _sources(top):
            if path not in out and not _installed(path) and not _shipped_by_ray(path):
                out.append(path)
    return out


def own_outputs(cfg: Config, root: Path) -> tuple[str, ...]:
    """What rayhybrid writes that a directory shipped may hold: Hydra's default run roots
    (outputs/, multirun/), this run's directory and a local checkpoint.dir."""
    out = ["/outputs/", "/multirun/"]
    for path in (cfg.run_dir, cfg.checkpoint.dir):
        if path and "://" not in path:
            resolved = Path(path).expanduser().resolve()
            if resolved != root and resolved.is_relative_to(root):
                out.append(f"/{resolved.relative_to(root).as_posix()}/")
    return tuple(out)


def inherited(cfg: Config, shipped: list[Shipment]) -> Config:
    """The config for an actor started with the shipped code's runtime environment: what it
    starts inherits the code (`cluster.code=off`; a directory given may exist only on the
    driver's node)."""
    if not shipped:
        return cfg
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, code="off"))


def runtime_env(shipped: list[Shipment], env_vars: dict[str, str] | None = None) -> dict | None:
    """The workers' runtime environment: `shipped` uploaded (if not there already) and named by
    its URIs, after the job's own `py_modules`, and `env_vars`; None when empty. Needs Ray."""
    out: dict = {}
    if shipped:
        try:
            out = _upload(shipped)
        except PackagingChanged as err:
            shipping_off(err, [s.path for s in shipped])
        if "py_modules" in out:
            job = _current_runtime_env().get("py_modules") or []
            out["py_modules"] = [*job, *[uri for uri in out["py_modules"] if uri not in job]]
    if env_vars:
        out["env_vars"] = dict(env_vars)
    return out or None


# -- what auto ships ------------------------------------------------------------------------------


def _top_modules(cfg: Config) -> list[str]:
    """The top-level names of the model's module: `model.module`, and `model.spec`'s module
    (module:attribute) where the config has one."""
    names = [cfg.model.module, str(getattr(cfg.model, "spec", "") or "").split(":")[0]]
    tops = [name.strip().split(".")[0] for name in names if name and name.strip()]
    return [top for i, top in enumerate(tops) if top and top != "rayhybrid" and top not in tops[:i]]


def _sources(top: str) -> list[str]:
    """Where top-level module `top` lives, without importing it: its package's directories (a
    namespace package may have several) or its .py file; nothing for a compiled or missing one
    (the model's own checks name a missing one)."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return [str(Path(p).resolve()) for p in spec.submodule_search_locations]
    if spec.origin and spec.origin.endswith(".py"):
        return [str(Path(spec.origin).resolve())]
    if spec.origin and spec.origin not in ("built-in", "frozen") and not _installed(spec.origin):
        log.warning("cluster.code: %s is compiled (%s) and is not shipped; install it on every node", top, spec.origin)
    return []


def _install_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = [paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths]
    roots += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    roots.append(site.getusersitepackages())
    return [Path(root).resolve() for root in roots if root]


def _installed(path: str) -> bool:
    """Installed with the interpreter (the standard library, site-packages): every node of a
    working cluster has its own copy."""
    resolved = Path(path).resolve()
    if {"site-packages", "dist-packages"} & set(resolved.parts):
        return True
    return any(resolved.is_relative_to(root) for root in _install_roots())


def _shipped_by_ray(path: str) -> bool:
    """Unpacked from a runtime environment (a Ray Job's working_dir or py_modules): the workers
    inherit that environment."""
    return "runtime_resources" in Path(path).parts


# -- sizes ---------------------------------------------------------------------------------------


def _excludes() -> list[str]:
    """Ray's default excludes (`.git`, `__pycache__`, ...), which it applies to a working_dir;
    given to py_modules too, so that both ship the same kind of tree."""
    from ray._private.ray_constants import get_runtime_env_default_excludes

    return get_runtime_env_default_excludes()


def _include_gitignore() -> bool:
    from ray._private.ray_constants import RAY_RUNTIME_ENV_IGNORE_GITIGNORE

    return os.environ.get(RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"


def packed_files(path: str, excludes: tuple[str, ...] = ()) -> list[tuple[Path, int]]:
    """The files Ray packs of `path` (its own walk: its default excludes and `excludes`,
    `.gitignore`, `.rayignore`), with their sizes in bytes."""
    root = Path(path)
    if root.is_file():
        return [(root, root.stat().st_size)]
    found: list[tuple[Path, int]] = []

    def visit(p: Path) -> None:
        if p.is_file():
            found.append((p, p.stat().st_size))

    with _ray_packaging():  # `visit` raises none of RAY_CHANGED
        from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

        patterns = [_get_excludes(root, [*_excludes(), *excludes])]
        _dir_travel(root, patterns, visit, include_gitignore=_include_gitignore(), logger=_RAY_LOG)
    return found


def _measured(s: Shipment, max_file_mb: float) -> Shipment:
    files = packed_files(s.path, s.excludes)
    check_sizes(s.path, files, max_file_mb)
    return dataclasses.replace(s, files=len(files), bytes=sum(size for _, size in files))


def check_sizes(path: str, files: list[tuple[Path, int]], max_file_mb: float) -> None:
    """A file over `max_file_mb` (MB of 2**20 bytes) would go to every node with each run: a
    one-line ConfigError naming the largest and the fixes."""
    limit = max_file_mb * 2**20
    big = sorted(((size, p) for p, size in files if size > limit), key=lambda f: (-f[0], str(f[1])))
    if not big:
        return
    root = Path(path)
    base = root.parent if root.is_file() else root
    names = ", ".join(f"{_relative(p, base)} ({_mb(size)})" for size, p in big[:3])
    more = f" and {len(big) - 3} more" if len(big) > 3 else ""
    move = "" if root.is_file() else f"move them out or list them in {base / '.rayignore'}, "
    raise ConfigError(
        "cluster.code_max_file_mb",
        f"{path} would ship {len(big)} file(s) over {max_file_mb:g} MB to every node: {names}{more}; "
        f"{move}raise cluster.code_max_file_mb, or ship nothing with cluster.code=off",
    )


def _relative(p: Path, base: Path) -> str:
    try:
        return str(p.relative_to(base))
    except ValueError:
        return str(p)


def _mb(size: int) -> str:
    if size >= 2**20 / 10:
        return f"{size / 2**20:.1f} MB"
    return f"{size / 2**10:.1f} kB" if size >= 2**10 else f"{size} B"


# -- Ray -----------------------------------------------------------------------------------------


def _upload(shipped: list[Shipment]) -> dict:
    """Each shipment in the cluster (Ray's upload: pinned, skipped when the same content is
    there already); {"py_modules": [uri, ...], "working_dir": uri}. Logs what it ships, once."""
    from ray.exceptions import RuntimeEnvSetupError

    with _ray_packaging():
        from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
        from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

        scratch, gitignore = tempfile.gettempdir(), _include_gitignore()
    out: dict = {}
    for s in shipped:
        try:
            if s.field == "py_modules":
                with _ray_packaging():
                    env = {"py_modules": [s.path], "excludes": [*_excludes(), *s.excludes]}
                    uri = upload_py_modules_if_needed(env, gitignore, scratch_dir=scratch, logger=_RAY_LOG)
                uri = uri["py_modules"][0]
                out.setdefault("py_modules", []).append(uri)
            else:
                env = {"working_dir": s.path, "excludes": list(s.excludes)}  # Ray adds its defaults
                with _ray_packaging():
                    uri = upload_working_dir_if_needed(env, gitignore, scratch_dir=scratch, logger=_RAY_LOG)
                uri = out["working_dir"] = uri["working_dir"]
        except (RuntimeEnvSetupError, ValueError, OSError) as err:  # ValueError: over Ray's own size limit
            raise ConfigError(
                "cluster.code",
                f"cannot ship {s.path} to the cluster ({one_line(err)}); leave out what the workers do not need "
                "(.rayignore), or set cluster.code=off and install the code on every node",
            ) from None
        if (s.path, uri) not in _announced:
            _announced.add((s.path, uri))
            files = f"{s.files} file{'' if s.files == 1 else 's'}"
            log.info("shipping %s to the workers (%s, %s; Ray %s)", s.path, files, _mb(s.bytes), s.field)
    return out


def _current_runtime_env() -> dict:
    """This process's runtime environment (the job's, on a driver): what its actors inherit."""
    import ray

    return dict(ray.get_runtime_context().runtime_env or {}) if ray.is_initialized() else {}


def check_code_setting(cfg: Config) -> None:
    """cluster.code: auto, off (the command line's false arrives as False) or a directory that
    exists here, on the driver; else a one-line ConfigError. An environment check (it looks at
    the file system): `rayhybrid.preflight.check_environment` runs it once per command."""
    value = str(cfg.cluster.code)
    if value.lower() in ("auto", *OFF):
        return
    path = os.path.expanduser(value)
    if os.path.isdir(path):
        return
    if os.path.exists(path):
        raise ConfigError(
            "cluster.code", f"{value} is a file; give the directory to ship (Ray's working_dir), auto or off"
        )
    if not value.strip() or not any(mark in value for mark in (os.sep, "/", ".", "~")):
        raise ConfigError(
            "cluster.code",
            f"unknown value {value!r} (neither auto, off nor an existing directory); "
            "choose auto, off, or a directory to ship (e.g. cluster.code=.)",
        )
    raise ConfigError("cluster.code", f"directory {value} does not exist; give an existing directory, auto or off")
