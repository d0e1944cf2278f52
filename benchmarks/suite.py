"""The benchmarks, in the order they run and BENCHMARKS.md lists them: each name's module has
`run(tmp, quick)` (its results, a JSON-able dict), `section(results)` (its part of
BENCHMARKS.md) and `summary(results)` (its line of the printed table). One that only some
machines can run (gpu) returns {"skipped": why} elsewhere, and has a `HEADING` and
`unmeasured()` (its section before any machine has run it)."""

from __future__ import annotations

import batch_search
import checkpoints
import gpu
import overhead
import prepared_data
import recovery
import scaling
import schedules
import startup

BENCHMARKS = {
    "scaling": scaling,
    "overhead": overhead,
    "startup": startup,
    "recovery": recovery,
    "batch_search": batch_search,
    "schedules": schedules,
    "checkpoints": checkpoints,
    "data": prepared_data,
    "gpu": gpu,
}
