"""The checks before a run (rayhybrid/preflight.py), in two kinds: the config's own
(`check_config`: pure, no file, no network, no environment variable) and the environment's
(`check_environment`: data files and prepared datasets' index.json, stores, trackers' packages
and credentials, `cluster.code`'s directory). How often each runs per command is counted here:
the environment's once per command (per job of a sweep), never per candidate of a search."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import rayhybrid.data.checks  # noqa: F401 - imported before the file system is broken below
from rayhybrid.config.compose import compose, to_config
from rayhybrid.errors import ConfigError
from rayhybrid.preflight import check_config, check_environment, load_config
from tests.prepared import random_documents, write_dataset

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return write_dataset(tmp_path_factory.mktemp("ds") / "ds", random_documents(60, vocab_size=256), vocab_size=256)


class Counter:
    """Wraps a function of a module, counting its calls."""

    def __init__(self, monkeypatch, module, name: str, result=None):
        self.calls = 0
        real = getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return result if result is not None else real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


# -- which checks are which ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, setting, words",
    [
        (["data=text", "data.path=/no/such/book.txt"], "data.path", "no text file"),
        (["data=tokens", "data.path=/no/such/tokens.bin"], "data.path", "does not exist"),
        (["data=prepared", "data.path=/no/such/dataset"], "data.path", "index.json"),
        (["cluster.code=/no/such/dir"], "cluster.code", "does not exist"),
        (["checkpoint.dir=nope://bucket/x"], "checkpoint.dir", "unknown storage protocol"),
        (["metrics.mlflow.enabled=true", "metrics.mlflow.tracking_uri=sqlite:///db"], None, None),
    ],
)
def test_the_config_checks_read_nothing_and_the_environment_checks_refuse(monkeypatch, overrides, setting, words):
    """What the settings name in the world is the environment's to check: the config's checks
    pass such a config without opening a file, even with the file system's calls broken."""
    cfg = to_config(compose(overrides))

    def no_io(*args, **kwargs):
        raise AssertionError(f"the config's checks looked at the file system: {args}")

    with monkeypatch.context() as patch:
        for name in ("isfile", "isdir", "exists", "getsize"):
            patch.setattr(os.path, name, no_io)
        patch.setattr("builtins.open", no_io)
        patch.setattr("rayhybrid.data.checks.read_index", no_io)
        check_config(cfg)
    if setting is None:  # a database URI: refused only where mlflow-skinny lacks sqlalchemy
        return
    with pytest.raises(ConfigError) as err:
        check_environment(cfg)
    assert err.value.setting == setting and words in str(err.value)
    with pytest.raises(ConfigError) as again:  # the entry points' load_config: the same one line
        load_config(overrides)
    assert str(again.value) == str(err.value)


def test_a_bad_setting_is_the_configs_to_refuse():
    for overrides, setting in (
        (["topology.tp=3"], "topology.tp"),
        (["data=prepared", "data.val_fraction=0.1", "data.path=x"], "data.val_fraction"),
        (["metrics.wandb.enabled=true", "metrics.wandb.mode=onlin"], "metrics.wandb.mode"),
        (["data=text"], "data.path"),
    ):
        with pytest.raises(ConfigError) as err:
            check_config(to_config(compose(overrides)))
        assert err.value.setting == setting


# -- how often, per command ---------------------------------------------------------------------

COUNTING = """
import json, sys
from rayhybrid.data import checks
from rayhybrid.driver import controller
from rayhybrid.tracking import wandb

counts = {"index": 0, "credentials": 0, "runs": 0}
read_index = checks.read_index

def counted_read(*args, **kwargs):
    counts["index"] += 1
    return read_index(*args, **kwargs)

def credentials():
    counts["credentials"] += 1
    return True

class Controller:  # no Ray: a run that completes at once
    def __init__(self, cfg, started=None):
        counts["runs"] += 1
    def run(self):
        return {"status": "completed"}

checks.read_index = counted_read
wandb._wandb_credentials = credentials
controller.Controller = Controller
try:
    {call}
finally:
    print("COUNTS " + json.dumps(counts))
"""


def counted(call: str, cwd: Path) -> dict:
    code = textwrap.dedent(COUNTING).replace("{call}", call)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("COUNTS ")]
    assert lines, proc.stdout + proc.stderr
    return {**json.loads(lines[-1][len("COUNTS ") :]), "rc": proc.returncode, "stderr": proc.stderr}


def run_overrides(dataset: str, tmp_path: Path) -> list[str]:
    """A run that reads a prepared dataset and logs to W&B online (credentials faked)."""
    return [
        "data=prepared",
        f"data.path={dataset}",
        "data.seq_len=16",
        "model.vocab_size=256",
        "metrics.wandb.enabled=true",
        "metrics.wandb.mode=online",
        f"hydra.run.dir={tmp_path}/run",
    ]


@pytest.mark.slow
def test_python_m_rayhybrid_checks_the_environment_once(dataset, tmp_path):
    """index.json read and the W&B credentials looked up once per command (they were twice
    before the driver started, and the trackers' checks a third time when it opened them)."""
    args = run_overrides(dataset, tmp_path)
    counts = counted(f"from rayhybrid.__main__ import main; main({args!r})", tmp_path)
    assert counts["rc"] == 0, counts["stderr"]
    assert (counts["runs"], counts["index"], counts["credentials"]) == (1, 1, 1)


@pytest.mark.slow
def test_a_sweep_checks_each_job_once(dataset, tmp_path):
    args = ["-m", "train.lr=1e-3,2e-3", *run_overrides(dataset, tmp_path)]
    args[-1] = f"hydra.sweep.dir={tmp_path}/sweep"
    counts = counted(f"from rayhybrid.__main__ import main; main({args!r})", tmp_path)
    assert counts["rc"] == 0, counts["stderr"]
    assert (counts["runs"], counts["index"], counts["credentials"]) == (2, 2, 2)


@pytest.mark.slow
def test_train_and_plan_check_the_environment_once(dataset, tmp_path):
    overrides = run_overrides(dataset, tmp_path)[:-1]
    counts = counted(f"import rayhybrid; rayhybrid.train({overrides!r}, run_dir={str(tmp_path / 'run')!r})", tmp_path)
    assert (counts["rc"], counts["runs"], counts["index"], counts["credentials"]) == (0, 1, 1, 1), counts["stderr"]
    counts = counted(f"from rayhybrid.plan.__main__ import main; main({overrides!r})", tmp_path)
    assert (counts["rc"], counts["index"], counts["credentials"]) == (0, 1, 1), counts["stderr"]


# -- never per search candidate -----------------------------------------------------------------


def tune_config(dataset: str, *more: str):
    overrides = ["+topology=dp2_pp2_tp2", "data=prepared", f"data.path={dataset}", "data.seq_len=16"]
    return load_config([*overrides, "model.vocab_size=256", *more])


def test_a_layout_search_reads_no_index_per_candidate(dataset, monkeypatch):
    from rayhybrid.data import checks
    from rayhybrid.tune.layout import LayoutPlan

    cfg = tune_config(dataset, "tune.search=layout")
    reads = Counter(monkeypatch, checks, "read_index")
    plan = LayoutPlan(cfg, devices=8, devices_per_node=8, global_batch=16, budget_mb=64)
    assert len(plan.planned) > 20  # candidates were checked...
    assert reads.calls == 0  # ... without reading the dataset again


def test_tune_main_checks_the_environment_once(dataset, monkeypatch, tmp_path):
    """`python -m rayhybrid.tune`'s checks before Ray starts: the tune section and the trials'
    configs (the config's checks), then the data the trials share, read once."""
    from rayhybrid.data import checks
    from rayhybrid.tune import run

    reads = Counter(monkeypatch, checks, "read_index")
    seen = []
    monkeypatch.setattr(run, "run_tune", lambda cfg, overrides: seen.append(cfg) or {})
    overrides = ["+topology=pp2", "data=prepared", f"data.path={dataset}", "data.seq_len=16", "model.vocab_size=256"]
    for search in (["tune.global_batch_size=16"], [], ["tune.search=layout", "tune.devices=4"]):
        reads.calls = 0
        run.tune_main([*overrides, "tune.memory_budget_mb=64", *search], run_dir=tmp_path / "tune")
        assert reads.calls == 1, search
    assert len(seen) == 3
    with pytest.raises(ConfigError, match="data.path"):  # what the trials share, refused in one line
        run.tune_main(["data=prepared", "data.path=/no/such/dataset", "tune.memory_budget_mb=64"], run_dir=tmp_path)
    # a micro-batch search's candidates: batch_sizes and the plan read nothing
    cfg = tune_config(dataset, "tune.global_batch_size=16", "tune.memory_budget_mb=64")
    reads.calls = 0
    run.check_tune(cfg)
    run.micro_batch_plan(cfg, 64.0, cuda=False, metric="tokens_per_s")
    assert reads.calls == 0
