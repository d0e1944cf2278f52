"""What a checkpoint records of the data it was trained on (`data` in its meta.json): what fixes
sample i besides the seed and seq_len (docs/design.md, invariant 4).

    data_identity(cfg.data)    # from the config alone: what the driver compares before a resume
    stream.identity()          # what the training stream records in each checkpoint (the same)

The driver computes it from the config, without torch and before any worker starts, for
`rayhybrid.driver.compatibility.check_fits`; the streams record the same value
(tests/test_data_prepared.py holds the two equal for every kind of data). For prepared data that
reads each dataset's index.json (its fingerprint), with data.storage_options.
"""

from __future__ import annotations

from rayhybrid.config.schema import DataConfig
from rayhybrid.data.packing import ORDER, Mixture, mixture_entries
from rayhybrid.data.prepared import read_index
from rayhybrid.data.sources import KINDS

GENERATED, WINDOWS = "MarkovStream", "WindowStream"
"""The kinds data other than prepared records: the names of the streams that read it
(`rayhybrid.data.streams`), as checkpoints have always recorded them."""


def prepared_identity(fingerprints: list[str], weights) -> dict:
    """A mixture of prepared datasets: their fingerprints, their normalised weights (as
    `Mixture` normalises them) and the epoch order the windows are drawn in."""
    return {
        "kind": "prepared",
        "datasets": list(fingerprints),
        "weights": [round(float(w), 12) for w in weights],
        "order": ORDER,  # which window each sample reads (packing.shuffled)
    }


def data_identity(d: DataConfig) -> dict:
    """The identity the training stream of `d` records (`SampleStream.identity`)."""
    if d.name == "prepared":
        entries = mixture_entries(d)
        fingerprints = [read_index(url, d.storage_options, setting).fingerprint for setting, url, _ in entries]
        return prepared_identity(fingerprints, Mixture([w for _, _, w in entries]).weights)
    return {"kind": WINDOWS if KINDS[d.name].reads_path else GENERATED}
