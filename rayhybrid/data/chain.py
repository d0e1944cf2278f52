"""The synthetic Markov chain's successors (`successors`) and its walk (`walk`), both vectorised
with numpy and bit for bit what the per-row and per-token Python loops they replace computed
(tests/test_data.py holds them to those loops), so runs, checkpoints and losses stay the same.

    succ = successors(rng, vocab, k)   # = np.stack([rng.choice(vocab, k, replace=False) ...]), rng left alike
    rows = walk(u, succ, cdf, stationary_cdf)   # u: [rows, seq_len + 1] uniforms, one row a sample

`successors` replays numpy's `Generator.choice(n, k, replace=False)` for every row at once:
Floyd's algorithm then a Fisher-Yates shuffle of the k picks, each draw a bounded integer by
Lemire's method from the PCG64 stream's 32-bit halves (numpy/random/_generator.pyx and
src/distributions/distributions.c). It checks its first rows against `choice` itself and falls
back to the loop where numpy draws otherwise (another bit generator, another numpy's algorithm,
numpy's own tail-shuffle path for large k). At a 128256-token vocabulary the whole chain
(successors, then the stationary distribution) builds in 0.19 s, not 0.71 s (docs/data.md).
"""

from __future__ import annotations

import numpy as np

_LOW = np.uint64(0xFFFFFFFF)
_CHECKED_ROWS = 32
"""Rows compared against `Generator.choice` itself before the vectorised result is used."""
_CHUNK = 1 << 16


def successors(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """[n, k] int64: row r is the r-th `rng.choice(n, size=k, replace=False)`, and `rng` is left
    where those n calls leave it."""
    if not _vectorisable(rng, n, k):
        return _loop(rng, n, k)
    start = rng.bit_generator.state
    out, state = _replay(start, n, k)
    check = np.random.Generator(type(rng.bit_generator)())
    check.bit_generator.state = start
    if not np.array_equal(out[:_CHECKED_ROWS], _loop(check, min(n, _CHECKED_ROWS), k, n)):
        rng.bit_generator.state = start
        return _loop(rng, n, k)
    rng.bit_generator.state = state
    return out


def walk(u: np.ndarray, succ: np.ndarray, cdf: np.ndarray, stationary_cdf: np.ndarray) -> np.ndarray:
    """Token ids [rows, T] of chains walked side by side: token 0 is where `u[:, 0]` falls in the
    stationary distribution, token t the successor of token t - 1 where `u[:, t]` falls in its
    row of `cdf`. Each search counts the entries <= u (as `np.searchsorted(side="right")` does:
    a cumulative sum is sorted, and its last entry, 1.0, exceeds every u in [0, 1))."""
    rows, length = u.shape
    k = succ.shape[1]
    flat_succ, flat_cdf = succ.ravel(), cdf.ravel()
    columns = np.arange(k)
    out = np.empty((rows, length), dtype=np.int64)
    state = np.searchsorted(stationary_cdf, u[:, 0], side="right").astype(np.int64)
    out[:, 0] = state
    for t in range(1, length):
        base = state * k
        j = np.count_nonzero(flat_cdf[base[:, None] + columns] <= u[:, t, None], axis=1)
        state = flat_succ[base + j]
        out[:, t] = state
    return out


def _vectorisable(rng: np.random.Generator, n: int, k: int) -> bool:
    """Whether `choice` draws as `_replay` does: PCG64, Floyd's algorithm (numpy takes a tail
    shuffle when n > 10000 and k > n // 50), bounds within 32 bits."""
    return isinstance(rng.bit_generator, np.random.PCG64) and 0 < k <= n < 1 << 32 and not (n > 10000 and k > n // 50)


def _loop(rng: np.random.Generator, rows: int, k: int, n: int | None = None) -> np.ndarray:
    return np.stack([rng.choice(n or rows, size=k, replace=False) for _ in range(rows)])


def _replay(state: dict, n: int, k: int) -> tuple[np.ndarray, dict]:
    """`_loop(n, k)` from bit generator state `state`: the picks and the state after them."""
    # Every row draws bounded integers in [0, r]: Floyd's for r = n-k .. n-1, then the shuffle's
    # r = k-1 .. 1. A bound of 0 draws nothing.
    bounds = np.concatenate([np.arange(n - k, n), np.arange(k - 1, 0, -1)]).astype(np.uint64)
    drawn = bounds > 0
    values = np.zeros((n, len(bounds)), dtype=np.int64)
    draws, after = _bounded(state, np.tile(bounds[drawn], n))
    values[:, drawn] = draws.reshape(n, -1)
    picks = np.empty((n, k), dtype=np.int64)
    for c in range(k):  # Floyd: a value already picked is replaced by the bound itself
        value, bound = values[:, c], n - k + c
        seen = (picks[:, :c] == value[:, None]).any(axis=1)
        picks[:, c] = np.where(seen, bound, value)
    rows = np.arange(n)
    for step, i in enumerate(range(k - 1, 0, -1)):  # Fisher-Yates: swap i with j in [0, i]
        j = values[:, k + step]
        held = picks[rows, j]
        picks[rows, j] = picks[:, i]
        picks[:, i] = held
    return picks, after


def _bounded(state: dict, bounds: np.ndarray) -> tuple[np.ndarray, dict]:
    """Lemire's bounded draws in [0, bounds[d]] from the 32-bit halves of PCG64's outputs (low
    half first; a half left over from before first), a draw whose low product falls under
    2**32 mod (bound + 1) drawing again. Returns the draws and the state after."""
    excl = bounds + np.uint64(1)
    threshold = (np.uint64(1 << 32) - excl) % excl  # numpy's (UINT32_MAX - rng) % rng_excl
    halves = _halves(state, len(bounds) + 1024)
    out = np.empty(len(bounds), dtype=np.uint64)
    start = skipped = 0
    while start < len(bounds):
        stop = min(len(bounds), start + _CHUNK)
        while stop + skipped > len(halves):
            halves = _halves(state, 2 * len(halves))
        m = halves[start + skipped : stop + skipped] * excl[start:stop]
        rejected = np.flatnonzero((m & _LOW) < threshold[start:stop])
        end = start + int(rejected[0]) if len(rejected) else stop
        out[start:end] = m[: end - start] >> np.uint64(32)
        start, skipped = end, skipped + (1 if len(rejected) else 0)
    used = len(bounds) + skipped
    return out.astype(np.int64), _advanced(state, used)


def _halves(state: dict, count: int) -> np.ndarray:
    """The first `count` (or more) 32-bit values `next_uint32` returns from `state`, as uint64."""
    carried = [state["uinteger"]] if state["has_uint32"] else []
    raw = _generator(state).random_raw((count - len(carried) + 1) // 2 + 1)
    halves = np.empty(2 * len(raw), dtype=np.uint64)
    halves[0::2], halves[1::2] = raw & _LOW, raw >> np.uint64(32)
    return np.concatenate([np.array(carried, dtype=np.uint64), halves])


def _advanced(state: dict, used: int) -> dict:
    """The bit generator state after `used` calls of `next_uint32` from `state`."""
    if state["has_uint32"]:
        if used == 0:
            return state
        used -= 1
    bits = _generator(state)
    raws = (used + 1) // 2
    last = bits.random_raw(raws)[-1] if raws else None
    after = bits.state
    after["has_uint32"] = used % 2
    after["uinteger"] = int(last >> np.uint64(32)) if raws else (0 if not state["has_uint32"] else state["uinteger"])
    return after


def _generator(state: dict) -> np.random.PCG64:
    bits = np.random.PCG64()
    bits.state = state
    return bits
