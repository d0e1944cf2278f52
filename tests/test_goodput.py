"""`python -m rayhybrid.goodput`: the simulator against Daly's closed form, its recommended
interval against that form's optimum (and Young's first-order one), its coupling to the
driver's own policies, the llama3 preset's ordering of strategies, the meta preset, costs from a
run directory (from_run), goodput.png, and the command line."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rayhybrid.config.goodput import STRATEGIES, compose_goodput, given
from rayhybrid.driver.policies import Decision, FailurePolicy, HealPolicy, ScalingPolicy
from rayhybrid.driver.wallclock import CAUSES as WALL_CAUSES
from rayhybrid.errors import ConfigError
from rayhybrid.goodput.__main__ import main
from rayhybrid.goodput.engine import CAUSES
from rayhybrid.goodput.from_run import apply_run
from rayhybrid.goodput.simulate import build_job, fallback_mtbf_s, simulate

ROOT = Path(__file__).resolve().parents[1]

# Exponential failures every M seconds, a blocking save of C s every TAU s of work, R s down
# after each failure (detection folded into R): Daly's regime, with C/M far from tiny.
M, C, R, TAU = 3600.0, 120.0, 300.0, 600.0
DALY = [
    "failures=exponential",
    f"failures.mtbf_hours={M / 3600}",
    "costs.detect_s=0",
    f"costs.restart_s={R}",
    f"costs.save_s={C}",
    "spares.repair_hours=0",
    "strategy=restart_all",
    "gpus=1024",
]


def daly(tau: float) -> float:
    return tau / (M * math.exp(R / M) * (math.exp((tau + C) / M) - 1.0))


def test_restart_all_matches_dalys_closed_form():
    cfg = compose_goodput([*DALY, f"checkpoint.interval_s={TAU}", "days=1000", "seeds=2"])
    simulated = simulate(cfg).strategies["restart_all"].effective_time
    assert simulated == pytest.approx(daly(TAU), rel=0.01), (simulated, daly(TAU))


def test_recommended_interval_is_dalys_optimum_and_youngs_is_not():
    """The recommendation is computed from Daly's form (for exponential failures), so this
    checks its optimizer; the next test checks it against simulated runs."""
    result = simulate(compose_goodput([*DALY, "days=1"]))
    recommended = result.strategies["restart_all"].recommended_checkpoint_interval_s
    assert result.recommended_checkpoint_interval_s == recommended
    grid = [t / 10 for t in range(10, 36000)]  # 1 s to 1 h in steps of 0.1 s
    best = max(grid, key=daly)
    assert recommended == pytest.approx(best, rel=0.02), (recommended, best)
    young = math.sqrt(2 * C * M)
    assert abs(young - best) / best > 0.02, (young, best)


def test_simulated_runs_peak_at_the_recommended_interval():
    """On the same traces, saving every recommended interval keeps more work than saving twice
    as often or half as often (Daly's form puts both 5-6% lower here; one trace's noise is
    under 1%)."""
    tau = simulate(compose_goodput([*DALY, "days=1"])).recommended_checkpoint_interval_s

    def kept(interval: float) -> float:
        cfg = compose_goodput([*DALY, f"checkpoint.interval_s={interval}", "days=500", "seeds=2"])
        return simulate(cfg).strategies["restart_all"].effective_time

    at = kept(tau)
    assert at > kept(tau / 2) + 0.02 and at > kept(2 * tau) + 0.02


def small(*overrides: str) -> list[str]:
    return ["gpus=1024", "days=20", "failures=exponential", "failures.mtbf_hours=5", *overrides]


def test_the_simulation_calls_the_drivers_failure_policy(monkeypatch):
    before = simulate(compose_goodput(small("strategy=restart_all"))).strategies["restart_all"]
    assert before.stopped == [] and before.counts["restarts"] > 50

    def give_up(self, failure, earlier, restarts):
        return Decision(False, f"gave up on {failure.message} (test)")

    monkeypatch.setattr(FailurePolicy, "decide", give_up)
    after = simulate(compose_goodput(small("strategy=restart_all"))).strategies["restart_all"]
    assert after.counts["restarts"] == 0 and after.stopped[0].startswith("gave up on failure")
    assert after.effective_time < 0.5 * before.effective_time


def test_the_simulation_calls_the_drivers_heal_policy(monkeypatch):
    overrides = small("strategy=peer_heal", "replica_gpus=64")
    before = simulate(compose_goodput(overrides)).strategies["peer_heal"]
    assert before.counts["heals"] > 0

    monkeypatch.setattr(HealPolicy, "choose", lambda self, copies, checkpoint_step=None: None)
    after = simulate(compose_goodput(overrides)).strategies["peer_heal"]
    assert after.counts["heals"] == 0 and after.counts["fallbacks"] == after.counts["restarts"]
    assert after.effective_time < before.effective_time


def test_peer_heals_recommended_interval_asks_the_drivers_heal_policy(monkeypatch):
    """peer_heal's interval is for the failures that HealPolicy sends back to the checkpoint: a
    policy that never heals gives replace_failed's interval."""
    overrides = small("strategy=all", "replica_gpus=64", "days=2")
    before = simulate(compose_goodput(overrides)).strategies
    healing = before["peer_heal"].recommended_checkpoint_interval_s
    fallback = before["replace_failed"].recommended_checkpoint_interval_s
    assert healing > 2 * fallback

    monkeypatch.setattr(HealPolicy, "choose", lambda self, copies, checkpoint_step=None: None)
    after = simulate(compose_goodput(overrides)).strategies
    assert after["peer_heal"].recommended_checkpoint_interval_s == pytest.approx(fallback)


@pytest.mark.parametrize(("replica_gpus", "dp"), [(512, 2), (256, 4)])
def test_peer_heals_fallbacks_are_those_the_simulation_has(replica_gpus, dp):
    """The interval's fallback rate against the simulated fallbacks, with heals of 30 min under
    a failure every 2 h, so that failures often strike during a heal. At dp 2 one on the other
    replica leaves no copy (one on the replica being healed does); at dp 4 a third replica still
    holds one, so (to first order) none falls back. The rule the interval had restated counted
    every failure during a heal as a fallback: 109 per trace for both."""
    cfg = compose_goodput(
        ["gpus=1024", f"replica_gpus={replica_gpus}", "days=40", "failures=exponential", "failures.mtbf_hours=2"]
        + ["costs.heal_s=1800", "costs.detect_s=60", "spares.repair_hours=0", "strategy=peer_heal", "seeds=3"]
        + ["checkpoint.interval_s=600"]
    )
    job, gpus = build_job(cfg)
    assert job.dp == dp
    predicted = cfg.days * 86400 / fallback_mtbf_s(STRATEGIES["peer_heal"], job, gpus)
    simulated = simulate(cfg).strategies["peer_heal"].counts["fallbacks"]
    if dp == 2:
        assert simulated > 30 and predicted == pytest.approx(simulated, rel=0.25), (predicted, simulated)
    else:
        assert predicted < 1 and simulated < 3, (predicted, simulated)


def test_the_simulation_calls_the_drivers_scaling_policy(monkeypatch):
    overrides = small("strategy=elastic_no_spares", "replica_gpus=64")
    before = simulate(compose_goodput(overrides)).strategies["elastic_no_spares"]
    assert before.stopped == [] and before.counts["shrinks"] > 0 and before.min_dp < 16

    monkeypatch.setattr(ScalingPolicy, "on_loss", lambda self, active, lost: [])
    after = simulate(compose_goodput(overrides)).strategies["elastic_no_spares"]
    assert after.stopped and "fewer than elastic.min_dp" in after.stopped[0]
    assert after.effective_time < 0.5 * before.effective_time


def test_llama3_at_16k_orders_the_strategies_and_lands_near_the_published_figure():
    """Llama 3 405B kept more than 90% effective training time restarting from checkpoints.
    Costs assumed (the defaults): detection 30 s (hangs 300 s), restart 600 s, replacing the
    failed ranks 300 s, a peer heal 60 s, a save blocking 10 s, a step 10 s, 32 spare nodes
    repaired in 24 h, replicas of 128 GPUs (dp 128)."""
    result = simulate(compose_goodput(["gpus=16384", "days=54", "failures=llama3", "seeds=3"]))
    eff = {name: s.effective_time for name, s in result.strategies.items()}
    print("llama3 at 16,384 GPUs, 54 days, seeds 0-2:", {k: round(v, 4) for k, v in eff.items()})
    assert result.job_mtbf_hours == pytest.approx(54 * 24 / 419, rel=1e-9)
    assert eff["peer_heal"] >= eff["replace_failed"] >= eff["restart_all"]
    assert 0.88 <= eff["restart_all"] <= 0.94
    for s in result.strategies.values():
        assert s.stopped == []


def test_kept_and_lost_time_add_up_to_the_wall_time():
    cfg = compose_goodput(["gpus=4096", "days=30", "failures=llama3", "spares.nodes=0", "spares.repair_hours=12"])
    result = simulate(cfg)
    wall_gpu_hours = result.gpus_used * cfg.days * 24
    for name, s in result.strategies.items():
        kept = s.effective_time * wall_gpu_hours
        assert kept + sum(s.gpu_hours_lost.values()) == pytest.approx(wall_gpu_hours, rel=1e-9), name
        assert set(s.gpu_hours_lost) == set(CAUSES)
    assert result.strategies["restart_all"].gpu_hours_lost["waiting_for_nodes"] > 0


def test_100k_gpus_run_in_seconds():
    start = time.process_time()
    result = simulate(compose_goodput(["gpus=100000", "days=54", "failures=llama3"]))
    assert time.process_time() - start < 10
    assert result.failures_per_trace > 2000


def test_the_command_line_writes_goodput_json(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = ["gpus=1024", "days=5", "failures=llama3", "strategy=all", f"output_dir={tmp_path / 'run'}"]
    proc = subprocess.run(
        [sys.executable, "-m", "rayhybrid.goodput", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "restart_all" in proc.stdout and "peer_heal" in proc.stdout
    report = json.loads((tmp_path / "run" / "goodput.json").read_text())
    assert set(report["strategies"]) == {"restart_all", "replace_failed", "peer_heal", "elastic", "elastic_no_spares"}
    png = (tmp_path / "run" / "goodput.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(png) < 2_000_000
    assert 0 < report["recommended_checkpoint_interval_s"]
    for s in report["strategies"].values():
        assert 0.0 <= s["effective_time"] <= 1.0
        assert set(s["gpu_hours_lost"]) == set(CAUSES)


@pytest.mark.parametrize(
    ("argv", "setting"),
    [(["gpus=lots"], "gpus"), (["failures=weibull"], "failures"), (["costs.save_s=-5"], "costs.save_s")],
)
def test_a_bad_setting_is_one_line_and_exit_code_2(argv, setting, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"error: {setting}:" in err


def test_the_strategy_setting_and_the_simulator_read_one_list(monkeypatch):
    """config/goodput.py's STRATEGIES is the only list: take one out and neither the setting's
    check nor strategy=all knows it; every strategy's fallback cost is a costs.* field."""
    from rayhybrid.config import goodput as settings

    costs = {f.name for f in dataclasses.fields(settings.CostsConfig)}
    assert all(s.fallback_cost in costs for s in settings.STRATEGIES.values())
    monkeypatch.delitem(settings.STRATEGIES, "elastic")
    with pytest.raises(ConfigError, match="'elastic' is not a strategy"):
        compose_goodput(["strategy=elastic"])
    result = simulate(compose_goodput(["gpus=1024", "days=1", "failures=llama3"]))
    assert list(result.strategies) == ["restart_all", "replace_failed", "peer_heal", "elastic_no_spares"]


def test_help_lists_every_setting_on_one_line(capsys):
    from rayhybrid.config.goodput import SETTINGS

    main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    for name in SETTINGS:
        assert sum(line.startswith(f"  {name}=") for line in lines) == 1, name


def test_the_meta_preset_is_7_9_hours_at_1024_gpus_per_gpu():
    """Meta's research clusters: 7.9 h job MTTF measured at 1,024 GPUs, a constant rate per GPU."""
    at_1k = simulate(compose_goodput(["gpus=1024", "days=2", "failures=meta", "strategy=restart_all"]))
    at_16k = simulate(compose_goodput(["gpus=16384", "days=2", "failures=meta", "strategy=restart_all"]))
    assert at_1k.job_mtbf_hours == pytest.approx(7.9, rel=1e-9)
    assert at_16k.job_mtbf_hours == pytest.approx(7.9 / 16, rel=1e-9)
    rescaled = compose_goodput(["gpus=1024", "days=2", "failures=meta", "failures.mtbf_hours=2"])
    assert simulate(rescaled).job_mtbf_hours == pytest.approx(2.0, rel=1e-9)


# A run of 8 ranks (dp 2 x pp 2 x tp 2) with three restarts, two saves and a committed
# checkpoint of 8 MB (1 MB per rank), as rayhybrid's RunLog writes it.
RESTARTS = [
    {"detect_s": 1.0, "teardown_s": 0.5, "place_s": 2.0, "init_s": 3.0, "restore_s": 4.0, "first_step_s": 1.5},
    {"detect_s": 2.0, "teardown_s": 0.5, "place_s": 4.0, "init_s": 5.0, "restore_s": 6.0, "first_step_s": 2.5},
    {"detect_s": 9.0, "teardown_s": 9.5, "place_s": 9.0, "init_s": 9.0, "restore_s": 9.0, "first_step_s": 9.0},
]


GOODPUT_CAUSES = tuple(c for c in WALL_CAUSES if c != "productive")
"""summary.json's goodput causes besides productive (the driver's, rayhybrid/driver/wallclock.py)."""


def fake_run(root: Path, restarts=RESTARTS) -> Path:
    run, ckpt = root / "run", root / "ckpt" / "step_00000020"
    ckpt.mkdir(parents=True)
    run.mkdir()
    files = {".metadata": 1_000_000, **{f"__{r}_0.distcp": 875_000 for r in range(8)}}
    for name, size in files.items():  # the files the marker lists, at their sizes (sparse)
        with open(ckpt / name, "wb") as f:
            f.truncate(size)
    (ckpt / "meta.json").write_text(json.dumps({"step": 20, "files": files}))
    topo = {"dp": 2, "pp": 2, "tp": 2}
    records = [{"step": s, "loss": 1.0, "step_time_s": 0.5 + 0.1 * (s % 3), **topo} for s in range(1, 31)]
    records += [
        {"event": "checkpoint", "step": 10, "path": str(root / "ckpt" / "step_00000010"), "blocked_s": 0.2}
        | {"upload_s": 1.0, "async": False},
        {"event": "checkpoint", "step": 20, "path": str(ckpt), "blocked_s": 0.4, "upload_s": 2.0, "async": False},
    ]
    for i, r in enumerate(restarts, 1):
        records.append(
            {"event": "restart", "restart": i, "failed_step": 5 * i, "cause": "rank 1: boom", "resume_step": 0}
            | {"replaced_ranks": [1], "dp_before": 2, "dp_after": 2, "save_s": 0.0, "total_s": 20.0, **r}
        )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    seconds = dict.fromkeys(GOODPUT_CAUSES, 1.0) | {"productive": 18.0}  # what the driver measured
    goodput = {"seconds": seconds, "wall_s": 32.0, "effective_time": 18.0 / 32.0, "processes": 4}
    summary = {"checkpoint_dir": str(root / "ckpt"), "restarts": 3, "goodput": goodput}
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_from_run_turns_the_runs_medians_into_scaled_costs(tmp_path):
    """Medians (each figure's own): detect 2, teardown 0.5, place 4, init 5, restore 6, first
    step 2.5, step 0.6, blocked 0.3. At 1,024 GPUs: init x log2(1024)/log2(8) = 10/3; the run's
    8 MB checkpoint is 1 MB per rank, 8 GB over 1,024 GPUs 7.8125 MB per rank."""
    argv = ["gpus=1024", f"from_run={fake_run(tmp_path)}", "costs.checkpoint_gb=8", "costs.heal_s=7"]
    cfg, measured = apply_run(compose_goodput(argv), given(argv))
    per_rank = 8e9 / 1024 / 1e6
    recovery = 0.5 + 4.0 + 5.0 * 10 / 3 + 6.0 * per_rank + (2.5 - 0.6)
    c = cfg.costs
    assert c.detect_s == 2.0 and c.step_s == pytest.approx(0.6)
    assert c.replace_s == pytest.approx(recovery) and c.restart_s == pytest.approx(recovery)
    assert c.save_s == pytest.approx(0.3 * per_rank)
    assert c.heal_s == 7 and c.hang_detect_s == 300.0  # not measured: as set
    assert measured["ranks"] == 8 and measured["checkpoint"]["bytes"] == 8_000_000
    assert measured["checkpoint"]["path"].endswith("step_00000020")
    limited = ["costs.storage_gbps=0.1", *argv]  # 8 GB take at least 80 s to read or write
    slow = apply_run(compose_goodput(limited), given(limited))[0].costs
    assert slow.replace_s == pytest.approx(recovery - 6.0 * per_rank + 80.0) and slow.save_s == pytest.approx(80.0)


def test_from_run_measures_a_peer_heal_apart_from_a_checkpoint_restore(tmp_path):
    """Two restarts restored the checkpoint, one healed from peers (its transfer 0.5 s, 1 MB
    per rank in the run): replace_s comes from the first two alone, heal_s from the heal, its
    transfer scaled per rank like a restore but never held to the storage floor."""
    restored = [
        {"healed": "checkpoint", "detect_s": 2.0, "teardown_s": 0.5, "place_s": 4.0, "init_s": 5.0}
        | {"restore_s": 6.0, "first_step_s": 2.5},
    ] * 2
    heal = {"healed": "peer", "detect_s": 2.0, "teardown_s": 0.1, "place_s": 0.0, "init_s": 3.0}
    heal |= {"restore_s": 0.5, "first_step_s": 0.6}
    argv = ["gpus=1024", f"from_run={fake_run(tmp_path, [*restored, heal])}", "costs.checkpoint_gb=8"]
    argv.append("costs.storage_gbps=0.1")
    cfg, measured = apply_run(compose_goodput(argv), given(argv))
    per_rank, growth = 8e9 / 1024 / 1e6, 10 / 3
    assert cfg.costs.replace_s == pytest.approx(0.5 + 4.0 + 5.0 * growth + 80.0 + (2.5 - 0.6))
    assert cfg.costs.heal_s == pytest.approx(0.1 + 3.0 * growth + 0.5 * per_rank)
    assert measured["records"]["healed"] == 1 and measured["heal_medians"]["restore_s"] == 0.5


def test_from_run_keeps_costs_given_on_the_command_line(tmp_path):
    argv = ["gpus=1024", f"from_run={fake_run(tmp_path)}", "costs.detect_s=11", "costs.restart_s=900"]
    cfg, measured = apply_run(compose_goodput(argv), given(argv))
    assert (cfg.costs.detect_s, cfg.costs.restart_s) == (11.0, 900.0)
    assert cfg.costs.replace_s != 300.0  # the run's, not the default
    assert measured["given"] == ["costs.detect_s", "costs.restart_s"]


def test_from_run_on_the_command_line_writes_its_costs(tmp_path):
    run = fake_run(tmp_path)
    main(["gpus=1024", "days=2", f"from_run={run}", f"output_dir={tmp_path / 'out'}"])
    report = json.loads((tmp_path / "out" / "goodput.json").read_text())
    assert report["from_run"]["costs"]["detect_s"] == 2.0
    assert report["settings"]["costs"]["detect_s"] == 2.0


@pytest.mark.parametrize("case", ["missing", "not json", "no restarts"])
def test_a_bad_from_run_is_one_line_and_exit_code_2(case, tmp_path, capsys):
    run = tmp_path / "missing"
    if case != "missing":
        run = fake_run(tmp_path, restarts=[])
        if case == "not json":
            (run / "metrics.jsonl").write_text("{not json\n")
    with pytest.raises(SystemExit) as exit_:
        main(["gpus=1024", "days=1", f"from_run={run}", f"output_dir={tmp_path / 'out'}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error: from_run:" in err and "restart records" in err


@pytest.mark.parametrize("key", ["output_dir", "from_run"])
@pytest.mark.parametrize("path", ["/data/runs/run[1]", "/data/it's here", "/data/a,b {c}"])
def test_paths_reach_their_setting_as_typed(key, path):
    """Paths are quoted for Hydra's grammar as prepare's are (brackets, commas, braces, quotes)."""
    assert getattr(compose_goodput([f"{key}={path}"]), key) == path


@pytest.mark.parametrize("field", ["restore_s", "detect_s", "first_step_s"])
def test_a_restart_record_without_a_field_is_one_line_naming_it_and_exit_code_2(field, tmp_path, capsys):
    """A figure missing from a restart record is an error naming the field, not a cost of 0."""
    restarts = [dict(RESTARTS[0]), *RESTARTS[1:]]
    del restarts[0][field]
    run = fake_run(tmp_path, restarts)
    with pytest.raises(SystemExit) as exit_:
        main(["gpus=1024", "days=1", f"from_run={run}", f"output_dir={tmp_path / 'out'}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error: from_run:" in err, err
    assert f"the restart record of restart 1 has no '{field}'" in err, err
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_or_step_record_without_a_field_names_it(tmp_path):
    run = fake_run(tmp_path)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    argv = ["gpus=1024", f"from_run={run}"]
    for record, field, text in (
        (next(r for r in records if r.get("event") == "checkpoint"), "upload_s", "checkpoint record of step 10"),
        (next(r for r in reversed(records) if "loss" in r), "dp", "step record of step 30"),
    ):
        value = record.pop(field)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        with pytest.raises(ConfigError) as err:
            apply_run(compose_goodput(argv), given(argv))
        assert err.value.setting == "from_run" and f"{text} has no '{field}'" in str(err.value)
        record[field] = value
