"""The driver: the run as a state machine over the worker group (`controller.py`, `state.py`),
its pure failure and scaling policies (`policies.py`), the building, rebuilding and restoring of
the group (`launcher.py`, with peer healing in `healing.py`), checkpoint bookkeeping
(`checkpoints.py`), preemption notices (`preemption.py`), typed records and the one writer of a
run's files (`records.py`, `runlog.py`), what it reports to (`reporting.py`), and the figures
computed from the steps (`observe.py`). Never torch."""
