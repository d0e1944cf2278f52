"""Training data: the sample streams every rank reads (`streams.py`: synthetic, text and token
files, and their held-out streams) and what can be known of a data source without reading it
or importing torch (`sources.py`: the text files a path names, token counts, the held-out cut).

Invariant 4 of docs/design.md lives here: sample i is a function of the data config, the seed
and i alone.
"""
