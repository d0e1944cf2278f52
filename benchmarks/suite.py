"""The benchmarks, in the order they run and BENCHMARKS.md lists them: each name's module has
`run(tmp, quick)` (its results, a JSON-able dict), `section(results)` (its part of
BENCHMARKS.md) and `summary(results)` (its line of the printed table)."""

from __future__ import annotations

import batch_search
import checkpoints
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
}
