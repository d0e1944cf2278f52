"""Learning-rate schedule (linear warmup, then cosine/linear/constant decay) and AdamW groups."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from rayhybrid.config.schema import TrainConfig
from rayhybrid.trainer.optim import build_optimizer, lr_at, set_lr

CFG = TrainConfig(steps=100, lr=1e-3, min_lr=1e-4, warmup_steps=10)


def schedule(cfg: TrainConfig, upto: int | None = None) -> list[float]:
    return [lr_at(s, cfg) for s in range(cfg.steps if upto is None else upto)]


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_warmup(decay):
    cfg = dataclasses.replace(CFG, decay=decay)
    warm = schedule(cfg, cfg.warmup_steps)
    # Starts small (not zero: the first step must move), rises linearly, peaks at lr.
    assert warm[0] == pytest.approx(cfg.lr / cfg.warmup_steps)
    assert 0 < warm[0] < 0.2 * cfg.lr
    assert all(b > a for a, b in itertools.pairwise(warm))
    assert warm == pytest.approx([cfg.lr * (s + 1) / cfg.warmup_steps for s in range(cfg.warmup_steps)])
    assert warm[-1] == pytest.approx(cfg.lr)
    assert max(schedule(cfg)) == pytest.approx(cfg.lr)


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_decay_reaches_min_lr(decay):
    cfg = dataclasses.replace(CFG, decay=decay)
    lrs = schedule(cfg)
    after = lrs[cfg.warmup_steps :]
    assert after[0] == pytest.approx(cfg.lr)
    assert all(b <= a for a, b in itertools.pairwise(after)), "decay must not increase"
    assert all(lr >= cfg.min_lr - 1e-15 for lr in after)
    # Ends at min_lr, and stays there past the planned steps.
    assert lrs[-1] - cfg.min_lr <= 0.02 * (cfg.lr - cfg.min_lr)
    assert lr_at(cfg.steps, cfg) == pytest.approx(cfg.min_lr)
    assert lr_at(cfg.steps + 50, cfg) == pytest.approx(cfg.min_lr)
    # Halfway through the decay both schedules sit halfway between lr and min_lr.
    mid = cfg.warmup_steps + (cfg.steps - cfg.warmup_steps) // 2
    assert lr_at(mid, cfg) == pytest.approx((cfg.lr + cfg.min_lr) / 2)


def test_cosine_and_linear_shapes_differ():
    cos = dataclasses.replace(CFG, decay="cosine")
    lin = dataclasses.replace(CFG, decay="linear")
    quarter = CFG.warmup_steps + (CFG.steps - CFG.warmup_steps) // 4
    # Cosine stays higher early in the decay and lower late.
    assert lr_at(quarter, cos) > lr_at(quarter, lin)
    late = CFG.steps - (CFG.steps - CFG.warmup_steps) // 4
    assert lr_at(late, cos) < lr_at(late, lin)


def test_constant_stays():
    cfg = dataclasses.replace(CFG, decay="constant")
    assert schedule(cfg)[cfg.warmup_steps :] == [cfg.lr] * (cfg.steps - cfg.warmup_steps)
    assert lr_at(cfg.steps + 10, cfg) == cfg.lr


def test_no_warmup_starts_at_peak():
    cfg = dataclasses.replace(CFG, warmup_steps=0)
    assert lr_at(0, cfg) == pytest.approx(cfg.lr)
    assert lr_at(cfg.steps, cfg) == pytest.approx(cfg.min_lr)


def test_lr_is_a_pure_function_of_step():
    assert schedule(CFG) == schedule(CFG)
    assert lr_at(37, CFG) == lr_at(37, dataclasses.replace(CFG))


def test_optimizer_groups_and_set_lr():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2, bias=False))
    opt = build_optimizer(list(model.parameters()), CFG)
    assert isinstance(opt, torch.optim.AdamW)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    plain = {id(p) for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert decayed == {id(p) for p in model.parameters() if p.ndim >= 2}
    assert plain == {id(p) for p in model.parameters() if p.ndim < 2}
    assert all(g["lr"] == pytest.approx(lr_at(0, CFG)) for g in opt.param_groups)
    set_lr(opt, 0.123)
    assert all(g["lr"] == 0.123 for g in opt.param_groups)
