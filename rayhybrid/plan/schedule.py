"""The order in which one pipeline rank runs its forward and backward chunks, per schedule.

`rank_actions(schedule, pp, rank, m, v)` lists `(kind, stage, microbatch)` for pipeline rank
`rank`: kind `F` (forward), `B` (full backward), `I` (backward for the inputs only) or `W`
(backward for the weights). The orders mirror what `torch.distributed.pipelining` 2.13 runs
(`Schedule1F1B._step_microbatches`, `ScheduleGPipe`, `_get_warmup_ops` + `_get_1f1b_rank_ops`
for the interleaved schedules, `ScheduleZBVZeroBubble._calculate_single_rank_operations`), minus
the idle slots, which do not change what a rank holds. The memory estimate walks them to find
how many micro-batches each stage holds at the rank's peak.

Pure Python: no torch, no Ray.
"""

from __future__ import annotations

from collections import defaultdict

Action = tuple[str, int, int]


def rank_actions(schedule: str, pp: int, rank: int, m: int, v: int = 1) -> list[Action]:
    if pp == 1:
        # No pipeline: gradient accumulation, one micro-batch at a time.
        return [a for k in range(m) for a in (("F", 0, k), ("B", 0, k))]
    if schedule == "gpipe":
        return [("F", rank, k) for k in range(m)] + [("B", rank, k) for k in range(m)]
    if schedule == "1f1b":
        return _one_f_one_b(pp, rank, m)
    if schedule in ("interleaved_1f1b", "interleaved_zb"):
        return _interleaved(pp, rank, m, v, zero_bubble=schedule == "interleaved_zb")
    if schedule == "zbv":
        return _zbv(pp, rank, m)
    raise ValueError(f"unknown schedule {schedule!r}")


def _one_f_one_b(pp: int, rank: int, m: int) -> list[Action]:
    warmup = min(m, pp - rank)
    out: list[Action] = [("F", rank, k) for k in range(warmup)]
    f, b = warmup, 0
    while True:  # 1B1F: a backward, then a forward
        out.append(("B", rank, b))
        b += 1
        if f == m:
            break
        out.append(("F", rank, f))
        f += 1
    out += [("B", rank, k) for k in range(b, m)]
    return out


def _interleaved(pp: int, rank: int, m: int, v: int, zero_bubble: bool) -> list[Action]:
    rounds = max(1, m // pp)
    per_round = m // rounds
    # torch's _get_warmup_ops: multiply_factor 2 for interleaved 1F1B, 1 for zero bubble.
    factor = 1 if zero_bubble else 2
    warmup = min((v - 1) * per_round + factor * (pp - 1 - rank), m * v)
    fwd_bwd = m * v - warmup
    cooldown = m * v - fwd_bwd
    one_f_one_b = rank if zero_bubble else 0

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * pp + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * pp + rank

    fwd_mb: dict[int, int] = defaultdict(int)
    bwd_mb: dict[int, int] = defaultdict(int)
    w_mb: dict[int, int] = defaultdict(int)
    out: list[Action] = []
    backward_ops: list[int] = []
    weights_done = 0
    backward_kind = "I" if zero_bubble else "B"

    def next_mb(counter: dict[int, int], stage: int) -> int:
        counter[stage] += 1
        return counter[stage] - 1

    def weight() -> None:
        nonlocal weights_done
        stage = bwd_stage(backward_ops[weights_done])
        out.append(("W", stage, next_mb(w_mb, stage)))
        weights_done += 1

    for op in range(warmup + fwd_bwd + cooldown):
        if op < warmup:
            stage = fwd_stage(op)
            out.append(("F", stage, next_mb(fwd_mb, stage)))
            continue
        if op < warmup + fwd_bwd:
            stage = fwd_stage(op)
            out.append(("F", stage, next_mb(fwd_mb, stage)))
        stage = bwd_stage(op)
        out.append((backward_kind, stage, next_mb(bwd_mb, stage)))
        backward_ops.append(op)
        if zero_bubble and op - warmup >= one_f_one_b:
            weight()
    while zero_bubble and weights_done < len(backward_ops):
        weight()
    return out


def _zbv(pp: int, rank: int, m: int) -> list[Action]:
    n_micro = max(2 * pp - 1, m)  # torch pads to 2pp - 1 and drops the padding's actions
    s0, s1 = rank, 2 * pp - 1 - rank
    f0 = f1 = b0 = b1 = 0
    out: list[Action] = []
    for _ in range(2 * (pp - rank) - 1):
        out.append(("F", s0, f0))
        f0 += 1
    for _ in range(rank):
        out += [("F", s1, f1), ("F", s0, f0)]
        f1 += 1
        f0 += 1
    for _ in range(pp - rank):
        out += [("F", s1, f1), ("I", s1, b1), ("W", s1, b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n_micro:
        if f0 < n_micro:
            out.append(("F", s0, f0))
            f0 += 1
        out += [("I", s0, b0), ("W", s0, b0)]
        b0 += 1
        out += [("F", s1, f1), ("I", s1, b1), ("W", s1, b1)]
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        out += [("I", s0, b0), ("I", s1, b1)]
        b0 += 1
        b1 += 1
    for _ in range(pp - rank):
        out += [("I", s0, b0), ("W", s0, w0)]
        b0 += 1
        w0 += 1
    out += [("W", s1, k) for k in range(w1, b1)]
    out += [("W", s0, k) for k in range(w0, b0)]
    return [a for a in out if a[2] < m]
