"""`python -m rayhybrid.goodput`: the simulator against Daly's closed form, its recommended
interval against that form's optimum (and Young's first-order one), its coupling to the
driver's own policies, the llama3 preset's ordering of strategies, and the command line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rayhybrid.config.goodput import compose_goodput
from rayhybrid.driver.policies import Decision, FailurePolicy, ScalingPolicy
from rayhybrid.goodput.__main__ import main
from rayhybrid.goodput.engine import CAUSES
from rayhybrid.goodput.simulate import simulate

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
    assert 0 < report["recommended_checkpoint_interval_s"]
    for s in report["strategies"].values():
        assert 0.0 <= s["effective_time"] <= 1.0
        assert set(s["gpu_hours_lost"]) == set(CAUSES)


@pytest.mark.parametrize(
    ("argv", "setting"),
    [(["gpus=lots"], "gpus"), (["failures=meta"], "failures"), (["costs.save_s=-5"], "costs.save_s")],
)
def test_a_bad_setting_is_one_line_and_exit_code_2(argv, setting, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"error: {setting}:" in err


def test_help_lists_every_setting_on_one_line(capsys):
    from rayhybrid.config.goodput import SETTINGS

    main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    for name in SETTINGS:
        assert sum(line.startswith(f"  {name}=") for line in lines) == 1, name
