"""`python -m rayhybrid.goodput`: a seeded discrete-event simulation of a long run's failures
(`failures.py`, `engine.py`), recovery strategies compared on the same trace with the driver's
own policies (`simulate.py`), the checkpoint interval from Daly's form (`interval.py`), and
goodput.json and the table (`report.py`). See docs/goodput.md."""
