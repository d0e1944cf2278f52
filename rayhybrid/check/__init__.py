"""A cluster check before a run: each node the run will use, its devices against the topology,
its Python packages against the driver's, the checkpoint store and the datasets from that node,
and the all-reduce bandwidth inside a node and between nodes (docs/clusters.md, "Checking the
cluster before a run").

`python -m rayhybrid.check <overrides>` runs all of it (`run.check_cluster`); every run's start
runs the per-node checks briefly (`run.startup_check`, cluster.check=brief). Nothing is imported
here: the command's --help imports neither Ray nor torch.
"""
