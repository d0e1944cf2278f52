#!/usr/bin/env bash
# rayhybrid under another torch of its supported range (README.md, "Supported torch"):
#   scripts/check_torch.sh 2.11 [venv]     (the venv defaults to /tmp/rayhybrid-torch-2.11)
# builds a virtual environment outside the checkout with torch==<version>.* installed first
# (from the package registry: a CUDA build of several GB on Linux), then this checkout with its
# test extra (pip must keep that torch: it is inside the range pyproject.toml declares), and
# runs the tests that lean most on torch (its private APIs, parity with plain PyTorch and
# transformers, gradients, checkpoints, tied pipelines, the memory meter) and a short training
# run of the command line; then the newer features torch's internals carry (compiled blocks,
# float8 through torchao, the data feed, the start-up clock).
set -euo pipefail
version=${1:?usage: scripts/check_torch.sh <torch version, e.g. 2.11> [venv dir]}
venv=${2:-/tmp/rayhybrid-torch-$version}
cd "$(dirname "$0")/.."
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py=$venv/bin/python
"$py" -m pip install -q "torch==$version.*"
"$py" -m pip install -q '.[test]'
installed=$("$py" -c 'import torch; print(torch.__version__)')
case $installed in
"$version".*) echo "torch $installed (kept by pip install '.[test]')" ;;
*) echo "check_torch: torch is $installed after pip install '.[test]', not $version: pip replaced it" >&2 && exit 1 ;;
esac
export PYTHONPATH=$PWD  # this checkout, as installed
failed=0
"$py" -m pytest -q -p no:cacheprovider tests/test_torch_range.py tests/test_private_apis.py tests/test_parity.py \
    tests/test_llama.py tests/test_grad_parity.py tests/test_checkpoint.py tests/test_tied_pipeline.py tests/test_memory.py \
    tests/test_compile.py tests/test_float8.py tests/test_data.py tests/test_startup.py ||
    failed=1
run_dir=$(mktemp -d)
"$py" -m rayhybrid +debug=fast +topology=pp2 train.steps=3 metrics.memory=true "hydra.run.dir=$run_dir/run"
"$py" - "$run_dir/run" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
summary = json.loads((run / "summary.json").read_text())
assert summary["status"] == "completed" and summary["steps"] == 3, summary
log = (run / "__main__.log").read_text()
assert "peak_mb" in (run / "metrics.jsonl").read_text() and "metrics.memory is off" not in log
print(f"check_torch: the CLI run trained {summary['steps']} steps on pp2, metrics.memory on")
PY
rm -rf "$run_dir"
if [ "$failed" = 1 ]; then
    echo "check_torch: torch $installed: the CLI run passed, some tests failed (above)" >&2
    exit 1
fi
echo "check_torch: torch $installed passed"
