"""The driver: the run as a state machine over the worker group (`controller.py`, `state.py`),
its pure failure and scaling policies (`policies.py`), checkpoint bookkeeping (`checkpoints.py`),
preemption notices (`preemption.py`), typed records and the one writer of a run's files
(`records.py`, `runlog.py`), and the figures computed from the steps (`observe.py`). Never torch."""
