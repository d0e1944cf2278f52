"""A model defined outside rayhybrid (examples/custom_model/tiny_parallel), loaded with
`model.module=tiny_parallel`: it trains through the real CLI under dp2_pp2_tp2, its losses match
one process's under dp2 x pp2 x tp2, its own checks are one-line ConfigErrors, and a module that
is missing or has no SPEC stops the CLI with exit 2 and one line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rayhybrid.config.schema import Config, DataConfig, ModelConfig, TopologyConfig, TrainConfig
from rayhybrid.errors import ConfigError
from rayhybrid.preflight import load_config
from tests.distributed import first_step, run_configs, train_many

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "custom_model"
# In-process tests import the example like any installed package; the rank processes that
# `run_configs` spawns inherit sys.path.
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

MODULE = "model.module=tiny_parallel"


def run_cli(args: list[str], cwd: Path, timeout: float = 300, module: str = "rayhybrid") -> subprocess.CompletedProcess:
    """`python -m rayhybrid ...` from `cwd`, with this checkout and the example on PYTHONPATH
    (a local Ray's workers inherit the driver's environment)."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(EXAMPLE), env.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        check=False,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


# ------------------------------------------------------------------------------------------
# Quick: the spec, its checks, the model's contract (one process, no Ray)


def test_spec_module_imports_without_torch():
    code = (
        "import sys, tiny_parallel\n"
        "from rayhybrid.preflight import load_config\n"
        "load_config(['model.module=tiny_parallel', '+topology=dp2_pp2_tp2'])\n"
        "assert 'torch' not in sys.modules, 'the spec module imported torch'\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(EXAMPLE)])}
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("overrides", "setting", "words"),
    [
        (["topology.tp=3"], "topology.tp", "tp=3 does not divide model.n_heads=4"),
        (["topology.tp=2", "model.ffn_dim=99"], "topology.tp", "MLP width"),
        (["model.head_dim=8"], "model.head_dim", "does not use it"),
        (["model.n_kv_heads=2"], "model.n_kv_heads", "write model.options.n_kv_heads="),
        (["model.options.activation=tanh"], "model.options.activation", "gelu"),
        (["model.options.init_std=-1"], "model.options.init_std", "positive"),
        (["model.options.dropout=0.1"], "model.options.dropout", "unknown option"),
        # Its SPEC does not say it compiles (ModelSpec.compiles): refused before anything runs.
        (["train.compile=true"], "train.compile", "does not compile its blocks"),
        (["train.offload_activations=true"], "train.offload_activations", "does not offload"),
    ],
)
def test_the_examples_validate_gives_one_line_config_errors(overrides, setting, words):
    with pytest.raises(ConfigError) as err:
        load_config([MODULE, *overrides])
    assert err.value.setting == setting and words in str(err.value) and "\n" not in str(err.value)


def test_options_have_defaults_and_reach_the_model():
    import tiny_parallel
    from torch.nn import functional as F

    default = load_config([MODULE]).model
    assert default.options == {} and tiny_parallel.option(default, "activation") == "gelu"
    cfg = load_config([MODULE, "model.options.activation=relu", "model.options.init_std=0.5"]).model
    model = tiny_parallel.SPEC.build_stage(cfg, seq_len=16, layer_ids=range(4), first=True, last=True)
    model.init_weights(0)
    assert model.layers["0"].mixer.mlp.act is F.relu
    assert 0.4 < float(model.tok_embeddings.weight.detach().std()) < 0.6


def test_stages_keep_full_names_and_initial_values_and_the_counts_match():
    import tiny_parallel
    import torch

    cfg = load_config([MODULE]).model
    spec, seq = tiny_parallel.SPEC, 32
    whole = spec.build_stage(cfg, seq_len=seq, layer_ids=range(4), first=True, last=True)
    whole.init_weights(7)
    parts = [
        spec.build_stage(cfg, seq_len=seq, layer_ids=range(1), first=True, last=False),
        spec.build_stage(cfg, seq_len=seq, layer_ids=range(1, 3), first=False, last=False),
        spec.build_stage(cfg, seq_len=seq, layer_ids=range(3, 4), first=False, last=True),
    ]
    merged = {}
    for part in parts:
        part.init_weights(7)
        merged.update(part.state_dict())
    reference = whole.state_dict()
    assert list(merged) == list(reference)  # full names, each parameter on exactly one stage
    assert all(torch.equal(merged[k], reference[k]) for k in reference)
    assert sum(p.numel() for p in whole.parameters()) == spec.num_params(cfg, seq)
    assert spec.flops_per_token(cfg, seq) > spec.flops_per_token(cfg, seq, attention=False) > 0
    # The stages chain into the whole model.
    tokens = torch.randint(0, cfg.vocab_size, (2, seq))
    x = tokens
    for part in parts:
        x = part(x)
    torch.testing.assert_close(x, whole(tokens))


def test_plan_says_memory_is_not_modelled():
    from rayhybrid.plan import build_plan, format_text

    plan = build_plan(load_config([MODULE, "+topology=dp2_pp2_tp2"]))
    assert plan["memory"] is None and plan["communication"] is None and "ModelSpec.memory" in plan["not_modelled"]
    assert plan["config"]["model"] == "tiny_parallel" and plan["parameters"]["total"] == 233_792
    text = format_text(plan)
    assert "Not modelled: memory" in text and "Pipeline bubble" in text and "FLOPs" in text


@pytest.mark.parametrize(
    ("module", "words"),
    [
        ("no_such_package.model", ["model.module", "cannot import 'no_such_package.model'", "PYTHONPATH"]),
        ("json", ["model.module", "'json' has no SPEC", "examples/custom_model"]),
    ],
)
def test_cli_module_missing_or_without_spec_exits_2_with_one_line(tmp_path, module, words):
    proc = run_cli([f"model.module={module}", f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, timeout=120)
    line = one_line_error(proc)
    assert all(word in line for word in words), line
    assert not (tmp_path / "run").exists(), "validation must fail before a run directory is made"


# ------------------------------------------------------------------------------------------
# Slow: 8 ranks on a local Ray through the CLI; loss parity in plain processes


@pytest.mark.slow
def test_cli_trains_the_example_under_dp2_pp2_tp2(tmp_path):
    run_dir, steps = tmp_path / "run", 10
    args = [MODULE, "+topology=dp2_pp2_tp2", f"train.steps={steps}", "model.options.activation=silu"]
    proc = run_cli([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == steps
    assert summary["topology"]["world_size"] == 8
    assert summary["model"]["module"] == "tiny_parallel" and summary["model"]["options"] == {"activation": "silu"}
    assert summary["params"] == 233_792
    assert summary["final_loss"] < summary["initial_loss"] - 0.3, (summary["initial_loss"], summary["final_loss"])


@pytest.mark.slow
def test_a_module_the_workers_cannot_import_exits_2_with_one_line(tmp_path):
    """The driver imports the module (its sys.path has it) but the workers cannot (Ray hands
    them the driver's PYTHONPATH and working directory, not sys.path edits, and
    cluster.code=off ships nothing; tests/test_code_shipping.py ships it): one line naming
    model.module and the rank, exit 2, and no restarts that cannot help."""
    driver = "import sys; sys.path.insert(0, sys.argv.pop(1)); from rayhybrid.__main__ import main; main(sys.argv[1:])"
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            driver,
            str(EXAMPLE),
            MODULE,
            "cluster.code=off",
            "train.steps=2",
            f"hydra.run.dir={tmp_path}/run",
        ],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = one_line_error(proc)
    assert line.startswith("rayhybrid: error: model.module: cannot import 'tiny_parallel'"), line
    assert "on rank 0" in line, line
    records = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert '"restart"' not in records, records


STEPS = 6
BASE = Config(
    model=ModelConfig(module="tiny_parallel"),
    data=DataConfig(seq_len=32),
    train=TrainConfig(steps=STEPS, global_batch_size=8, micro_batch_size=1, warmup_steps=2),
    seed=0,
)


def topo(**topology) -> Config:
    return dataclasses.replace(BASE, topology=TopologyConfig(**topology))


@pytest.mark.slow
def test_loss_parity_dp1_vs_dp2_pp2_tp2():
    (ranks,) = run_configs(train_many, {"dp1": topo()}, STEPS)
    reference = [m["loss"] for m in ranks["dp1"]]
    world8 = {
        # FSDP2, logits sharded into the loss, recomputed blocks (the CLI test runs plain 1f1b).
        "dp2_pp2_tp2_shard_lp_ac_gpipe": dataclasses.replace(
            topo(dp=2, pp=2, tp=2, dp_shard=True, loss_parallel="true", schedule="gpipe"),
            train=dataclasses.replace(BASE.train, activation_checkpointing=True),
        ),
    }
    runs = run_configs(train_many, world8, STEPS, timeout=400)
    assert reference[-1] < reference[0] - 0.2, reference
    for label in world8:
        for rank, result in enumerate(runs):
            loss = [m["loss"] for m in result[label]]
            assert loss == pytest.approx(reference, rel=1e-5), f"rank {rank}, {label}: {loss} != {reference}"


def test_a_family_with_its_own_loss_trains_with_it():
    """`ModelSpec.loss`: a family that brings its own loss (tests/z_loss.py: the example with
    cross-entropy plus z-loss) is trained with it. The first step's loss is that loss of the
    step's batch computed directly, over its tokens, and not the default cross-entropy that the
    same model and batch give (and that a trainer ignoring the hook reports)."""
    import torch
    from torch.nn import functional as F

    from tests import z_loss

    cfgs = {"own": dataclasses.replace(BASE, model=ModelConfig(module="tests.z_loss")), "default": BASE}
    (ranks,) = run_configs(first_step, cfgs)
    logits, targets = ranks["own"]["logits"], ranks["own"]["targets"]
    # The same initial weights and batch: the family's loss is all that differs.
    assert torch.equal(logits, ranks["default"]["logits"]) and torch.equal(targets, ranks["default"]["targets"])
    assert targets.numel() == BASE.train.global_batch_size * BASE.data.seq_len
    flat = logits.flatten(0, 1).float()
    plain = float(F.cross_entropy(flat, targets.flatten()))
    own = plain + z_loss.Z_WEIGHT * float(flat.logsumexp(dim=-1).square().mean())
    assert own - plain > 0.1, (own, plain)
    assert ranks["own"]["loss"] == pytest.approx(own, rel=1e-5)
    assert ranks["default"]["loss"] == pytest.approx(plain, rel=1e-5)
