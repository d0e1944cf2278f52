"""The model's code on every node (`cluster.code`, rayhybrid/cluster/code.py).

Quick, no Ray: what `auto` ships (nothing for a built-in, installed or rayhybrid module, or one
a Ray Job already shipped; the top-level package directory of one in a plain directory; a
single-file module's file), `off` and a directory, the refusal of a file over
`cluster.code_max_file_mb` (one line naming it; `.rayignore` leaves it out), and the config's
checks of `cluster.code`.

Slow, one 2-node `ray.cluster_utils.Cluster`: a copy of examples/custom_model/tiny_parallel
under another name, in a temporary directory that only the driver has on its `sys.path` (Ray
passes the workers the driver's working directory, this checkout, and the script's own
directory; the test's directory is neither, and no PYTHONPATH names it), trains under dp2, one
rank per node: each rank imported the module from Ray's runtime_resources. With
`cluster.code=off` the same run stops with the workers' one-line `cannot import`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import rayhybrid
from rayhybrid.cluster import code
from rayhybrid.config.schema import ClusterConfig, Config, ModelConfig
from rayhybrid.errors import ConfigError
from rayhybrid.preflight import load_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "custom_model" / "tiny_parallel"


def cfg_for(module: str = "", code_setting: str = "auto", max_mb: float = 10.0) -> Config:
    return Config(model=ModelConfig(module=module), cluster=ClusterConfig(code=code_setting, code_max_file_mb=max_mb))


def write(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def sparse(path: Path, mb: float) -> Path:
    """A file of `mb` MB that takes no disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(int(mb * 2**20))
    return path


# ------------------------------------------------------------------------------------------
# Quick: what is shipped (no Ray)


@pytest.mark.parametrize("module", ["", "omegaconf", "json", "rayhybrid.models.gpt"])
def test_builtin_installed_stdlib_and_rayhybrid_modules_ship_nothing(module):
    assert code.shipment(cfg_for(module)) == []


def test_a_package_in_a_directory_ships_its_top_level_directory(tmp_path, monkeypatch):
    src = tmp_path / "src"
    write(src / "ship_pkg_a" / "__init__.py")
    write(src / "ship_pkg_a" / "sub" / "__init__.py")
    write(src / "ship_pkg_a" / "sub" / "model.py", "SPEC = None\n")
    write(src / "ship_pkg_a" / "__pycache__" / "model.cpython-311.pyc", "x")  # Ray's default excludes
    write(src / "ship_pkg_a" / "notes.txt", "ignored\n")
    write(src / "ship_pkg_a" / ".rayignore", "notes.txt\n")
    monkeypatch.syspath_prepend(str(src))
    (shipped,) = code.shipment(cfg_for("ship_pkg_a.sub.model"))
    assert (shipped.path, shipped.field) == (str((src / "ship_pkg_a").resolve()), "py_modules")
    files = sorted(str(p.relative_to(src)) for p, _ in code.packed_files(shipped.path))
    assert files == [
        "ship_pkg_a/.rayignore",
        "ship_pkg_a/__init__.py",
        "ship_pkg_a/sub/__init__.py",
        "ship_pkg_a/sub/model.py",
    ]
    assert shipped.files == 4 and shipped.bytes == sum((src / f).stat().st_size for f in files)
    assert code.shipment(cfg_for("ship_pkg_a.sub.model", "off")) == []
    assert code.shipment(cfg_for("ship_pkg_a.sub.model", "False")) == []  # the command line's false


def test_a_single_file_module_ships_the_file(tmp_path, monkeypatch):
    write(tmp_path / "ship_single_b.py", "SPEC = None\n")
    write(tmp_path / "neighbour.txt")  # not shipped: only the module's file is
    monkeypatch.syspath_prepend(str(tmp_path))
    (shipped,) = code.shipment(cfg_for("ship_single_b"))
    assert shipped == code.Shipment(str((tmp_path / "ship_single_b.py").resolve()), "py_modules", 1, 12)


def test_a_module_a_ray_job_shipped_already_ships_nothing(tmp_path, monkeypatch):
    """A Ray Job's working_dir or py_modules unpack under runtime_resources; its workers
    inherit the job's runtime environment."""
    root = tmp_path / "session" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123"
    write(root / "ship_job_c" / "__init__.py")
    monkeypatch.syspath_prepend(str(root))
    assert code.auto_paths(cfg_for("ship_job_c")) == []


def test_a_directory_is_shipped_as_working_dir_without_rayhybrids_outputs(tmp_path):
    proj = tmp_path / "proj"
    write(proj / "train_helpers.py")
    write(proj / "src" / "outputs" / "kept.py")  # only the top-level outputs/ is Hydra's
    write(proj / "outputs" / "2026-01-01" / "12-00-00" / "metrics.jsonl")  # earlier runs
    write(proj / "runs" / "this" / "metrics.jsonl")  # this run's directory
    write(proj / "ckpt" / "step_00000001" / "shard.distcp")  # a local checkpoint.dir
    cfg = replace(cfg_for("", str(proj)), run_dir=str(proj / "runs" / "this"))
    cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, dir=str(proj / "ckpt")))
    (shipped,) = code.shipment(cfg)
    assert (shipped.path, shipped.field) == (str(proj.resolve()), "working_dir")
    files = sorted(str(p.relative_to(proj)) for p, _ in code.packed_files(shipped.path, shipped.excludes))
    assert files == ["src/outputs/kept.py", "train_helpers.py"] and shipped.files == 2


def test_a_changed_ray_packaging_turns_shipping_off_with_one_warning_naming_the_fix(tmp_path, monkeypatch, caplog):
    """Ray's private packaging changed its signature (measuring) or moved (uploading): shipping
    is off, the run goes on, and one warning line names the fixes, once per cause."""
    from ray._private.runtime_env import packaging, py_modules

    monkeypatch.setattr(code, "_warned", set())
    monkeypatch.setattr(packaging, "_dir_travel", lambda path, excludes, handler: None)  # no include_gitignore
    proj = tmp_path / "proj"
    write(proj / "train_helpers.py")
    caplog.set_level(logging.WARNING, logger="rayhybrid")
    assert code.shipment(cfg_for("", str(proj))) == []
    assert code.shipment(cfg_for("", str(proj))) == []  # the same cause: no second line
    monkeypatch.delattr(py_modules, "upload_py_modules_if_needed")
    shipped = [code.Shipment(str(proj / "train_helpers.py"), "py_modules", 1, 10)]
    assert code.runtime_env(shipped, {"A": "1"}) == {"env_vars": {"A": "1"}}
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and all("\n" not in w for w in warnings), warnings
    assert "TypeError" in warnings[0] and "ImportError" in warnings[1]
    for warning, path in zip(warnings, (proj.resolve(), proj / "train_helpers.py"), strict=True):
        assert warning.startswith("cluster.code: shipping is off") and f"install {path} on every node" in warning
        assert "ray==2.60" in warning


def test_a_bug_of_rayhybrids_own_around_rays_packaging_is_not_taken_for_a_changed_ray(tmp_path, monkeypatch):
    """Only Ray's own packaging calls turn shipping off: a TypeError in rayhybrid's size check
    raises as it is, never hidden as "Ray changed" (the run would fail later, on the workers)."""

    def broken(*args):
        raise TypeError("a bug of rayhybrid's")

    monkeypatch.setattr(code, "check_sizes", broken)
    proj = tmp_path / "proj"
    write(proj / "train_helpers.py")
    with pytest.raises(TypeError, match="a bug of rayhybrid's"):
        code.shipment(cfg_for("", str(proj)))


def test_files_over_the_limit_are_refused_with_one_line_naming_them(tmp_path, monkeypatch):
    src = tmp_path / "src"
    write(src / "ship_big_d" / "__init__.py")
    sparse(src / "ship_big_d" / "weights.bin", 12)
    sparse(src / "ship_big_d" / "data" / "table.npy", 10.5)
    sparse(src / "ship_big_d" / "small.npy", 9.9)
    monkeypatch.syspath_prepend(str(src))
    with pytest.raises(ConfigError) as err:
        code.shipment(cfg_for("ship_big_d"))
    message = str(err.value)
    assert err.value.setting == "cluster.code_max_file_mb" and "\n" not in message
    assert "2 file(s) over 10 MB" in message, message
    assert "weights.bin (12.0 MB), data/table.npy (10.5 MB)" in message, message
    assert "small.npy" not in message and ".rayignore" in message and "cluster.code=off" in message
    # A directory given is held to the same limit.
    with pytest.raises(ConfigError, match=r"ship_big_d/weights\.bin \(12\.0 MB\)"):
        code.shipment(cfg_for("", str(src)))
    # A higher limit lets them through; what .rayignore leaves out is not shipped, so not refused.
    assert code.shipment(cfg_for("ship_big_d", max_mb=20))[0].files == 4
    write(src / "ship_big_d" / ".rayignore", "*.bin\ndata/\n")
    (shipped,) = code.shipment(cfg_for("ship_big_d"))
    assert shipped.files == 3  # __init__.py, small.npy, .rayignore


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("/no/such/dir", "directory /no/such/dir does not exist"),
        ("./missing_dir", "directory ./missing_dir does not exist"),
        ("sometimes", "unknown value 'sometimes'"),
        ("''", "unknown value ''"),
    ],
)
def test_config_checks_of_cluster_code(value, words):
    with pytest.raises(ConfigError) as err:
        load_config([f"cluster.code={value}"])
    assert err.value.setting == "cluster.code" and words in str(err.value) and "\n" not in str(err.value)


def test_config_accepts_auto_off_and_a_directory_and_refuses_a_file(tmp_path):
    for value in ("auto", "off", "false", str(tmp_path)):
        load_config([f"cluster.code={value}"])
    write(tmp_path / "a.py")
    with pytest.raises(ConfigError, match="a.py is a file"):
        load_config([f"cluster.code={tmp_path / 'a.py'}"])
    with pytest.raises(ConfigError, match="cluster.code_max_file_mb: must be positive"):
        load_config(["cluster.code_max_file_mb=0"])


def test_an_actor_started_with_the_code_passes_cluster_code_off_on():
    cfg = cfg_for("m", str(REPO))
    assert code.inherited(cfg, []) is cfg
    assert code.inherited(cfg, [code.Shipment(str(REPO), "working_dir")]).cluster.code == "off"


# ------------------------------------------------------------------------------------------
# Slow: a 2-node cluster whose workers have only rayhybrid

MODULE = "shipped_tiny_parallel"
RUN = [
    f"model.module={MODULE}",
    "+topology=dp2",
    "train.steps=3",
    "train.global_batch_size=2",
    "train.micro_batch_size=1",
    "data.seq_len=16",
    "checkpoint.every=0",
]
RECORDER = """

# Added by tests/test_code_shipping.py: each process that builds a stage says where it imported
# this package from.
import dataclasses as _dataclasses
import os as _os

_build_stage = SPEC.build_stage


def _recording_build_stage(*args, **kwargs):
    with open(_os.path.join({markers!r}, f"{{_os.getpid()}}.txt"), "w") as f:
        f.write(__file__)
    return _build_stage(*args, **kwargs)


SPEC = _dataclasses.replace(SPEC, build_stage=_recording_build_stage)
"""


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> tuple[Path, Path]:
    """The example model copied to <tmp>/src/shipped_tiny_parallel, on the driver's sys.path
    only; (src, markers)."""
    root = tmp_path_factory.mktemp("outside")
    src, markers = root / "src", root / "markers"
    shutil.copytree(EXAMPLE, src / MODULE, ignore=shutil.ignore_patterns("__pycache__"))
    markers.mkdir()
    init = src / MODULE / "__init__.py"
    init.write_text(init.read_text() + RECORDER.format(markers=str(markers)))
    assert not str(src).startswith(os.getcwd()) and str(src) not in os.environ.get("PYTHONPATH", "")
    sys.path.insert(0, str(src))
    yield src, markers
    sys.path.remove(str(src))
    for name in [m for m in sys.modules if m == MODULE or m.startswith(MODULE + ".")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def cluster(outside):
    from benchmarks.clusters import local_cluster

    with local_cluster(head_cpus=1, node_cpus=[1]) as (c, _):
        yield c


@pytest.mark.slow
def test_the_workers_import_the_shipped_package(cluster, outside, tmp_path, caplog):
    src, markers = outside
    caplog.set_level(logging.INFO, logger="rayhybrid.cluster.code")
    summary = rayhybrid.train(RUN, run_dir=tmp_path / "run")
    assert summary["status"] == "completed" and summary["steps"] == 3
    workers = json.loads((tmp_path / "run" / "workers.json").read_text())
    assert len({w["node_id"] for w in workers}) == 2, workers  # one rank on each node
    for w in workers:
        where = (markers / f"{w['pid']}.txt").read_text()
        assert "/runtime_resources/py_modules_files/_ray_pkg_" in where and where.endswith(f"/{MODULE}/__init__.py")
    files = [p for p in (src / MODULE).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    size = sum(p.stat().st_size for p in files) / 2**10
    line = f"shipping {(src / MODULE).resolve()} to the workers ({len(files)} files, {size:.1f} kB; Ray py_modules)"
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("shipping ")] == [line]


@pytest.mark.slow
def test_without_shipping_the_workers_cannot_import_it(cluster, outside, tmp_path):
    with pytest.raises(ConfigError) as err:
        rayhybrid.train([*RUN, "cluster.code=off"], run_dir=tmp_path / "run")
    assert err.value.setting == "model.module" and f"cannot import '{MODULE}'" in str(err.value)
    assert "on rank" in str(err.value)
