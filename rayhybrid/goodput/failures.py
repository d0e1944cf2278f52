"""Failure categories, their rates, and the seeded failure trace every strategy runs on.

A category says how a failure shows (a crash, or a hang found only after a timeout), whether it
takes a node out (which must be replaced or repaired), whether a data-parallel peer still holds
the state (peer healing needs one), and whether it comes from outside the training code (the
driver's `Failure.external`). Rates are per GPU-hour, so a preset taken at one size scales to
any other; `failures=exponential` has one category whose rate is the whole job's, and
`failures=meta` one whose rate per GPU is Meta's research clusters' (no breakdown by cause).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rayhybrid.config.goodput import GoodputConfig


@dataclass(frozen=True)
class Category:
    name: str
    per_gpu_hour: float
    hang: bool = False
    """Found after `costs.hang_detect_s` (no process dies), not `costs.detect_s`."""
    node: bool = True
    """Takes one node out: it goes to repair and a spare (or a repaired node) replaces it."""
    peers_survive: bool = True
    """The other data-parallel replicas still hold intact state (false: every process died,
    or the corruption spread to every replica through the gradient all-reduce)."""
    external: bool = True
    """Outside the training code: never the same failure repeating (`Failure.external`)."""


LLAMA3_GPUS, LLAMA3_HOURS = 16_384, 54 * 24
"""Llama 3 405B's pre-training window: 54 days on 16,384 H100 GPUs (Llama 3 paper, Table 5)."""

LLAMA3 = (
    # name, unexpected interruptions in the 54 days, hang, node, peers_survive, external
    ("faulty GPU", 148, False, True, True, True),
    ("GPU HBM3 memory", 72, False, True, True, True),
    ("software bug", 54, False, False, False, False),
    ("network switch/cable", 35, True, True, True, True),
    ("host maintenance", 32, False, True, True, True),
    ("GPU SRAM memory", 19, False, True, True, True),
    ("GPU system processor", 17, False, True, True, True),
    ("NIC", 7, True, True, True, True),
    ("NCCL watchdog timeout", 7, True, False, True, True),
    ("silent data corruption", 6, False, True, False, True),
    ("GPU thermal interface and sensor", 6, False, True, True, True),
    ("SSD", 3, False, True, True, True),
    ("power supply", 3, False, True, True, True),
    ("server chassis", 2, False, True, True, True),
    ("IO expansion board", 2, False, True, True, True),
    ("dependency", 2, False, False, False, False),
    ("CPU", 2, False, True, True, True),
    ("system memory", 2, False, True, True, True),
)
"""Llama 3 405B's 419 unexpected interruptions by cause (the counts sum to 419). Which ones hang,
take a node, or leave peers intact is this simulator's assumption (docs/goodput.md)."""


META_GPUS, META_MTTF_HOURS = 1024, 7.9
"""Meta's research clusters (Kokolis et al., HPCA 2025, arXiv 2410.21680): a mean time to failure
of 7.9 h measured for jobs of 1,024 A100 GPUs, taken here as a constant rate per GPU-hour,
1 / (7.9 x 1,024) = 1.24e-4. The study's other figures imply other rates per GPU (47.7 days for
8-GPU jobs: 1.09e-4; its projection of 1.8 h at 16,384: 3.4e-5), so the job MTBF this preset
gives at 16,384 GPUs (0.49 h) is not the study's projection. No breakdown by cause is used."""


def categories(cfg: GoodputConfig, gpus: int) -> list[Category]:
    """The failure categories of `cfg.failures` for a job of `gpus` GPUs."""
    f = cfg.failures
    if f.preset in ("exponential", "meta"):
        if f.preset == "meta" and f.mtbf_hours == 0:
            rate = 1.0 / (META_MTTF_HOURS * META_GPUS)
        else:
            rate = 1.0 / (f.mtbf_hours * gpus)
        out = [Category("failure", rate * (1.0 - f.hang_share))]
        if f.hang_share > 0:
            out.append(Category("hang", rate * f.hang_share, hang=True))
        return [c for c in out if c.per_gpu_hour > 0]
    assert f.preset == "llama3", f.preset
    scale = 1.0 / (LLAMA3_GPUS * LLAMA3_HOURS)
    out = [Category(name, n * scale, *flags) for name, n, *flags in LLAMA3]
    if f.mtbf_hours > 0:  # keep the breakdown, rescale to this job MTBF
        total = sum(c.per_gpu_hour for c in out) * gpus
        factor = 1.0 / (f.mtbf_hours * total)
        out = [Category(c.name, c.per_gpu_hour * factor, c.hang, c.node, c.peers_survive, c.external) for c in out]
    return out


def job_rate_per_s(cats: list[Category], gpus: int) -> float:
    """Failures per second of the whole job."""
    return sum(c.per_gpu_hour for c in cats) * gpus / 3600.0


MAX_FAILURES = 5_000_000


@dataclass(frozen=True)
class Trace:
    """Failures in wall-clock order: when (s), which category (index), which node (-1: none)."""

    times: list[float]
    kinds: list[int]
    nodes: list[int]


def draw_trace(cats: list[Category], gpus: int, num_nodes: int, seconds: float, seed: int) -> Trace:
    """A Poisson process of failures over `seconds` of wall time: exponential gaps at the job's
    rate, each failure's category drawn by its share of the rate, its node uniformly."""
    rate = job_rate_per_s(cats, gpus)
    expected = rate * seconds
    if expected > MAX_FAILURES:
        raise ValueError(f"{expected:.0f} failures expected, over the {MAX_FAILURES} this simulator draws")
    rng = np.random.default_rng(seed)
    size = int(expected + 10 * np.sqrt(expected) + 100)
    times = np.cumsum(rng.exponential(1.0 / rate, size))
    while times[-1] < seconds:
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1.0 / rate, size))])
    times = times[times < seconds]
    shares = np.array([c.per_gpu_hour for c in cats])
    kinds = rng.choice(len(cats), size=len(times), p=shares / shares.sum())
    nodes = rng.integers(0, num_nodes, size=len(times))
    takes_node = np.array([c.node for c in cats])[kinds]
    nodes = np.where(takes_node, nodes, -1)
    return Trace(times.tolist(), kinds.tolist(), nodes.tolist())
