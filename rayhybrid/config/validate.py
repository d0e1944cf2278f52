"""The config's own checks (`check`): the settings agree with each other. Every check raises
`ConfigError` naming the setting and the fix.

Pure: no file, no network, no environment variable is looked at, so it is cheap enough to run
for every candidate of a layout search. What the settings name in the world (the data files,
the stores, the trackers' credentials, `cluster.code`'s directory) is checked once per command
by `rayhybrid.preflight.check_environment`; cluster capacity (more ranks than the cluster can
ever place) by the cluster package once it can see the cluster.
"""

from __future__ import annotations

from rayhybrid.config.schema import DTYPES, FLOAT8_MODES, SCHEDULES, Config, float8_mode
from rayhybrid.config.topology import SCHEDULE_TABLE, Layout
from rayhybrid.errors import ConfigError

DECAYS = ("cosine", "linear", "constant")
NUMBERS = {2: "two", 3: "three", 4: "four"}
STRAGGLER_ACTIONS = ("warn", "evacuate", "off")


def _positive(cfg: Config) -> None:
    sections = {
        "topology": ("dp", "pp", "tp", "stages_per_rank"),
        "model": ("n_layers", "vocab_size"),
        "data": ("seq_len", "branching"),
        "train": ("steps", "global_batch_size", "micro_batch_size", "log_every"),
        "cluster": (
            "cpus_per_rank",
            "torch_threads",
            "placement_timeout_s",
            "connect_timeout_s",
            "spot_poll_s",
            "code_max_file_mb",
        ),
        "fault": ("step_timeout_s",),
        "elastic": ("min_dp", "reschedule_timeout_s"),
        "eval": ("batches",),
    }
    for section, names in sections.items():
        for name in names:
            value = getattr(getattr(cfg, section), name)
            if value <= 0:
                raise ConfigError(f"{section}.{name}", f"must be positive, got {value}; set {section}.{name}=1 or more")
    for section, name in (
        ("train", "lr"),
        ("train", "min_lr"),
        ("train", "warmup_steps"),
        ("train", "weight_decay"),
        ("train", "grad_clip"),
        ("cluster", "num_cpus"),
        ("cluster", "intra_node_gbps"),
        ("cluster", "inter_node_gbps"),
        ("checkpoint", "every"),
        ("checkpoint", "keep"),
        ("fault", "max_restarts"),
        ("elastic", "max_dp"),
        ("eval", "every"),
    ):
        value = getattr(getattr(cfg, section), name)
        if value < 0:
            raise ConfigError(f"{section}.{name}", f"must not be negative, got {value}")


def _choice(setting: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(setting, f"unknown value {value!r}; choose one of: {', '.join(choices)}")


def check(cfg: Config) -> None:
    """The settings agree with each other (positive counts, known choices, the stages fit the
    layers, the global batch splits); the first that does not raises ConfigError."""
    t, m, tr = cfg.topology, cfg.model, cfg.train
    _positive(cfg)
    _choice("topology.schedule", t.schedule, SCHEDULES)
    _choice("topology.loss_parallel", str(t.loss_parallel).lower(), ("auto", "true", "false"))
    _choice("train.dtype", tr.dtype, DTYPES)
    _choice("train.decay", tr.decay, DECAYS)
    _float8(cfg)
    _dp_shard(cfg)
    _loss_chunk(tr.loss_chunk)
    if cfg.fault.standby < 0:
        raise ConfigError(
            "fault.standby", f"must not be negative, got {cfg.fault.standby}; set 0 (off) or a count per node"
        )
    _choice("cluster.use_gpu", str(cfg.cluster.use_gpu).lower(), ("auto", "true", "false"))
    _choice("cluster.check", str(cfg.cluster.check).lower(), ("brief", "off"))
    _straggler(cfg.fault)

    virtual = Layout.of(cfg).virtual_stages
    fixed = SCHEDULE_TABLE[t.schedule].stages_per_rank
    if t.pp > 1 and fixed is not None and t.stages_per_rank != fixed:
        raise ConfigError(
            "topology.stages_per_rank",
            f"schedule {t.schedule} runs one stage per rank; set topology.stages_per_rank=1 "
            f"or topology.schedule=interleaved_1f1b"
            if fixed == 1
            else f"schedule {t.schedule} places exactly {NUMBERS.get(fixed, fixed)} stages per rank; "
            f"set topology.stages_per_rank={fixed}",
        )
    stages = Layout.of(cfg).num_stages
    if stages > m.n_layers:
        raise ConfigError(
            "topology.pp",
            f"{t.pp} pipeline ranks x {virtual} stages per rank = {stages} stages but model.n_layers={m.n_layers}; "
            f"every stage needs a layer: lower topology.pp/topology.stages_per_rank or raise model.n_layers",
        )

    if cfg.elastic.enabled:
        _elastic(cfg)
    else:
        _batch_split(cfg, t.dp)
    _held_out(cfg)


def _straggler(fault) -> None:
    _choice("fault.straggler", fault.straggler, STRAGGLER_ACTIONS)
    slowdown = fault.straggler_slowdown
    if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not slowdown > 1:
        raise ConfigError(
            "fault.straggler_slowdown",
            f"must be a ratio above 1, got {slowdown!r}; set e.g. fault.straggler_slowdown=1.2 (20% slower)",
        )
    steps = fault.straggler_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError("fault.straggler_steps", f"must be a whole number of steps >= 1, got {steps!r}; set e.g. 5")


def _dp_shard(cfg: Config) -> None:
    """topology.dp_shard is a bool or an integer N that splits every dp the run may have into
    whole shard groups (an elastic run's elastic.min_dp and max_dp too)."""
    t, value = cfg.topology, cfg.topology.dp_shard
    if isinstance(value, bool):
        return
    fix = "true (FSDP2 over all of dp), false (replicated), or an integer N dividing dp (HSDP over groups of N)"
    if not isinstance(value, int):
        raise ConfigError("topology.dp_shard", f"got {value!r} ({type(value).__name__}); set it to {fix}")
    if value < 0:
        raise ConfigError("topology.dp_shard", f"must not be negative, got {value}; set it to {fix}")
    sizes = [("topology.dp", t.dp)]
    if cfg.elastic.enabled:
        low, high = cfg.elastic.dp_range(t.dp)
        sizes = [("elastic.min_dp", low), ("elastic.max_dp" if cfg.elastic.max_dp else "topology.dp", high)]
    for setting, dp in sizes:
        if value > 1 and dp % value:
            divisors = ", ".join(str(n) for n in range(1, dp + 1) if dp % n == 0)
            raise ConfigError(
                "topology.dp_shard",
                f"{value} does not divide {setting}={dp} (HSDP shards over whole groups of {value} dp ranks); "
                f"use one of {divisors}, true or false, or make {setting} a multiple of {value}",
            )


def _loss_chunk(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            "train.loss_chunk", f"must be a whole number of tokens per chunk (0: off), got {value!r}; set e.g. 1024"
        )


def _float8(cfg: Config) -> None:
    """train.float8 is a known mode, and runs beside bfloat16 autocast (the rest of the block:
    attention, norms). Whether the device has float8 is the workers' to say."""
    mode = float8_mode(cfg.train.float8)
    _choice("train.float8", mode, FLOAT8_MODES)
    if mode != "false" and cfg.train.dtype != "bfloat16":
        raise ConfigError(
            "train.float8",
            f"float8 linear layers run beside bfloat16 autocast, but train.dtype={cfg.train.dtype}; "
            "set train.dtype=bfloat16",
        )


def _held_out(cfg: Config) -> None:
    """data.val_fraction is a fraction, and checkpoint.keep_best has a held-out loss at every
    checkpoint (the data's own held-out checks are `rayhybrid.data.sources.check_data_settings`')."""
    d, ev, ck = cfg.data, cfg.eval, cfg.checkpoint
    if not 0 <= d.val_fraction < 1:
        raise ConfigError("data.val_fraction", f"must be in [0, 1), got {d.val_fraction}; e.g. data.val_fraction=0.01")
    if ck.keep_best:
        if not ev.every:
            raise ConfigError("checkpoint.keep_best", "needs a held-out loss to compare: set eval.every=N")
        if not ck.every or ck.every % ev.every:
            raise ConfigError(
                "checkpoint.keep_best",
                f"every checkpoint needs a val_loss: make checkpoint.every={ck.every} a multiple of eval.every={ev.every}",
            )


def _batch_split(cfg: Config, dp: int) -> None:
    """The global batch splits into whole micro-batches over `dp` replicas (enough of them for
    a 1F1B pipeline)."""
    t, tr = cfg.topology, cfg.train
    per_replica, rem = divmod(tr.global_batch_size, dp * tr.micro_batch_size)
    if rem or per_replica == 0:
        raise ConfigError(
            "train.global_batch_size",
            f"{tr.global_batch_size} is not divisible by dp x micro_batch_size = {dp} x {tr.micro_batch_size}; "
            f"use a multiple of {dp * tr.micro_batch_size}",
        )
    if t.pp > 1 and t.schedule == "1f1b" and per_replica < t.pp:
        raise ConfigError(
            "train.global_batch_size",
            f"1f1b needs at least pp={t.pp} micro-batches per replica but has {per_replica}; "
            f"raise train.global_batch_size to {t.pp * dp * tr.micro_batch_size} or lower train.micro_batch_size",
        )


def usable_dps(cfg: Config, low: int = 1, high: int | None = None) -> list[int]:
    """The data-parallel sizes in [low, high] (default: the elastic range) that split the
    global batch into whole micro-batches."""
    if high is None:
        low, high = cfg.elastic.dp_range(cfg.topology.dp)
    usable = []
    for dp in range(low, high + 1):
        if dp % cfg.topology.dp_multiple:  # HSDP: whole shard groups only
            continue
        try:
            _batch_split(cfg, dp)
        except ConfigError:
            continue
        usable.append(dp)
    return usable


def _elastic(cfg: Config) -> None:
    low, high = cfg.elastic.dp_range(cfg.topology.dp)
    if high < low:
        raise ConfigError(
            "elastic.max_dp", f"{high} is below elastic.min_dp={low}; raise elastic.max_dp or lower elastic.min_dp"
        )
    if not usable_dps(cfg):
        anywhere = usable_dps(cfg, 1, max(high, 64))
        tr = cfg.train
        raise ConfigError(
            "elastic.min_dp",
            f"no dp in [{low}, {high}] splits train.global_batch_size={tr.global_batch_size} into micro-batches of "
            f"{tr.micro_batch_size}; valid dp values: {', '.join(map(str, anywhere)) or 'none'}; "
            "change elastic.min_dp/max_dp or train.global_batch_size",
        )
