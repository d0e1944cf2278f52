"""The tuner (`python -m rayhybrid.tune`): short runs of the real trainer find the batch shape or
the layout to train with. `run.py` drives Ray Tune; the searches are free of Ray:
`microbatch.py` (`tune.search=micro_batch`, with `memory_search.py`'s largest micro-batch that
fits), `layout.py` (`tune.search=layout`); `trials.py` holds what a trial is and measured,
`space.py` a trial's config, `ray_searcher.py` the Ray Tune searcher, `report.py` the outputs."""
