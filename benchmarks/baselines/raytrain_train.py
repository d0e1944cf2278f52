"""Baseline: Ray Train's TorchTrainer (DDP only: Ray Train does flat data parallelism) on the same
GPT, data, global batch, micro-batches (gradient accumulation), AdamW, LR schedule and clipping.

    python benchmarks/baselines/raytrain_train.py +topology=dp2 --steps 5          # 2 workers
    python benchmarks/baselines/raytrain_train.py --num-workers 8 train.micro_batch_size=2 --steps 5
    python benchmarks/baselines/raytrain_train.py --num-workers 8 train.micro_batch_size=2 --kill-at 3 --steps 6

Other arguments are rayhybrid overrides; `--num-workers` defaults to their dp*pp*tp. Each run
starts and stops a fresh local Ray and prints one JSON object on its last stdout line.
`--steps S`: {"launcher": "raytrain", "num_workers", "step_times_s", "losses", "start_wall",
"ray_init_s", "first_step_wall", "startup": {...}}; nothing is reported inside the loop.
`--kill-at K`: every step reports a checkpoint (model + AdamW, torch.save by rank 0); once the
controller has committed step K's (`--kill-after worker`: once rank 0's report returned) the
driver SIGKILLs rank `--kill-rank` (default 5, or N-1 under 6 workers); FailureConfig(
max_failures=1) restarts the whole group from the latest checkpoint. Prints
{"kill_to_first_step_s", "breakdown", "restarts", ...}; controller times come from a callback on
Ray Train V2's internal hooks. `--health-check-interval` sets RAY_TRAIN_HEALTH_CHECK_INTERVAL_S
(default 2 s): the controller polls workers that often and takes one report per worker per poll.
"""

import time

START_WALL = time.time()

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by Ray's worker processes


def proc_start_wall(pid):
    """Process creation time (Linux /proc, 10 ms resolution), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)  # /proc/stat's btime is whole seconds
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def append(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read(folder, name):
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def train_fn(config):
    fn_start = time.time()
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from rayhybrid.data.streams import build_stream
    from rayhybrid.models.gpt.model import GPT
    from rayhybrid.trainer.optim import build_optimizer, lr_at, set_lr

    torch.set_num_threads(1)
    cfg, events, kill = config["cfg"], config["events"], config["kill_mode"]
    rank, n = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    with open(os.path.join(events, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    marks = {"rank": rank, "proc_start": proc_start_wall(os.getpid()), "fn_start": fn_start, "imported": time.time()}
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model, max_seq_len=cfg.data.seq_len)
    model.init_weights(cfg.seed)
    model = ray.train.torch.prepare_model(model)  # DDP when n > 1 (gloo on CPU)
    raw = getattr(model, "module", model)
    opt = build_optimizer(list(raw.parameters()), cfg.train)
    stream = build_stream(cfg.data, cfg.model.vocab_size, cfg.seed)
    marks["built"] = time.time()
    step, ckpt = 0, ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        raw.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        step = int(state["step"])
    marks.update(loaded=time.time(), resumed_from=step)
    G, m = cfg.train.global_batch_size, cfg.train.micro_batch_size
    per = G // n
    n_micro, tokens = per // m, per * cfg.data.seq_len
    times, losses, reports = [], [], []
    while step < config["steps"]:
        start = time.perf_counter()
        set_lr(opt, lr_at(step, cfg.train))
        opt.zero_grad(set_to_none=True)
        x, y = stream.batch(step * G + rank * per, per)  # this worker's contiguous share
        total = torch.zeros(())
        for i, (xi, yi) in enumerate(zip(x.chunk(n_micro), y.chunk(n_micro))):
            sync = i == n_micro - 1 or not hasattr(model, "no_sync")
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = F.cross_entropy(model(xi).flatten(0, 1).float(), yi.flatten(), reduction="sum") / tokens
                loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.train.grad_clip or float("inf"))
        opt.step()
        if n > 1:
            dist.all_reduce(total)
            total /= n
        step += 1
        times.append(time.perf_counter() - start)
        losses.append(float(total))
        if "first_step_end" not in marks:
            marks["first_step_end"] = time.time()
            append(os.path.join(events, "marks.jsonl"), marks)
        if kill:
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as d:
                checkpoint = None
                if rank == 0:
                    torch.save(
                        {"model": raw.state_dict(), "optim": opt.state_dict(), "step": step},
                        os.path.join(d, "state.pt"),
                    )
                    checkpoint = ray.train.Checkpoint.from_directory(d)
                ray.train.report({"step": step, "loss": losses[-1]}, checkpoint=checkpoint)
            reports.append(time.perf_counter() - t0)
            if rank == 0:  # after report returned: the checkpoint is uploaded, maybe not yet committed
                append(os.path.join(events, "steps.jsonl"), {"step": step, "wall": time.time()})
    return {"step_times_s": times, "losses": losses, "report_s": reports}  # rank 0's: Result.return_value


def controller_callback(events):
    """Logs Ray Train V2 controller events with wall times (internal hooks; None if they moved)."""
    try:
        from ray.train.v2._internal.execution.callback import ControllerCallback, ReportCallback, WorkerGroupCallback
    except ImportError:
        return None

    class Timeline(WorkerGroupCallback, ControllerCallback, ReportCallback):
        def log(self, event, **extra):
            append(os.path.join(events, "controller.jsonl"), {"event": event, "wall": time.time(), **extra})

        def after_worker_group_poll_status(self, status):
            if status.errors:
                self.log("poll_error", ranks=sorted(status.errors))

        def after_report(self, training_report, metrics):  # every rank reported; checkpoint registered
            self.log("report", step=metrics[0].get("step"), checkpoint=training_report.checkpoint is not None)

    hooks = {
        "before_worker_group_shutdown": "shutdown_begin",
        "after_worker_group_shutdown": "shutdown_end",
        "before_worker_group_start": "start_begin",
        "after_worker_group_start": "start_end",
    }
    # start_end: after the callbacks before this one, Ray's torch process-group setup among them
    for hook, event in hooks.items():
        setattr(Timeline, hook, lambda self, *_, _e=event: self.log(_e))
    return Timeline()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--num-workers", type=int, default=0, help="default: dp*pp*tp of the overrides")
    p.add_argument("--kill-at", type=int, default=0, help="recovery mode: kill a worker after step K")
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-after", choices=("controller", "worker"), default="controller")
    p.add_argument("--health-check-interval", type=float, default=None)
    args, overrides = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    from rayhybrid.errors import ConfigError
    from rayhybrid.preflight import load_config

    try:
        cfg = load_config(overrides)
    except ConfigError as err:
        p.error(str(err))
    t, G, m = cfg.topology, cfg.train.global_batch_size, cfg.train.micro_batch_size
    n = args.num_workers or t.dp * t.pp * t.tp
    if G % (n * m):
        p.error(
            f"train.global_batch_size={G} does not split into micro-batches of {m} over {n} workers; "
            f"lower train.micro_batch_size (<= {G // n}) or change --num-workers"
        )
    kill_rank = args.kill_rank if args.kill_rank >= 0 else (5 if n > 5 else n - 1)
    if args.kill_at and not (n > 1 and 0 < kill_rank < n and args.kill_at < args.steps):
        p.error("--kill-at needs >= 2 workers, 0 < --kill-rank < N and K < --steps")
    if args.health_check_interval is not None:
        os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(args.health_check_interval)

    import ray
    import ray.train
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    work = tempfile.mkdtemp(prefix="raytrain_bench_")
    events = os.path.join(work, "events")
    os.makedirs(events)
    t0 = time.time()
    ray.init(num_cpus=max(n, 2), include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    ray_init_s = time.time() - t0
    callback, kill, stop = controller_callback(events), {}, threading.Event()
    by_controller = callback is not None and args.kill_after == "controller"
    source, event = ("controller.jsonl", "report") if by_controller else ("steps.jsonl", None)

    def killer():  # SIGKILL rank `kill_rank` from outside once step K is committed
        while not stop.wait(0.005):
            if any(e.get("step", 0) >= args.kill_at and e.get("event") == event for e in read(events, source)):
                with open(os.path.join(events, f"rank{kill_rank}.pid")) as f:
                    pid = int(f.read())
                kill.update(rank=kill_rank, pid=pid, wall=time.time())
                return os.kill(kill["pid"], signal.SIGKILL)

    trainer = TorchTrainer(
        train_fn,
        train_loop_config={"cfg": cfg, "events": events, "kill_mode": bool(args.kill_at), "steps": args.steps},
        scaling_config=ScalingConfig(num_workers=n, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name="bench",
            storage_path=os.path.join(work, "storage"),
            callbacks=[callback] if callback else None,
            failure_config=FailureConfig(max_failures=1 if args.kill_at else 0),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    if args.kill_at:
        threading.Thread(target=killer, daemon=True).start()
    fit_wall = time.time()
    result = trainer.fit()
    stop.set()
    ray.shutdown()
    error = result.error or (args.kill_at and "wall" not in kill and f"training ended before step {args.kill_at}")
    if error:
        shutil.rmtree(work, ignore_errors=True)
        print(f"raytrain_train: error: {error}", file=sys.stderr)
        return 1
    interval = float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2"))
    out = {
        "launcher": "raytrain",
        "ray_train_v2": ray.train.is_v2_enabled(),
        "num_workers": n,
        "steps": args.steps,
        "global_batch_size": G,
        "micro_batch_size": m,
        "health_check_interval_s": interval,
        "start_wall": START_WALL,
        "ray_init_s": round(ray_init_s, 3),
        "fit_start_wall": fit_wall,
        "end_wall": time.time(),
    }
    out.update(summarize(result.return_value, events, fit_wall, kill, args.kill_at, by_controller))
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out), flush=True)
    return 0


def summarize(res, events, fit_wall, kill, kill_at, by_controller):
    marks, ctl = read(events, "marks.jsonl"), read(events, "controller.jsonl")

    def span(a, b):
        return None if a is None or b is None else round(b - a, 3)

    def phases(since, procs):  # one worker group's start: controller events after `since`, workers' marks
        def at(name):
            return next((e["wall"] for e in ctl if e["wall"] >= since and e["event"] == name), None)

        r0 = next(x for x in procs if x["rank"] == 0)
        last_proc = max((x["proc_start"] or 0) for x in procs) or None
        return (
            at,
            r0,
            {
                "start_group_s": span(at("start_begin"), at("start_end")),  # place + actors + torch dist init
                "last_proc_started_s": span(at("start_begin"), last_proc),  # of that, spawning processes
                "launch_train_fn_s": span(at("start_end"), max(x["fn_start"] for x in procs)),
                "imports_s": span(r0["fn_start"], r0["imported"]),
                "build_model_s": span(r0["imported"], r0["built"]),
                "load_checkpoint_s": span(r0["built"], r0["loaded"]),
                "first_step_s": span(r0["loaded"], r0["first_step_end"]),
            },
        )

    kill_wall = kill.get("wall", float("inf"))
    at, r0, startup = phases(fit_wall, [x for x in marks if x["fn_start"] < kill_wall])
    startup = {"controller_s": span(fit_wall, at("start_begin")), **startup}
    out = {
        "step_times_s": res["step_times_s"],
        "losses": res["losses"],
        "fn_start_wall": r0["fn_start"],
        "first_step_wall": r0["first_step_end"],
        "startup": startup,
    }
    if not kill_at:
        return out
    at, r0, restart = phases(kill_wall, [x for x in marks if x["fn_start"] > kill_wall])
    done = max(e["step"] for e in read(events, "steps.jsonl") if e["wall"] < kill_wall)  # rank 0's, before the kill
    breakdown = {
        "detect_s": span(kill_wall, at("poll_error")),
        "decide_s": span(at("poll_error"), at("shutdown_begin")),
        "teardown_s": span(at("shutdown_begin"), at("shutdown_end")),
        "place_wait_s": span(at("shutdown_end"), at("start_begin")),
        **restart,
    }
    return {
        **out,
        "killed_rank": kill["rank"],
        "killed_pid": kill["pid"],
        "kill_at": kill_at,
        "kill_wall": kill_wall,
        "kill_after": "controller" if by_controller else "worker",
        "kill_to_first_step_s": span(kill_wall, r0["first_step_end"]),
        "breakdown": breakdown,
        "last_step_before_kill": done,
        "resumed_from_step": r0["resumed_from"],
        "steps_redone": done - r0["resumed_from"],
        "restarts": sum(e["event"] == "start_begin" for e in ctl) - 1 if ctl else None,
        "report_s_mean": round(sum(res["report_s"]) / max(1, len(res["report_s"])), 3),
    }


if __name__ == "__main__":
    sys.exit(main())
