"""Batch-size and memory search (`python -m rayhybrid.tune`): see `search.py`."""
