"""Where a run's files live: stores (a local path, a shared mount or any fsspec URL) and the
redaction of their secrets (`store.py`), checkpoint directories with their commit marker and
retention (`checkpoints.py`), and the start-up check that every node sees the same store
(`visibility.py`, which asks Ray). No torch here.

    from rayhybrid.storage import Store, redact_url
    from rayhybrid.storage import checkpoints
"""

from rayhybrid.storage.store import (
    Store,
    forwarded_env,
    is_remote,
    one_line,
    open_store,
    redact,
    redact_url,
    scrub,
    secret_values,
)

__all__ = [
    "Store",
    "forwarded_env",
    "is_remote",
    "one_line",
    "open_store",
    "redact",
    "redact_url",
    "scrub",
    "secret_values",
]
