"""The ready-made recipes (`conf/experiment/`, `+experiment=...`), the development runs
(`conf/debug/`, `+debug=...`), the custom `--help`, and sweeps (`-m`).

The recipes are for GPU clusters, so here they are composed, validated and planned, not
trained: `rayhybrid.plan` must predict that every rank fits the GPUs of the cluster each one
names. The debug runs and a sweep of them train end to end (tests marked `slow`).
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import pytest
import yaml

from rayhybrid.config.compose import available_options, compose
from rayhybrid.config.schema import with_dp
from rayhybrid.config.validate import usable_dps
from rayhybrid.errors import ConfigError
from rayhybrid.plan.dry_run import build_plan
from rayhybrid.preflight import load_config
from tests.test_cli import REPO, assert_one_line_error, run_cli

CONF = REPO / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
DEBUGS = sorted(p.stem for p in (CONF / "debug").glob("*.yaml"))

MIB_PER_GB = 1024
# Each recipe's GPU: the A100 40GB of examples/elastic_cluster.yaml's p4d.24xlarge nodes, and
# the H100 80GB nodes the Llama recipe is written for. The plan counts tensors only (no CUDA
# context, NCCL buffers or allocator fragmentation): it must leave 15% of the GPU to those.
GPU_MIB = {
    "gpt3_xl_elastic": 40 * MIB_PER_GB,
    "llama3.1_8b_2x8": 80 * MIB_PER_GB,
    "llama3.2_1b_prepared": 80 * MIB_PER_GB,
}
HEADROOM = 0.85
GPUS_PER_NODE = 8


def header(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    return lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]


def token_file(tmp_path: Path, cfg_overrides: list[str]) -> Path:
    """A raw token file (sparse: no disk used) large enough for the recipe's windows and its
    held-out tail, in the dtype the recipe reads."""
    data = compose(cfg_overrides).data
    assert data.val_fraction == 0.001  # the last 0.1% is held out: it must hold a window too
    itemsize = {"uint16": 2, "uint32": 4}[data.token_dtype]
    windows = data.seq_len + 1
    tokens = int(windows / data.val_fraction) + 10 * windows
    path = tmp_path / f"tokens_{data.token_dtype}.bin"
    with open(path, "wb") as f:
        f.truncate(tokens * itemsize)
    return path


def prepared_dataset(tmp_path: Path, cfg_overrides: list[str]) -> Path:
    """A prepared dataset of Llama 3 ids (uint32) with 1% of its documents held out, each part
    holding windows of the recipe's length."""
    from tests.prepared import random_documents, write_dataset

    data = compose(cfg_overrides).data
    docs = random_documents(200, vocab_size=128256, lengths=(data.seq_len + 1, data.seq_len + 2))
    return Path(write_dataset(tmp_path / "prepared", docs, vocab_size=128256, held_out=0.01))


def filled(name: str, tmp_path: Path) -> list[str]:
    """`+experiment=<name>` with its two mandatory settings given."""
    base = [f"+experiment={name}"]
    data = compose(base).data
    path = prepared_dataset(tmp_path, base) if data.name == "prepared" else token_file(tmp_path, base)
    return [*base, f"data.path={path}", f"checkpoint.dir={tmp_path / 'ckpt'}"]


def test_the_groups_hold_the_shipped_files():
    assert {"gpt3_xl_elastic", "llama3.1_8b_2x8"} <= set(EXPERIMENTS) == set(available_options("experiment"))
    assert {"fast", "trace"} <= set(DEBUGS) == set(available_options("debug"))
    assert set(GPU_MIB) == set(EXPERIMENTS), "a new recipe needs its GPU memory here"


@pytest.mark.parametrize("group, name", [("experiment", n) for n in EXPERIMENTS] + [("debug", n) for n in DEBUGS])
def test_every_file_has_a_header_saying_what_it_is_and_how_to_run_it(group, name):
    lines = header(CONF / group / f"{name}.yaml")
    assert lines[0] == "# @package _global_"
    text = "\n".join(lines)
    assert len(lines) >= 8, text
    assert f"python -m rayhybrid +{group}={name}" in text
    if group == "experiment":
        assert "Cluster:" in text and "GPU" in text  # the cluster it expects
        assert "data.path=" in text and "checkpoint.dir=" in text  # what must be given


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_the_command_in_an_experiments_header_is_valid(name, tmp_path):
    """The header's command line, with its data and checkpoint places replaced by ones that
    exist here, composes and validates (cluster.address=auto is not contacted by validation)."""
    (line,) = [ln for ln in header(CONF / "experiment" / f"{name}.yaml") if f"rayhybrid +experiment={name}" in ln]
    args = shlex.split(line.split("python -m rayhybrid", 1)[1])
    given = dict(a.split("=", 1) for a in filled(name, tmp_path)[1:])

    def key(arg: str) -> str:
        return arg.split("=", 1)[0]

    args = [f"{key(a)}={given[key(a)]}" if key(a) in given else a for a in args]
    assert {key(a) for a in args} >= {"+experiment", "data.path", "checkpoint.dir", "cluster.address"}
    cfg = load_config(args)
    assert cfg.data.path == given["data.path"]


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_an_experiment_fits_its_gpus_by_the_plan(name, tmp_path):
    cfg = load_config(filled(name, tmp_path))
    t, tr = cfg.topology, cfg.train
    assert tr.dtype == "bfloat16" and str(cfg.cluster.use_gpu).lower() == "true"
    assert cfg.eval.every > 0 and cfg.eval.batches > 0
    assert cfg.data.val_fraction > 0 or cfg.data.name == "prepared"  # prepared: held out when prepared
    assert cfg.checkpoint.keep_best and cfg.checkpoint.every % cfg.eval.every == 0
    assert t.tp <= GPUS_PER_NODE and GPUS_PER_NODE % t.tp == 0  # a tensor-parallel group inside a node
    tokens_per_step = tr.global_batch_size * cfg.data.seq_len

    budget = GPU_MIB[name] * HEADROOM
    dps = usable_dps(cfg) if cfg.elastic.enabled else [t.dp]
    assert dps
    for dp in dps:
        plan = build_plan(with_dp(cfg, dp))
        assert plan["memory"]["device"] == "cuda"
        # What must fit the card: the caching allocator's reserved peak (live bytes and its reserve).
        worst = plan["memory"]["max_reserved_mb"]
        assert 0 < worst <= budget, f"dp={dp}: {worst:,.0f} MiB reserved by the plan, over {budget:,.0f} ({name})"
        assert max(plan["memory"]["per_rank_total_mb"]) == plan["memory"]["max_mb"] < worst

    if name == "gpt3_xl_elastic":
        # GPT-3 XL as in Brown et al. 2020: ~1M tokens a step, lr 2e-4, sequences of 2048.
        assert cfg.model.flavor == "gpt3_xl" and cfg.data.seq_len == 2048
        assert abs(tokens_per_step - 2**20) / 2**20 < 0.1 and tr.lr == 2e-4 and tr.decay == "cosine"
        # On examples/elastic_cluster.yaml: one replica per 8-GPU node, dp as its worker count.
        cluster = yaml.safe_load((REPO / "examples" / "elastic_cluster.yaml").read_text())
        workers = cluster["available_node_types"]["gpu_worker"]
        assert workers["node_config"]["InstanceType"] == "p4d.24xlarge"  # 8 x A100 40GB
        assert t.pp * t.tp == GPUS_PER_NODE and cfg.elastic.enabled
        assert cfg.elastic.dp_range(t.dp) == (workers["min_workers"], workers["max_workers"])
        assert dps == [1, 2, 3, 4], "every replica count the cluster can have splits the global batch"
    elif name == "llama3.2_1b_prepared":
        # Llama 3.2 1B on one node of 8, on a prepared dataset that holds documents out.
        assert cfg.model.flavor == "llama3.2_1b" and cfg.data.name == "prepared" and cfg.data.read_ahead > 0
        assert t.dp == GPUS_PER_NODE and t.pp == 1 and cfg.data.seq_len == 2048 and tokens_per_step == 2**19
    else:
        # Llama 3.1 8B on 2 nodes of 8: 16 ranks.
        assert cfg.model.flavor == "llama3.1_8b" and cfg.model.init_from == ""
        assert t.dp * t.pp * t.tp == 2 * GPUS_PER_NODE and not cfg.elastic.enabled
        assert tr.lr == 3e-4 and tr.decay == "cosine" and cfg.data.token_dtype == "uint32"
        assert cfg.data.seq_len in (2048, 8192) and tokens_per_step >= 2**20


@pytest.mark.parametrize(
    "extra",
    [[], ["+topology=dp2_pp2_tp2"], ["+topology=pp4"], ["+topology=pp2_zbv"], ["model=llama3_debug", "+topology=pp2"]],
)
@pytest.mark.parametrize("name", DEBUGS)
def test_a_debug_run_composes_under_any_shipped_topology(name, extra):
    cfg = load_config([f"+debug={name}", *extra])
    assert cfg.train.steps <= 20 and cfg.train.log_every == 1 and cfg.model.n_layers <= 4
    if name == "fast":
        assert cfg.train.steps == 20 and (cfg.eval.every, cfg.eval.batches) == (5, 2)
        assert cfg.checkpoint.every == 10 and not cfg.metrics.memory
    if name == "trace":
        assert cfg.metrics.memory and cfg.metrics.trace_steps and cfg.checkpoint.every == 0


def test_settings_after_a_recipe_override_it(tmp_path):
    cfg = load_config([*filled("llama3.1_8b_2x8", tmp_path), "train.lr=1e-4", "topology.dp=1", "+debug=fast"])
    assert cfg.train.lr == 1e-4 and cfg.topology.dp == 1 and cfg.topology.tp == 8
    assert cfg.train.steps == 20 and cfg.model.flavor == "llama3.1_8b"  # +debug=fast after it wins
    assert load_config(["experiment=gpt3_xl_elastic", *filled("gpt3_xl_elastic", tmp_path)[1:]]).model.n_layers == 24


def test_required_settings_and_unknown_sections_are_one_line_errors():
    """`${required:...}` marks a setting the user must give (`???` cannot: merged over a schema
    field with a default, OmegaConf keeps the default); a key outside the schema is named."""
    with pytest.raises(ConfigError, match=r"^checkpoint\.dir: is required \(a bucket\); add checkpoint\.dir=\.\.\. "):
        load_config(["checkpoint.dir=${required:'a bucket'}"])
    with pytest.raises(ConfigError, match="^data.path: data=tokens needs data.path"):
        load_config(["data=tokens"])
    with pytest.raises(ConfigError, match="^foo: is not a setting of rayhybrid"):
        load_config(["+foo=1"])


@pytest.mark.parametrize(
    "name, given, missing",
    [
        ("gpt3_xl_elastic", [], ["data.path", "checkpoint.dir"]),
        ("gpt3_xl_elastic", ["data.path"], ["checkpoint.dir"]),
        ("llama3.1_8b_2x8", ["data.path"], ["checkpoint.dir"]),
        ("llama3.1_8b_2x8", ["checkpoint.dir"], ["data.path"]),
    ],
)
def test_a_missing_placeholder_stops_at_once_in_one_line(name, given, missing, tmp_path):
    values = dict(a.split("=", 1) for a in filled(name, tmp_path)[1:])
    run_dir = tmp_path / "run"
    started = time.monotonic()
    proc = run_cli(
        [f"+experiment={name}", *(f"{k}={values[k]}" for k in given), f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        timeout=60,
    )
    line = assert_one_line_error(proc, f"{missing[0]}: is required", *(f"{k}=..." for k in missing))
    for key in given:
        assert f"{key}=" not in line
    assert time.monotonic() - started < 30
    assert not run_dir.exists(), "the check must come before Hydra makes a run directory (and Ray starts)"
    assert proc.stdout == ""


def test_help_is_rayhybrids_own(tmp_path):
    proc = run_cli(["--help"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("rayhybrid: train PyTorch models")
    assert "Powered by Hydra" not in out and "is powered by Hydra" not in out
    for group in ("data", "debug", "experiment", "model", "topology"):  # $APP_CONFIG_GROUPS: group: a, b, ...
        listed = next(line for line in out.splitlines() if line.startswith(f"{group}: "))
        assert set(listed.split(": ", 1)[1].split(", ")) == set(available_options(group)), listed
    for command in ("python -m rayhybrid.plan", "python -m rayhybrid.tune", "python -m rayhybrid.export", "-m "):
        assert command in out
    for setting in ("+topology=", "+experiment=", "+debug=fast", "train.", "eval.every", "checkpoint.dir", "elastic."):
        assert setting in out
    assert "--hydra-help" in out and not proc.stderr
    assert not list(tmp_path.iterdir()), "help runs nothing"

    hydra = run_cli(["--hydra-help"], cwd=tmp_path, timeout=60)
    assert hydra.returncode == 0 and "Hydra (" in hydra.stdout and "--multirun" in hydra.stdout
    for module in ("rayhybrid.plan", "rayhybrid.tune"):  # they parse their own arguments
        own = run_cli(["--help"], cwd=tmp_path, timeout=60, module=module)
        assert own.returncode == 0 and own.stdout.startswith(f"`python -m {module}"), own.stdout + own.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["train.lr=abc"], ["train.lr=abc", "Float"]),
        (["train.lr=1e-3,abc"], ["train.lr=abc", "sweep job #1"]),  # the good job #0 does not run first
        (["+topology=tp2", "model.n_heads=3,4"], ["model.n_heads=3", "sweep job #0"]),
        (["+experiment=gpt3_xl_elastic"], ["data.path: is required"]),
        (["+debug=fast,nope"], ["debug", "no preset named 'nope'"]),
    ],
)
def test_a_bad_sweep_stops_before_any_job_in_one_line(args, words, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(["-m", *args, f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path, timeout=60)
    assert_one_line_error(proc, *words)
    assert not sweep_dir.exists()


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_debug_fast_trains_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(["+debug=fast", f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len([line for line in proc.stdout.splitlines() if line.startswith("step ")]) == 20  # log every step
    records = _records(run_dir)
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, 21))
    assert all(r["consumed_samples"] == 8 * r["step"] and r["num_microbatches"] == 4 for r in steps)
    assert [r["step"] for r in records if r.get("event") == "checkpoint"] == [10, 20]
    assert all("peak_mb" not in r for r in steps)  # metrics.memory off
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 20
    assert summary["final_loss"] < summary["initial_loss"]


@pytest.mark.slow
def test_a_multirun_sweeps_the_learning_rate_one_run_and_one_ray_per_job(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(["-m", "+debug=fast", "train.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1"]
    nodes = []
    for num, lr in ((0, 1e-3), (1, 3e-3)):
        job = sweep_dir / str(num)
        summary = json.loads((job / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["steps"] == 20
        assert yaml.safe_load((job / ".hydra" / "config.yaml").read_text())["train"]["lr"] == lr
        assert f"train.lr={lr}" in yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        steps = [r for r in _records(job) if "event" not in r]
        assert [r["step"] for r in steps] == list(range(1, 21))
        assert max(r["lr"] for r in steps) == pytest.approx(lr)  # the peak, after warmup
        nodes.append({w["node_id"] for w in json.loads((job / "workers.json").read_text())})
    # Each job started a local Ray of its own and shut it down: a second job in the same
    # process would otherwise reuse the first one's (same node) or fail to start.
    assert nodes[0].isdisjoint(nodes[1])
    assert proc.stdout.count("done: 20 steps") == 2


def test_a_recipe_from_the_users_own_config_dir_is_hydras_to_compose(tmp_path):
    """`--config-dir DIR +experiment=mine`: the checks before Hydra compose rayhybrid's own
    conf/ only, so with --config-dir they leave composing to Hydra (they used to take DIR for
    an override: "Error parsing override"). Here the user's recipe sets train.steps=0, which
    the run's own validation stops, in one line, before Ray."""
    recipes = tmp_path / "conf" / "experiment"
    recipes.mkdir(parents=True)
    (recipes / "mine.yaml").write_text("# @package _global_\ntrain:\n  steps: 0\n")
    proc = run_cli(
        ["--config-dir", str(tmp_path / "conf"), "+experiment=mine", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "rayhybrid: error: train.steps: must be positive, got 0; set train.steps=1 or more"
    )
