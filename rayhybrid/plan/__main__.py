"""`python -m rayhybrid.plan [--json] [overrides...]`: the layout, memory, communication,
bubble and FLOPs of a training configuration, without training.

Takes the same Hydra overrides as `python -m rayhybrid` and checks them the same way. With
`cluster.address=...` (or RAY_ADDRESS) it also reserves the replicas' placement groups on that
Ray cluster, reports each rank's node and bundle, and releases them; otherwise Ray is not
imported. `--json` prints everything as one JSON object instead of text. `--device cpu|cuda` chooses the
device the memory plan is for (what CUDA's kernels save, cuBLAS's workspaces, the caching
allocator's reserve); by default CUDA when the ranks are placed on GPUs or cluster.use_gpu=true.

Exit codes: 0 done, 1 failed, 2 bad configuration (one line on stderr).
"""

from __future__ import annotations

import json
import sys

from rayhybrid.preflight import exit_codes


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return
    as_json = "--json" in argv
    overrides = [a for a in argv if a != "--json"]
    with exit_codes("rayhybrid.plan"):
        overrides, device = _device_option(overrides)
        from rayhybrid.plan.dry_run import build_plan, format_text
        from rayhybrid.plan.trial_placement import cluster_address
        from rayhybrid.preflight import load_config

        cfg = load_config(overrides)
        placement = None
        if cluster_address(cfg):
            from rayhybrid.plan.trial_placement import place

            placement = place(cfg)
        plan = build_plan(cfg, placement, device)
    print(json.dumps(plan, indent=1) if as_json else format_text(plan))


def _device_option(argv: list[str]) -> tuple[list[str], str | None]:
    """`--device cpu|cuda` (or `--device=...`) taken out of `argv`."""
    from rayhybrid.errors import ConfigError

    rest, device = [], None
    it = iter(argv)
    for a in it:
        if a == "--device":
            device = next(it, None)
            if device is None:
                raise ConfigError("--device", "needs a value: cpu or cuda")
        elif a.startswith("--device="):
            device = a.split("=", 1)[1]
        else:
            rest.append(a)
    return rest, device


if __name__ == "__main__":
    main()
