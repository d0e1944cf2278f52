"""The record fields a run writes to metrics.jsonl are the ones docs/observability.md and the
README describe: every field of a restart and a resize record (from the records' own code),
every field of a step record, and every kind of event (records.py's list). The docs drifted
before (issue 37, item 9): the heal event and vote_s, data_wait_s, healed, steps_redone and
bytes_sent were written but not described."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

from rayhybrid.driver import records
from rayhybrid.driver.records import Interruption, StepMetrics

ROOT = Path(__file__).resolve().parents[1]
OBSERVABILITY = (ROOT / "docs" / "observability.md").read_text()
README = (ROOT / "README.md").read_text()

STEP_ONLY_IN_WORKERS = {"data_read", "samples_read", "trace"}
"""StepMetrics keys that never reach metrics.jsonl: data.trace's rows go to data_trace/, a rank's
own `samples_read` is merged into `samples`, and metrics.trace_steps' spans go to trace.json."""
STEP_EXTRAS = {"vote_s", "cpu_s"}
"""Step record fields the trainer writes that StepMetrics does not declare."""


def event_kinds() -> list[str]:
    """The event kinds records.py's docstring lists ("event": resume, heal, ...)."""
    listed = re.search(r'"event": ([a-z_, \n]+)\)', records.__doc__)
    assert listed, records.__doc__
    return [kind.strip() for kind in listed.group(1).split(",")]


def restart() -> Interruption:
    return Interruption(kind="restart", cause="rank 1: boom", step=5, dp_before=2, dp_after=2)


@pytest.mark.parametrize("field", sorted(restart().restart_record()))
def test_observability_describes_every_field_of_a_restart_record(field):
    assert f"`{field}`" in OBSERVABILITY, field


@pytest.mark.parametrize("field", sorted(restart().resize_record()))
def test_observability_describes_every_field_of_a_resize_record(field):
    assert f"`{field}`" in OBSERVABILITY, field


@pytest.mark.parametrize("field", sorted(set(typing.get_type_hints(StepMetrics)) - STEP_ONLY_IN_WORKERS | STEP_EXTRAS))
def test_observability_describes_every_field_of_a_step_record(field):
    outputs = OBSERVABILITY.split("## Ray's own text")[0]
    assert re.search(rf"`{field}`|[`, ]{field}[`,]", outputs), field


def test_every_event_kind_is_described_in_observability_and_readme():
    kinds = event_kinds()
    assert "heal" in kinds and "restart" in kinds
    row = next(line for line in README.splitlines() if line.startswith("| `metrics.jsonl` |"))
    for kind in kinds:
        assert f"- `{kind}`:" in OBSERVABILITY, kind
        assert f"`{kind}`" in OBSERVABILITY.split("The event records:")[0], kind
        assert re.search(rf"\b{kind}\b", row), kind


@pytest.mark.parametrize("field", ["data_wait_s", "vote_s", "healed", "steps_redone", "bytes_sent"])
def test_the_readme_names_the_fields_of_recovery_and_data(field):
    row = next(line for line in README.splitlines() if line.startswith("| `metrics.jsonl` |"))
    assert f"`{field}`" in row, field


def test_the_readme_says_dp_shard_turns_peer_healing_off_and_qualifies_gcps_notice():
    text = " ".join(README.split())
    assert "`topology.dp_shard=true` turns peer healing off" in text
    assert "AWS gives two minutes, GCP about 30 s" in text
    assert "A checkpoint that takes longer is not finished" in text


def test_dp_shard_turns_peer_healing_off_as_the_docs_say():
    """What the README and docs/recovery-and-elasticity.md say of topology.dp_shard, in the code:
    no vote and nothing kept (the heal policy then finds no copy and the run restores)."""
    from rayhybrid.driver.policies import HealPolicy
    from rayhybrid.preflight import load_config
    from rayhybrid.trainer.heal import heal_enabled

    assert heal_enabled(load_config(["+topology=dp2"]))
    assert not heal_enabled(load_config(["+topology=dp2", "topology.dp_shard=true"]))
    # HSDP heals with two replica groups or more; a shard group as large as dp is FSDP2's case.
    assert heal_enabled(load_config(["+topology=dp4", "topology.dp_shard=2"]))
    assert not heal_enabled(load_config(["+topology=dp4", "topology.dp_shard=4"]))
    assert HealPolicy(enabled=True).choose({(0, 0): [None, None]}) is None  # nothing kept: the checkpoint
