"""The constants that keep the data's random streams apart: one home for each, imported by the
prepared format (`prepared.py`), the sample streams (`streams.py`) and the prepared reader
(`reader.py`). Plain integers: no numpy, no torch, no other module of rayhybrid."""

from __future__ import annotations

HELD_OUT = 0x4E1D
"""Mixed into every seed that picks held-out data, so that it is independent of training's: a
prepared dataset's choice of held-out documents (`held_out_documents`, with its number of
documents: the same choice for every reader of one index), synthetic data's held-out stream of
the same chain (`MarkovStream.held_out`) and prepared data's held-out windows
(`PreparedStream.held_out`)."""
