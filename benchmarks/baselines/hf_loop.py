"""Baseline: a plain PyTorch + transformers training loop (BENCHMARKS' GPU section, benchmarks/gpu.py).

    python benchmarks/baselines/hf_loop.py model=llama3.2_1b data.seq_len=2048 train.dtype=bfloat16
    python benchmarks/baselines/hf_loop.py model=llama3.2_1b data.seq_len=2048 train.dtype=bfloat16 --compile
    python benchmarks/baselines/hf_loop.py model=llama3_debug data.seq_len=32 --micro-batches 2 --steps 2  # CPU

transformers' `LlamaForCausalLM` built from the Hugging Face config rayhybrid's export writes for
the model the overrides select (`ModelSpec.hf.config_to_hf`: the same shape as rayhybrid's run),
attention by sdpa, float32 weights under bfloat16 autocast (train.dtype=bfloat16; float32
otherwise), the token cross-entropy, gradient clipping (train.grad_clip) and a fused AdamW with
rayhybrid's betas and weight decay (matrices only). The batch is random tokens made on the
device once (no data loading). Each step ends by reading its loss, as rayhybrid's steps do, so a
step's time is that of finished work. `--compile`: the forward and the loss under one
`torch.compile` (the whole model, static shapes: each micro-batch size compiles its own).

Every argument but the options is a rayhybrid override; only the model, data.seq_len and train.*
are read (rayhybrid is imported for its config and FLOP count, nothing else). One process
measures the micro-batch sizes of `--micro-batches` as `sweep` says (upwards until one runs out
of memory or `--budget-s` would be exceeded). The last stdout line is one JSON object:

    {"loop": "hf", "device", "device_name", "compile", "compile_backend", "dtype", "seq_len", "flops_per_token",
     "params", "torch", "transformers", "warmup", "start_wall", "imports_done_wall", "built_wall",
     "points": [{"micro_batch", "oom", "step_times_s", "tokens_per_s", "peak_mb", "wall_s",
     "first_step_wall"} or {"micro_batch", "skipped"}, ...]}

`tokens_per_s`: micro_batch x seq_len x the steps after `--warmup`, over their summed time;
`peak_mb`: the CUDA allocator's peak during the point (None on CPU). Walls are `time.time()`.
"""

import time

START_WALL = time.time()  # before any heavy import

import argparse
import gc
import json
import math
import sys


def sweep(points, measure, budget_s=math.inf, capacity_mb=None, clock=time.perf_counter):
    """Measure micro-batch sizes; their results in the order run. From `points[0]` upwards through
    the larger of `points`, stopping at the first that runs out of memory (`oom`) or fails
    (`error`), or before one that the line through the last two fitting points' `peak_mb`
    predicts over `capacity_mb`, or that what is left of `budget_s` would not cover (as long as
    the last point took). When `points[0]` does not fit, its halves downwards until one fits.
    `measure(mb)` returns a dict with `wall_s` (and `oom`, `error`, `peak_mb`); a point not run
    is listed as {"micro_batch", "skipped": why}."""
    start = clock()
    up = sorted(p for p in points if p > points[0])
    done, mb, down = [], points[0], False
    while True:
        done.append({"micro_batch": mb, **measure(mb)})
        last = done[-1]
        if last.get("error"):
            return done
        if last.get("oom"):  # the end of a climb, or nothing fitted yet: halve
            if mb <= 1 or any(not d.get("oom") for d in done[:-1]):
                return done
            nxt, down = mb // 2, True
        elif down or not up:
            return done
        else:
            nxt = up.pop(0)
        why = _skip_reason(done, nxt, clock() - start, budget_s, capacity_mb)
        if why:
            done.append({"micro_batch": nxt, "skipped": why})
            return done
        mb = nxt


def _skip_reason(done, nxt, elapsed, budget_s, capacity_mb):
    if elapsed + done[-1]["wall_s"] > budget_s:
        return f"time budget ({budget_s:.0f} s, {elapsed:.0f} s spent)"
    fitted = [d for d in done if not d.get("oom") and d.get("peak_mb")]
    if capacity_mb and len(fitted) >= 2:
        (b1, m1), (b2, m2) = [(d["micro_batch"], d["peak_mb"]) for d in fitted[-2:]]
        predicted = m2 + (m2 - m1) / (b2 - b1) * (nxt - b2) if b2 != b1 else m2
        if predicted > capacity_mb:
            return f"predicted out of memory ({predicted:,.0f} MB of {capacity_mb:,.0f})"
    return None


def out_of_memory(err: BaseException) -> bool:
    """Whether `err`, or an error behind it, is running out of device memory."""
    seen = set()
    while err is not None and id(err) not in seen:
        if type(err).__name__ == "OutOfMemoryError" or "out of memory" in str(err).lower():
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--micro-batches", default="8,12,16", help="micro-batch sizes, the first tried first")
    parser.add_argument("--warmup", type=int, default=3, help="steps per point before the measured ones")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per point")
    parser.add_argument("--compile", action="store_true", help="torch.compile the forward and loss")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile's backend (tests: eager)")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="start no point past this (see sweep)")
    parser.add_argument("--device", default="auto", help="cuda, cpu, or auto (cuda when there is one)")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        parser.error(f"unknown option(s) {bad}; everything else must be a rayhybrid override")
    try:
        args.micro_batches = [int(x) for x in args.micro_batches.split(",") if x]
    except ValueError:
        parser.error(f"--micro-batches takes comma-separated integers, got {args.micro_batches!r}")
    if not args.micro_batches or min(args.micro_batches) < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--micro-batches must be positive integers, --steps at least 1, --warmup at least 0")
    return args, overrides


class Loop:
    """The model, its optimizer and one training step."""

    def __init__(self, cfg, device, compile_: bool, backend: str = "inductor") -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from rayhybrid.models.registry import get_spec

        spec = get_spec(cfg.model)
        hf = {k: v for k, v in spec.hf.config_to_hf(cfg.model, cfg.data.seq_len).items() if k != "torch_dtype"}
        with torch.device(device):
            self.model = LlamaForCausalLM(LlamaConfig(**{**hf, "use_cache": False}, attn_implementation="sdpa")).train()
        self.params = list(self.model.parameters())
        groups = [
            {"params": [p for p in self.params if p.ndim >= 2], "weight_decay": cfg.train.weight_decay},
            {"params": [p for p in self.params if p.ndim < 2], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
        self.device, self.cfg = device, cfg
        self.bf16 = cfg.train.dtype == "bfloat16"
        self.loss_of = torch.compile(self._loss, dynamic=False, backend=backend) if compile_ else self._loss
        self.flops_per_token = spec.flops_per_token(cfg.model, cfg.data.seq_len)
        self.num_params = spec.num_params(cfg.model, cfg.data.seq_len)

    def _loss(self, inputs, targets):
        import torch
        import torch.nn.functional as F

        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.model(input_ids=inputs).logits
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def step(self, inputs, targets) -> float:
        import torch

        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_of(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.grad_clip, foreach=True)
        self.optimizer.step()
        return loss.item()

    def measure(self, mb: int, warmup: int, steps: int) -> dict:
        """`warmup + steps` steps of micro-batch `mb` (one random batch); its figures."""
        import torch

        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        start, times, oom, first_wall = time.perf_counter(), [], False, None
        seq, vocab = self.cfg.data.seq_len, self.cfg.model.vocab_size
        try:
            tokens = torch.randint(vocab, (mb, seq + 1), device=self.device)
            inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
            for _ in range(warmup + steps):
                t0 = time.perf_counter()
                self.step(inputs, targets)
                times.append(time.perf_counter() - t0)
                first_wall = first_wall or time.time()
        except RuntimeError as err:  # torch.OutOfMemoryError, or an error of torch.compile's around one
            if not out_of_memory(err):
                raise
            oom = True
        # Outside the handler: the traceback's frames (and their tensors) are gone.
        tokens = inputs = targets = None
        if oom:
            self.optimizer.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
        measured = times[warmup:]
        return {
            "oom": oom,
            "step_times_s": [round(t, 5) for t in times],
            "tokens_per_s": None if oom else mb * seq * len(measured) / sum(measured),
            "peak_mb": torch.cuda.max_memory_allocated(self.device) / 2**20 if cuda else None,
            "wall_s": time.perf_counter() - start,
            "first_step_wall": first_wall,
        }


def main(argv=None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    import transformers

    from rayhybrid.errors import ConfigError
    from rayhybrid.preflight import load_config

    try:
        cfg = load_config(overrides)
    except ConfigError as err:
        print(f"hf_loop: error: {err}", file=sys.stderr)
        return 2
    if cfg.model.name != "llama3":
        print(
            f"hf_loop: error: model {cfg.model.name!r}: the loop builds LlamaForCausalLM; pass a llama3 model",
            file=sys.stderr,
        )
        return 2
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    imports_done = time.time()
    loop = Loop(cfg, device, args.compile, args.compile_backend)
    built = time.time()

    def measure(mb):
        result = loop.measure(mb, args.warmup, args.steps)
        print(f"micro-batch {mb}: {json.dumps(result)}", file=sys.stderr, flush=True)
        return result

    capacity = torch.cuda.get_device_properties(device).total_memory / 2**20 if device.type == "cuda" else None
    points = sweep(args.micro_batches, measure, args.budget_s, capacity)
    result = {
        "loop": "hf",
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "compile": args.compile,
        "compile_backend": args.compile_backend if args.compile else None,
        "dtype": cfg.train.dtype,
        "seq_len": cfg.data.seq_len,
        "flops_per_token": loop.flops_per_token,
        "params": loop.num_params,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "warmup": args.warmup,
        "start_wall": START_WALL,
        "imports_done_wall": imports_done,
        "built_wall": built,
        "points": points,
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
