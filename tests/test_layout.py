"""`Layout` (rayhybrid/topology.py): what a config's topology and batch imply. No Ray, no torch."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest

from rayhybrid.config.compose import compose, to_config
from rayhybrid.config.topology import Layout, Topology

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def layout(*overrides: str) -> Layout:
    return Layout.of(to_config(compose(list(overrides))))


DP2_PP2_TP2 = ("+topology=dp2_pp2_tp2",)
INTERLEAVED = ("topology=pp2_interleaved",)
ZBV = ("+topology=pp2_zbv",)
DP4 = ("+topology=dp4",)


def test_of_reads_the_config():
    cfg = to_config(compose(["+topology=dp2_pp2_tp2", "train.global_batch_size=32", "train.micro_batch_size=2"]))
    assert Layout.of(cfg) == Layout(2, 2, 2, "1f1b", 1, 4, 32, 2)
    assert Layout.of(cfg).topology == Topology(2, 2, 2)


@pytest.mark.parametrize(
    "overrides, world, microbatches, virtual, stages",
    [
        (DP2_PP2_TP2, 8, 2, 1, 2),  # 16 samples / (2 replicas x 4 per micro-batch)
        (INTERLEAVED, 2, 4, 2, 4),
        (ZBV, 2, 4, 2, 4),
        (DP4, 4, 1, 1, 1),
        ((), 1, 4, 1, 1),
        (("+topology=pp4", "train.micro_batch_size=1"), 4, 16, 1, 4),
        (("+topology=dp2", "topology.stages_per_rank=2"), 2, 2, 1, 1),  # no pipeline: one stage per rank
    ],
)
def test_sizes(overrides, world, microbatches, virtual, stages):
    lay = layout(*overrides)
    assert lay.world_size == world == lay.topology.world_size
    assert lay.num_microbatches == microbatches
    assert lay.replica_batch_size == 16 // lay.dp
    assert lay.virtual_stages == virtual
    assert lay.num_stages == stages


def test_schedules_from_the_presets():
    assert (layout(*INTERLEAVED).schedule, layout(*INTERLEAVED).stages_per_rank) == ("interleaved_1f1b", 2)
    assert (layout(*ZBV).schedule, layout(*ZBV).stages_per_rank) == ("zbv", 2)
    assert layout(*DP2_PP2_TP2).schedule == "1f1b"


@pytest.mark.parametrize(
    "overrides, layers",
    [
        (DP2_PP2_TP2, [range(2), range(2, 4)]),
        ((*DP2_PP2_TP2, "model.n_layers=5"), [range(3), range(3, 5)]),
        (INTERLEAVED, [range(1), range(1, 2), range(2, 3), range(3, 4)]),
        ((*INTERLEAVED, "model.n_layers=6"), [range(2), range(2, 4), range(4, 5), range(5, 6)]),
        (ZBV, [range(1), range(1, 2), range(2, 3), range(3, 4)]),
        (DP4, [range(4)]),
    ],
)
def test_stage_layers(overrides, layers):
    lay = layout(*overrides)
    assert lay.stage_layers == layers
    assert len(lay.stage_layers) == lay.num_stages
    assert [i for r in lay.stage_layers for i in r] == list(range(lay.n_layers))


@pytest.mark.parametrize(
    "overrides, owned",
    [
        (DP2_PP2_TP2, [[0], [1]]),
        (INTERLEAVED, [[0, 2], [1, 3]]),  # loop: r, r + pp
        (ZBV, [[0, 3], [1, 2]]),  # V: rank 0 has the first and the last stage
        (DP4, [[0]]),
    ],
)
def test_stages_of(overrides, owned):
    lay = layout(*overrides)
    assert [lay.stages_of(r) for r in range(lay.pp)] == owned
    assert sorted(s for r in range(lay.pp) for s in lay.stages_of(r)) == list(range(lay.num_stages))


@pytest.mark.parametrize("pp, per_rank", [(2, 3), (4, 2), (4, 3), (3, 4)])
def test_loop_stages(pp, per_rank):
    lay = Layout(1, pp, 1, "interleaved_1f1b", per_rank, 24, 16, 1)
    for r in range(pp):
        assert lay.stages_of(r) == [r + k * pp for k in range(per_rank)]
    assert sorted(s for r in range(pp) for s in lay.stages_of(r)) == list(range(pp * per_rank))


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_v_stages(pp):
    lay = Layout(1, pp, 1, "zbv", 2, 24, 16, 1)
    assert lay.stages_of(0) == [0, 2 * pp - 1]
    for r in range(pp):
        assert lay.stages_of(r) == [r, 2 * pp - 1 - r]
    assert sorted(s for r in range(pp) for s in lay.stages_of(r)) == list(range(2 * pp))


def test_summary():
    assert layout(*DP2_PP2_TP2).summary() == {"dp": 2, "pp": 2, "tp": 2, "world_size": 8, "num_microbatches": 2}
    assert layout(*ZBV).summary() == {"dp": 1, "pp": 2, "tp": 1, "world_size": 2, "num_microbatches": 4}
    assert layout(*DP4).summary() == {"dp": 4, "pp": 1, "tp": 1, "world_size": 4, "num_microbatches": 1}


FIND_TORCH_IMPORTER = """
import sys, traceback
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            frames = [f for f in traceback.extract_stack() if "rayhybrid" in f.filename]
            print(" <- ".join(f"{f.filename}:{f.lineno}" for f in reversed(frames)))
            sys.meta_path.remove(self)
        return None
sys.meta_path.insert(0, Spy())
import rayhybrid.config.topology, rayhybrid.plan.estimate, rayhybrid.plan.dry_run
"""


def test_the_planner_does_not_import_torch():
    check = "import sys, rayhybrid.config.topology, rayhybrid.plan.estimate, rayhybrid.plan.dry_run; assert 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", check], check=False, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:  # name the import that pulled torch in
        spy = subprocess.run(
            [sys.executable, "-c", FIND_TORCH_IMPORTER], check=False, cwd=ROOT, capture_output=True, text=True
        )
        pytest.fail(f"torch imported via {spy.stdout.strip() or result.stderr.strip()}")
