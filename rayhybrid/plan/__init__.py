"""`python -m rayhybrid.plan`: a dry run of a training configuration. Validates it exactly like
training, then reports the rank layout (and, given a cluster, each rank's node and bundle),
parameters, predicted memory per rank, communication per step, the pipeline bubble and FLOPs.
Nothing trains; Ray is imported only to place against a cluster.

    from rayhybrid.plan import build_plan
    plan = build_plan(load_config(["+topology=dp2_pp2_tp2"]))   # a JSON-able dict

`rayhybrid.plan.estimate` holds the formulas (`model_flops_per_token`, `block_bytes`,
`communication`, ...); `rayhybrid.plan.peak_memory` each rank's peak memory, term by term
(`rank_memory`, built on `estimate`'s formulas); `rayhybrid.plan.schedule` the pipeline
schedules' action orders; `rayhybrid.plan.dry_run` puts them together into the plan
(`build_plan`, `format_text`); `rayhybrid.plan.trial_placement` reserves and releases the
replicas' placement groups on a cluster to say where each rank would run.
"""

__all__ = ["build_plan", "format_text"]


def __getattr__(name: str):
    # Lazy, so that `from rayhybrid.plan.estimate import ...` loads only what it needs.
    if name in __all__:
        from rayhybrid.plan import dry_run

        return getattr(dry_run, name)
    raise AttributeError(name)
