# Hydra YAML for rayhybrid, installed as the package `rayhybrid.conf` (see pyproject.toml).
