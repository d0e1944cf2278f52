"""`python -m rayhybrid.prepare`: tokenize a corpus once into a prepared dataset on any store.

    from rayhybrid.config.prepare import compose_prepare
    from rayhybrid.prepare import prepare
    prepare(compose_prepare(["input=s3://b/raw/*.jsonl", "output=s3://b/tok", "tokenizer=/models/llama3"]))

Inputs (`inputs.py`): text files, JSON Lines, Parquet or a saved Hugging Face dataset, listed
with fsspec and read in sorted order. Tokenizing (`tokenize.py`): an actor pool of Hugging Face
tokenizers, each document `tokenizer(text, add_special_tokens=False)` plus EOS. Shards
(`shards.py`): one per Ray Data write task. The commit (`output.py`): index.json, written last,
in the format `rayhybrid.data.prepared` reads. The run (`run.py`): `prepare(cfg)`.
"""

from rayhybrid.prepare.run import Prepared, prepare

__all__ = ["Prepared", "prepare"]
