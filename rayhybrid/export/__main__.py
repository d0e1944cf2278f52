"""`python -m rayhybrid.export --checkpoint <dir> --out <dir>`: see `rayhybrid.export.cli`."""

from rayhybrid.export.cli import main

main()
