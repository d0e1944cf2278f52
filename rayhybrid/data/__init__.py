"""Training data: the sample streams every rank reads (`samples.py`: their base; `streams.py`:
synthetic, text and token files, their held-out streams, and `build_stream` for every kind;
`seeds.py`: the seed that keeps held-out data apart) and what can be known of a data source
without reading it or importing torch (`sources.py`: the text files a path names, token counts,
the held-out cut).

Prepared datasets (`python -m rayhybrid.prepare`): their format and `open_prepared`
(`prepared.py`), which window each sample is (`packing.py`), the checks before a run
(`checks.py`) and reading them from any store (`reader.py`).

    from rayhybrid.data import open_prepared
    ds = open_prepared("s3://bucket/tokens")     # .num_documents, .document(i), .tokenizer

Invariant 4 of docs/design.md lives here: sample i is a function of the data config, the seed
and i alone.
"""

from rayhybrid.data.prepared import open_prepared

__all__ = ["open_prepared"]
