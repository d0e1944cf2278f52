"""`python -m rayhybrid.export --checkpoint <dir> --out <dir>`: see `rayhybrid.export`."""

from rayhybrid.export import main

main()
