"""What torch's CUDA caching allocator reserves around the live tensor bytes the planner counts
(rayhybrid/plan/peak_memory.py's `rank_memory`): the "reserved" peak that decides whether a step
fits a GPU, as `torch.cuda.max_memory_reserved` reports it. No torch.

The allocator's rules (c10/cuda/CUDACachingAllocator.cpp, torch 2.13, default settings: no
`expandable_segments`, no `max_split_size_mb`):

- every block is rounded up to a multiple of 512 B (`block_size`);
- blocks of at most 1 MiB come from the small pool, whose segments (one cudaMalloc each) are
  2 MiB; larger blocks from the large pool, whose segments are 20 MiB for a block under 10 MiB
  and the block rounded up to 2 MiB otherwise (`segment_size`);
- a free block is split to serve a smaller request (large pool: when more than 1 MiB is left),
  segments are never merged, and cached segments are released (and the cudaMalloc retried)
  only when a cudaMalloc fails: an out-of-memory error means that even with every unused
  segment given back the request did not fit beside the segments still partly in use.

So the reserved peak is the live bytes, plus each pool's rounding (`pool_waste`, counted for the
tensors that stay allocated the whole step: parameters, gradients, optimizer state, autocast's
copies), plus fragmentation: a segment made for one of the step's largest tensors, once freed,
is split for smaller ones while the next tensor of that size is asked for (the float32 logits of
the loss are made in forward and again, twice, in its backward), which then needs a segment of
its own. `fragmentation` counts one segment of the step's largest allocation: the worst a
pattern of one large tensor alive at a time strands. Measured on an H200 (Llama 3.2 1B, seq
2048, bfloat16, 143,156 MB): micro-batch 16 trained (121,440 MB allocated; + 16,032 MB, its
float32 logits, = 137,472 MB, under the card) and 17 ran out of memory (127,994 MB allocated
by the plan; + 17,034 MB = 145,028, over it).
"""

from __future__ import annotations

from collections.abc import Iterable

MiB = 2**20
MIN_BLOCK = 512  # kMinBlockSize: every block is a multiple of it
SMALL_SIZE = 1 * MiB  # kSmallSize: blocks up to this come from the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: the small pool's segments
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: blocks under it share LARGE_BUFFER segments
LARGE_BUFFER = 20 * MiB  # kLargeBuffer
ROUND_LARGE = 2 * MiB  # kRoundLarge: larger segments are rounded up to it


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def block_size(nbytes: int) -> int:
    """The block a request of `nbytes` gets: a multiple of 512 B, at least 512 (0: none)."""
    return 0 if nbytes <= 0 else max(MIN_BLOCK, _round_up(nbytes, MIN_BLOCK))


def segment_size(nbytes: int) -> int:
    """The segment (cudaMalloc) a request of `nbytes` makes when no cached block fits it."""
    block = block_size(nbytes)
    if block == 0:
        return 0
    if block <= SMALL_SIZE:
        return SMALL_BUFFER
    if block < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return _round_up(block, ROUND_LARGE)


def pool_waste(sizes: Iterable[int]) -> int:
    """Bytes reserved beyond `sizes` when tensors of these sizes are allocated and kept: small
    blocks packed into 2 MiB segments, blocks under 10 MiB into 20 MiB segments, each larger one
    in a segment of its own rounded up to 2 MiB."""
    small = mid = large = 0
    live = 0
    for n in sizes:
        block = block_size(n)
        live += n
        if block == 0:
            continue
        if block <= SMALL_SIZE:
            small += block
        elif block < MIN_LARGE_ALLOC:
            mid += block
        else:
            large += segment_size(n)
    return _round_up(small, SMALL_BUFFER) + _round_up(mid, LARGE_BUFFER) + large - live


def fragmentation(largest: int) -> int:
    """The reserve for fragmentation: one segment of the step's largest allocation."""
    return segment_size(largest)


def reserved_bytes(allocated: int, resident: Iterable[int], largest: int) -> int:
    """The reserved peak: `allocated` (the planner's live bytes at the peak) plus the rounding of
    the `resident` tensors' pools and `fragmentation(largest)`."""
    return allocated + pool_waste(resident) + fragmentation(largest)
