"""rayhybrid checkpoints out to Hugging Face: `python -m rayhybrid.export --checkpoint <dir>
--out <dir>` writes a committed checkpoint, from any topology, as a model directory that
`AutoModelForCausalLM.from_pretrained(<dir>)` loads (the options: `rayhybrid/export/cli.py`).

    from rayhybrid.export import export
    export("s3://bucket/run/checkpoints", "~/hf/mine")   # its latest committed checkpoint

One module per part of the job: the command line (`cli.py`), which checkpoint and which model
(`source.py`), the conversion (`convert.py`: DCP's metadata, the adapter's names, cleaning up
after a failure) and the directory's files (`files.py`: safetensors shards, config.json,
generation_config.json).
"""

from rayhybrid.export.cli import DTYPES, main, parse_args
from rayhybrid.export.convert import export
from rayhybrid.export.files import GENERATION_CONFIG, check_out
from rayhybrid.export.source import find_checkpoint, model_of

__all__ = ["DTYPES", "GENERATION_CONFIG", "check_out", "export", "find_checkpoint", "main", "model_of", "parse_args"]
