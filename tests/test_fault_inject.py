"""Fault injection (`fault.inject*`, rayhybrid/faults/): the kinds' table, parsing, validation, the plan of what
fires when, and the worker-side trigger. Pure: no Ray; the kill and hang triggers run in a
throwaway `python -c` subprocess."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from rayhybrid.config.compose import compose, to_config
from rayhybrid.config.compose import replace as replace_cfg
from rayhybrid.config.schema import Config, FaultConfig
from rayhybrid.errors import ConfigError
from rayhybrid.faults import (
    KINDS,
    RANDOM_KINDS,
    FaultPlan,
    InjectedFault,
    Injection,
    Kind,
    fires_at,
    parse,
    trigger,
    validate_faults,
)
from rayhybrid.faults.kinds import doc_lines
from rayhybrid.preflight import check
from rayhybrid.trainer.results import StepResult

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(topology: dict | None = None, **sections: dict) -> Config:
    """The default config (150 steps, checkpoint every 50, one rank) with some fields changed."""
    return replace_cfg(Config(), topology=topology or {}, **sections)


def _error(cfg: Config) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        check(cfg)  # check() runs validate_faults
    assert "\n" not in str(info.value)  # one line for the CLI
    return info.value


def _python(code: str, **env: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT, **env}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# Parsing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("kill@5", Injection("kill", 5, None)),
        ("hang@9:3", Injection("hang", 9, 3)),
        ("raise@12", Injection("raise", 12, None)),
        ("kill_save@6", Injection("kill_save", 6, None)),
        ("kill_save@50:0", Injection("kill_save", 50, 0)),
        (" raise@1:7 ", Injection("raise", 1, 7)),
    ],
)
def test_parse_every_form(text, expected):
    injection = parse(text)
    assert injection == expected
    assert str(injection) == text.strip()
    assert injection.phase == ("save" if expected.kind == "kill_save" else "step")


def test_record_is_a_metrics_event():
    record = Injection("kill_save", 50, 2).record()
    assert record == {"event": "fault_injected", "step": 50, "kind": "kill_save", "rank": 2, "phase": "save"}
    assert json.loads(json.dumps(record)) == record


@pytest.mark.parametrize("text", ["kill", "kill@", "kill@x", "@5", "kill@5:", "kill@5:-1", "kill@5:1:2", "", "kill 5"])
def test_parse_rejects_malformed_entries(text):
    with pytest.raises(ConfigError) as info:
        parse(text)
    assert info.value.setting == "fault.inject"
    assert "KIND@STEP or KIND@STEP:RANK" in info.value.message and "kill@5" in info.value.message


def test_parse_rejects_unknown_kind():
    with pytest.raises(ConfigError) as info:
        parse("explode@5")
    assert info.value.setting == "fault.inject"
    assert "unknown kind 'explode'" in info.value.message
    assert all(kind in info.value.message for kind in KINDS)


# Validation ------------------------------------------------------------------------------------


def test_valid_faults_pass():
    fault = {"inject": ("kill@1", "hang@9:0", "raise@150", "kill_save@50", "kill_save@150", "kill@50")}
    check(_cfg(fault=fault))
    check(_cfg(fault={"inject_rate": 1.0, "inject_kinds": RANDOM_KINDS}))
    check(_cfg(fault={"inject_rate": 0.0, "inject_kinds": ()}))  # no random faults: kinds unused


@pytest.mark.parametrize("entry", ["kill@0", "kill@151", "hang@-3"])
def test_step_out_of_range(entry):
    err = _error(_cfg(fault={"inject": (entry,)}))
    assert err.setting == "fault.inject" and "out of range" in err.message and "1..150" in err.message


def test_kill_save_needs_a_checkpoint_step():
    err = _error(_cfg(fault={"inject": ("kill_save@7",)}))
    assert err.setting == "fault.inject" and "not a checkpoint step" in err.message
    assert "checkpoint.every=50" in err.message
    err = _error(_cfg(fault={"inject": ("kill_save@150",)}, checkpoint={"every": 0}))
    assert "not a checkpoint step" in err.message and "checkpoint.every=0" in err.message
    check(_cfg(fault={"inject": ("kill_save@150",)}, checkpoint={"every": 40}))  # the final save


def test_rank_must_exist_in_the_largest_world():
    dp2_pp2 = {"dp": 2, "pp": 2}
    check(_cfg(dp2_pp2, fault={"inject": ("kill@5:3",)}))
    err = _error(_cfg(dp2_pp2, fault={"inject": ("kill@5:4",)}))
    assert err.setting == "fault.inject" and "rank 4 does not exist" in err.message and "at most 4 ranks" in err.message
    # Elastic: the largest dp counts (elastic.max_dp=4 x tp 2 = 8 ranks).
    elastic = {"enabled": True, "min_dp": 1, "max_dp": 4}
    check(_cfg({"dp": 1, "tp": 2}, elastic=elastic, fault={"inject": ("hang@5:7",)}))
    err = _error(_cfg({"dp": 1, "tp": 2}, elastic=elastic, fault={"inject": ("hang@5:8",)}))
    assert "at most 8 ranks" in err.message


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan")])
def test_rate_outside_unit_interval(rate):
    err = _error(_cfg(fault={"inject_rate": rate}))
    assert err.setting == "fault.inject_rate" and "[0, 1]" in err.message


def test_unknown_or_missing_random_kinds():
    err = _error(_cfg(fault={"inject_kinds": ("kill", "boom")}))
    assert err.setting == "fault.inject_kinds" and "unknown kind 'boom'" in err.message and "kill_save" in err.message
    err = _error(_cfg(fault={"inject_rate": 0.1, "inject_kinds": ()}))
    assert err.setting == "fault.inject_kinds" and "is empty" in err.message
    err = _error(_cfg(fault={"inject_rate": 0.1, "inject_kinds": ("kill_save",)}, checkpoint={"every": 0}))
    assert err.setting == "fault.inject_kinds" and "checkpoint.every=0" in err.message


def test_two_faults_for_one_step_and_phase():
    err = _error(_cfg(fault={"inject": ("kill@5", "hang@5:0")}))
    assert err.setting == "fault.inject" and "'kill@5' and 'hang@5:0'" in err.message
    assert "step phase of step 5" in err.message
    err = _error(_cfg(fault={"inject": ("kill_save@50", "kill_save@50:0")}))
    assert "save phase of step 50" in err.message
    validate_faults(_cfg(fault={"inject": ("kill@50", "kill_save@50")}))  # different phases


def test_command_line_form_composes():
    cfg = to_config(
        compose(
            [
                "fault.inject=[kill@5,hang@9:3,raise@12,kill_save@50]",
                "fault.inject_rate=0.01",
                "fault.inject_kinds=[kill,kill_save]",
                "fault.inject_seed=7",
            ]
        )
    )
    assert tuple(cfg.fault.inject) == ("kill@5", "hang@9:3", "raise@12", "kill_save@50")
    assert [parse(text) for text in cfg.fault.inject][1] == Injection("hang", 9, 3)
    assert (cfg.fault.inject_rate, tuple(cfg.fault.inject_kinds), cfg.fault.inject_seed) == (
        0.01,
        ("kill", "kill_save"),
        7,
    )
    check(replace(cfg, topology=replace(cfg.topology, dp=4)))
    err = _error(replace(cfg, topology=replace(cfg.topology, dp=2)))  # hang@9:3 on 2 ranks
    assert "'hang@9:3': rank 3 does not exist" in err.message


def test_defaults_inject_nothing():
    fault = FaultConfig()
    assert (fault.inject, fault.inject_rate, fault.inject_kinds, fault.inject_seed) == ((), 0.0, tuple(KINDS)[:3], 0)
    assert all(FaultPlan(fault).due(step, "step", 4) is None for step in range(1, 100))


# The plan --------------------------------------------------------------------------------------


def test_planned_fault_fires_once_at_its_step_and_phase():
    plan = FaultPlan(FaultConfig(inject=("kill@5:1", "kill_save@50:0")))
    assert plan.due(4, "step", 4) is None
    assert plan.due(5, "save", 4) is None  # kill@5 belongs to the step, not to a save after it
    assert plan.due(5, "step", 4) == Injection("kill", 5, 1)
    assert plan.due(5, "step", 4) is None  # step 5 trained again after the recovery
    assert plan.due(50, "step", 4) is None
    assert plan.due(50, "save", 4) == Injection("kill_save", 50, 0)
    assert plan.due(50, "save", 4) is None


def test_drawn_rank_is_in_the_world_and_deterministic():
    ranks = [FaultPlan(FaultConfig(inject=("raise@7",))).due(7, "step", 8).rank for _ in range(2)]
    assert ranks[0] == ranks[1] and 0 <= ranks[0] < 8
    others = {
        FaultPlan(FaultConfig(inject=("raise@7",), inject_seed=seed)).due(7, "step", 8).rank for seed in range(20)
    }
    assert len(others) > 1  # the seed picks the rank


def test_configured_rank_wraps_after_a_shrink():
    config = FaultConfig(inject=("hang@9:3",))
    assert FaultPlan(config).due(9, "step", 4).rank == 3
    assert FaultPlan(config).due(9, "step", 2).rank == 1
    assert FaultPlan(config).due(9, "step", 3).rank == 0


def _sequence(plan: FaultPlan, steps: int = 2000, world: int = 8) -> list[Injection]:
    fired = (plan.due(step, phase, world) for step in range(1, steps + 1) for phase in ("step", "save"))
    return [injection for injection in fired if injection is not None]


def test_random_faults_are_deterministic_for_a_seed():
    config = FaultConfig(inject_rate=0.05, inject_seed=3)
    first, second = _sequence(FaultPlan(config)), _sequence(FaultPlan(config))
    assert first == second
    assert first != _sequence(FaultPlan(replace(config, inject_seed=4)))
    assert first != _sequence(FaultPlan(config, seed_offset=1))


def test_random_faults_do_not_depend_on_the_hash_seed():
    code = (
        "from rayhybrid.config.schema import FaultConfig; from rayhybrid.faults import FaultPlan\n"
        "plan = FaultPlan(FaultConfig(inject_rate=0.1, inject_seed=5, inject=('raise@3',)))\n"
        "print([str(plan.due(s, 'step', 8)) for s in range(1, 60)])"
    )
    plan = FaultPlan(FaultConfig(inject_rate=0.1, inject_seed=5, inject=("raise@3",)))
    here = str([str(plan.due(s, "step", 8)) for s in range(1, 60)])
    out, err = _python(code, PYTHONHASHSEED="12345").communicate(timeout=30)
    assert out.decode().strip() == here, err.decode()


def test_random_faults_fire_at_the_rate_once_per_step():
    plan = FaultPlan(FaultConfig(inject_rate=0.05, inject_kinds=("kill", "hang", "raise"), inject_seed=11))
    fired = _sequence(plan)
    assert 60 <= len(fired) <= 140  # 2000 steps x 0.05 = 100 expected
    steps = [injection.step for injection in fired]
    assert len(steps) == len(set(steps))
    assert {injection.kind for injection in fired} == {"kill", "hang", "raise"}
    assert {injection.phase for injection in fired} == {"step"}
    assert all(0 <= injection.rank < 8 for injection in fired)
    assert _sequence(plan) == []  # every draw was made: steps trained again do not fail again


def test_random_kill_save_fires_only_in_saves():
    fired = _sequence(FaultPlan(FaultConfig(inject_rate=0.05, inject_kinds=("kill", "kill_save"))))
    by_phase = {phase: [i for i in fired if i.phase == phase] for phase in ("step", "save")}
    assert by_phase["step"] and {i.kind for i in by_phase["step"]} == {"kill"}
    assert by_phase["save"] and {i.kind for i in by_phase["save"]} == {"kill_save"}
    only_save = _sequence(FaultPlan(FaultConfig(inject_rate=1.0, inject_kinds=("kill_save",))), steps=10)
    assert [(i.step, i.phase) for i in only_save] == [(step, "save") for step in range(1, 11)]


def test_planned_fault_takes_the_place_of_a_random_draw():
    plan = FaultPlan(FaultConfig(inject=("hang@2:1",), inject_rate=1.0, inject_kinds=("raise",)))
    assert [plan.due(step, "step", 4).kind for step in (1, 2, 3)] == ["raise", "hang", "raise"]


def test_due_rejects_bad_arguments():
    plan = FaultPlan(FaultConfig(inject=("kill@1",)))
    with pytest.raises(ValueError):
        plan.due(1, "forward", 4)
    with pytest.raises(ValueError):
        plan.due(1, "step", 0)


# The trigger -----------------------------------------------------------------------------------


def test_trigger_raise_is_a_picklable_injected_fault():
    with pytest.raises(InjectedFault) as info:
        trigger("raise", 3)
    assert str(info.value) == "injected fault (fault.inject raise@3)"
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is InjectedFault and str(copy) == str(info.value) and (copy.kind, copy.step) == ("raise", 3)
    assert isinstance(copy, RuntimeError)


def test_trigger_rejects_unknown_kind():
    with pytest.raises(ValueError, match="unknown fault kind"):
        trigger("explode", 1)


@pytest.mark.parametrize("kind", ["kill", "kill_save"])
def test_trigger_kill_kills_the_process(kind):
    proc = _python(f"from rayhybrid.faults import trigger; trigger({kind!r}, 5); print('survived')")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, err.decode()
    assert b"survived" not in out


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the process state from /proc")
def test_trigger_hang_stops_the_process():
    proc = _python("from rayhybrid.faults import trigger; trigger('hang', 9); print('survived')")
    try:
        deadline = time.monotonic() + 30
        while _state(proc.pid) != "T":
            assert proc.poll() is None and time.monotonic() < deadline, "the process never stopped"
            time.sleep(0.005)
    finally:
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL and b"survived" not in out


def test_kill_eval_needs_an_evaluation_step_and_is_never_drawn_at_random():
    every4 = {"every": 4}
    check(_cfg(fault={"inject": ("kill_eval@8",)}, eval=every4))  # an eval step: fine
    err = _error(_cfg(fault={"inject": ("kill_eval@6",)}, eval=every4))
    assert err.setting == "fault.inject" and "no evaluation after step 6" in err.message
    assert "eval.every=4" in err.message
    err = _error(_cfg(fault={"inject_rate": 0.1, "inject_kinds": ("kill_eval",)}, eval=every4))
    assert err.setting == "fault.inject_kinds" and "unknown kind 'kill_eval'" in err.message


# The kinds' table (rayhybrid/faults/kinds.py) ---------------------------------------------------


def _fault_section(doc: str, title: str) -> str:
    with open(os.path.join(ROOT, "docs", doc)) as f:
        text = f.read()
    section = text.split(title, 1)[1]
    return " ".join(section.split("\n#", 1)[0].split())  # up to the next heading, one line


def test_every_kind_is_documented_as_the_table_says():
    """docs/design.md's list is the table's `doc_lines` (nothing more, nothing less), and
    docs/recovery-and-elasticity.md has a row for each kind."""
    design = _fault_section("design.md", "### Fault injection")
    for line in doc_lines():
        assert " ".join(line.split())[:-1] in design, line
    assert re.findall(r"- `(\w+)`: ", design) == list(KINDS)
    users = _fault_section("recovery-and-elasticity.md", "### Rehearsing failures")
    assert re.findall(r"\| `(\w+)` \|", users) == list(KINDS)


def test_the_table_drives_parsing_validation_and_the_plan(monkeypatch):
    """A new kind is one entry in KINDS: parse accepts it, validation asks for a step where it
    can fire, the plan puts it on the driver's call that carries it, and trigger does its effect."""
    assert set(RANDOM_KINDS) == {name for name, kind in KINDS.items() if kind.random}
    assert {name: KINDS[name].fires for name in KINDS} == {
        "kill": "step",
        "hang": "step",
        "raise": "step",
        "kill_save": "save",
        "kill_eval": "eval",
    }
    monkeypatch.setitem(KINDS, "raise_eval", Kind("eval", "raise", False, "it raises in the evaluation"))
    monkeypatch.setitem(KINDS, "raise_save", Kind("save", "raise", True, "it raises in the save"))
    assert parse("raise_eval@8") == Injection("raise_eval", 8, None) and parse("raise_eval@8").phase == "step"
    assert parse("raise_save@50").phase == "save"
    check(_cfg(fault={"inject": ("raise_eval@8", "raise_save@50")}, eval={"every": 4}))
    err = _error(_cfg(fault={"inject": ("raise_eval@6",)}, eval={"every": 4}))
    assert "no evaluation after step 6" in err.message
    err = _error(_cfg(fault={"inject": ("raise_save@7",)}))
    assert "not a checkpoint step" in err.message
    err = _error(_cfg(fault={"inject_rate": 0.1, "inject_kinds": ("raise_save",)}, checkpoint={"every": 0}))
    assert err.setting == "fault.inject_kinds" and "raise_save needs checkpoint saves" in err.message
    plan = FaultPlan(FaultConfig(inject_rate=1.0, inject_kinds=("raise_save",)))
    assert plan.due(1, "step", 2) is None and plan.due(1, "save", 2).kind == "raise_save"
    assert fires_at("raise_eval", "eval") and not fires_at("raise_eval", "step") and not fires_at(None, "eval")
    with pytest.raises(InjectedFault):
        trigger("raise_eval", 8)


def test_unknown_kind_errors_list_the_table(monkeypatch):
    monkeypatch.setitem(KINDS, "kill_load", Kind("step", "kill", True, "a kind added to the table"))
    with pytest.raises(ConfigError) as info:
        parse("explode@5")
    assert "kill_load" in info.value.message and "kill_eval" in info.value.message
    with pytest.raises(ValueError, match="kill_load"):
        trigger("explode", 5)


class _FakeTrainer:
    """What TrainWorker.train touches of a Trainer."""

    def __init__(self, calls: list) -> None:
        self.step, self.calls = 0, calls

    def train_step(self) -> StepResult:
        self.step += 1
        self.calls.append(("train_step", self.step))
        return StepResult({"step": self.step})

    def evaluate(self) -> float:
        self.calls.append(("evaluate", self.step))
        return 1.0


@pytest.mark.parametrize("fires", ["step", "eval"])
def test_the_worker_fires_a_kind_where_the_table_says(monkeypatch, fires):
    """TrainWorker.train fires a step's kind before the step and an evaluation's kind before
    the evaluation, for any kind of the table (here a new one), not a list of names."""
    from rayhybrid import faults
    from rayhybrid.cluster.worker import TrainWorker

    calls: list = []
    monkeypatch.setitem(KINDS, "new", Kind(fires, "kill", False, "a kind added to the table"))
    monkeypatch.setattr(faults, "trigger", lambda kind, step: calls.append((f"trigger {kind}", step)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the worker sets it; restored after the test
    worker = TrainWorker(replace_cfg(Config(), eval={"every": 1}), rank=0, world_size=1)
    worker.trainer = _FakeTrainer(calls)
    worker.train(1, inject="new")
    if fires == "step":
        assert calls == [("trigger new", 1), ("train_step", 1), ("evaluate", 1)]
    else:
        assert calls == [("train_step", 1), ("trigger new", 1), ("evaluate", 1)]
