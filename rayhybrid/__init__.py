"""rayhybrid: hybrid data x pipeline x tensor parallel training of PyTorch models on Ray.

python -m rayhybrid +topology=dp2_pp2_tp2      # command line
rayhybrid.train(["+topology=dp2_pp2_tp2"])     # Python; returns the run summary
"""

__version__ = "0.1.0"


def train(overrides=(), *, run_dir=None) -> dict:
    """See `rayhybrid.api.train`."""
    from rayhybrid.api import train as _train

    return _train(overrides, run_dir=run_dir)


__all__ = ["__version__", "train"]
