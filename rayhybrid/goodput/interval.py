"""The checkpoint interval from closed forms (exponential failures).

Daly (FGCS 22(3), 2006): with failures at mean interval M (a Poisson process, striking during
saves and restarts too), tau seconds of work between saves, a blocking save of C seconds and R
seconds of downtime after each failure, the share of wall time that does kept work is

    tau / (M * exp(R/M) * (exp((tau + C)/M) - 1))

R scales it but does not move its optimum. Young (CACM 1974): tau ~ sqrt(2 C M), first order
in C/M (no failures during saves or restarts).
"""

from __future__ import annotations

import math


def daly_effective_time(tau: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """Daly's expected share of wall time doing kept work."""
    return tau / (mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((tau + save_s) / mtbf_s))


def young_interval(save_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * save_s * mtbf_s)


def optimal_interval(save_s: float, mtbf_s: float, longest_s: float) -> float:
    """The tau that maximises Daly's form (found by golden-section search on log tau: the form is
    unimodal in tau), at most `longest_s` (the run's length: failures so rare that no save
    would pay off)."""
    if save_s <= 0:
        return 0.0  # saves cost nothing: save as often as possible (the caller's floor)
    if not math.isfinite(mtbf_s):
        return longest_s

    def cost(log_tau: float) -> float:
        return -daly_effective_time(math.exp(log_tau), save_s, 0.0, mtbf_s)

    lo, hi = math.log(1e-6 * mtbf_s), math.log(10.0 * mtbf_s + save_s)
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = cost(a), cost(b)
    while hi - lo > 1e-10:
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = cost(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = cost(b)
    return min(math.exp((lo + hi) / 2.0), longest_s)
