"""The configuration schema: frozen dataclasses, the only thing workers ever see.

Hydra composes YAML from `conf/` on top of these (see `compose.py`); field names are part of
the public interface (`topology.dp=4`, `train.lr=1e-3`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from rayhybrid.config.topology import SCHEDULE_TABLE, dp_multiple, shard_group_size

SCHEDULES = tuple(SCHEDULE_TABLE)
"""Pipeline schedules, by config name. `interleaved_zb` and `zbv` are zero-bubble schedules."""

DTYPES = ("float32", "bfloat16")
FLOAT8_MODES = ("false", "true", "emulate")
"""train.float8: off, float8 matmuls (a GPU of CUDA capability 8.9+), torchao's emulation."""


def float8_mode(value: object) -> str:
    """`train.float8` as one of FLOAT8_MODES (the command line's `true` arrives as bool True)."""
    return str(value).lower()


def every_n(every: int, step: int, steps: int) -> bool:
    """An `every` setting: due after every `every`-th step and after the last (0: never)."""
    return every > 0 and (step % every == 0 or step == steps)


@dataclass(frozen=True)
class TopologyConfig:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    """Virtual pipeline stages per rank (interleaved schedules; `zbv` needs 2)."""
    dp_shard: Any = False
    """false (or 1): replicated data parallelism; true: FSDP2 sharding of parameters, gradients
    and optimizer state over all of dp; an integer N dividing dp: HSDP, sharded over groups of
    N consecutive dp ranks and replicated across the dp / N groups (N = dp: as true). Typed Any
    so that a wrong value reaches the config check, which names the fix."""
    loss_parallel: str = "auto"
    """Keep the logits sharded over the vocabulary into the loss (tp > 1): true, false, or auto
    (when model.vocab_size >= 8192, where gathering full logits costs more memory and bandwidth
    than the loss's extra small all-reduces)."""

    @property
    def shard_group(self) -> int:
        """The dp ranks each parameter is sharded over (1: replicated; dp: FSDP2 over all;
        between: HSDP): the one answer every part of rayhybrid asks (config/topology.py)."""
        return shard_group_size(self.dp_shard, self.dp)

    @property
    def hsdp(self) -> bool:
        """Sharded within groups and replicated across them (1 < shard_group < dp)."""
        return 1 < self.shard_group < self.dp

    @property
    def dp_multiple(self) -> int:
        """dp moves in multiples of this (the shard group of an integer dp_shard, else 1)."""
        return dp_multiple(self.dp_shard)

    def use_loss_parallel(self, vocab_size: int) -> bool:
        if self.tp == 1:
            return False
        choice = str(self.loss_parallel).lower()  # the command line's `true` arrives as bool True
        if choice == "auto":
            return vocab_size >= 8192
        return choice == "true"


@dataclass(frozen=True)
class ModelConfig:
    """The model: which one (`name`, or `module` for one defined outside rayhybrid), the shape
    every model family has, and the family's own settings (`options`).

    Shape fields a model does not use must keep their defaults (its spec's validation says so).
    What only one family reads is not a field here: it is a field of that family's settings
    dataclass (rayhybrid/models/<family>/settings.py), set under `options`."""

    name: str = "gpt"
    """A built-in model (see rayhybrid/models/registry.py): gpt or llama3."""
    flavor: str = "gpt_tiny"
    """The preset the shape came from (conf/model/<flavor>.yaml); informational."""
    module: str = ""
    """An importable module (my_package.my_model) exposing `SPEC`, a rayhybrid ModelSpec: a model
    defined outside rayhybrid. Set, it replaces `name`'s built-in model."""
    n_layers: int = 4
    n_heads: int = 4
    d_model: int = 64
    vocab_size: int = 256
    ffn_mult: int = 4
    """MLP width as a multiple of d_model, when ffn_dim is 0."""
    ffn_dim: int = 0
    """MLP width (Hugging Face's intermediate_size); 0: ffn_mult x d_model."""
    head_dim: int = 0
    """Per-head width; 0: d_model // n_heads. GPT-3 XL uses 24 heads of 128 on d_model 2048."""
    max_positions: int = 0
    """Longest sequence the model was made for (Hugging Face's max_position_embeddings, written
    on export); 0: data.seq_len."""
    init_from: str = ""
    """Start from a Hugging Face checkpoint: a local directory with config.json and safetensors
    (what save_pretrained writes). Its config.json sets the shape."""
    options: dict[str, Any] = field(default_factory=dict)
    """The model family's own settings, `model.options.K=V` (`model.options.rope_theta=500000`
    for llama3): the fields of the settings dataclass its spec names
    (rayhybrid/models/<family>/settings.py), checked by name; free-form for a model.module
    whose spec names none."""

    @property
    def head_width(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def attn_dim(self) -> int:
        """Width of the attention projections: n_heads * head_dim."""
        return self.n_heads * self.head_width

    @property
    def hidden_dim(self) -> int:
        """MLP width: ffn_dim, or ffn_mult x d_model."""
        return self.ffn_dim or self.ffn_mult * self.d_model


@dataclass(frozen=True)
class MixEntry:
    """One dataset of a mixture (data.mix): a prepared dataset and its weight."""

    path: str = ""
    weight: float = 1.0


@dataclass(frozen=True)
class DataConfig:
    name: str = "synthetic"
    seq_len: int = 64
    # synthetic: a random sparse Markov chain over model.vocab_size tokens
    branching: int = 4
    """Successors per token in the synthetic Markov chain (its loss floor falls with this)."""
    # text: local text files read as bytes; tokens: a memory-mapped file of token ids;
    # prepared: datasets written by `python -m rayhybrid.prepare`, on any store (docs/data.md)
    path: str = ""
    """text: a file, a directory of *.txt files or a glob; tokens: a .bin/.npy file of token ids;
    prepared: the URL or path of a prepared dataset."""
    mix: tuple[MixEntry, ...] = ()
    """prepared: a weighted mixture instead of data.path, e.g.
    data.mix=[{path:s3://b/web,weight:0.7},{path:s3://b/code,weight:0.3}] (weights normalised)."""
    cache_dir: str = ""
    """prepared: keep what each node read on its disk here (shared by the node's ranks); empty: none."""
    read_ahead: int = 2
    """Every kind: steps of samples read in the background ahead of training; 0: read when needed."""
    trace: bool = False
    """Write what each rank read (step, sample, dataset, epoch, start) to the run's data_trace/."""
    token_dtype: str = "uint16"
    """tokens: dtype of a raw .bin file (a .npy file carries its own)."""
    # held-out data for eval.* (synthetic data needs none: it draws an independent stream)
    val_path: str = ""
    """text, tokens, prepared: held-out data in the same form as data.path, which training never
    reads (prepared: by default the documents prepare held out with val_fraction)."""
    val_fraction: float = 0.0
    """text, tokens (without data.val_path): hold out this tail fraction of data.path's tokens
    for evaluation; training reads only the rest. 0: none."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """prepared: options for the fsspec filesystem of data.path, data.val_path and data.mix's
    datasets (s3: endpoint_url, key, secret, ...), as checkpoint.storage_options is for
    checkpoint.dir; values under secret keys are redacted wherever the config is written."""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 150
    global_batch_size: int = 16
    micro_batch_size: int = 4
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    decay: str = "cosine"
    """LR decay after warmup: cosine, linear or constant."""
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    dtype: str = "float32"
    float8: str = "false"
    """The blocks' linear layers train in float8 (torchao's recipe, rayhybrid/parallel/float8.py):
    true (a GPU of CUDA capability 8.9 or more: H100, H200; `pip install 'rayhybrid[float8]'`),
    emulate (torchao's emulation on any device: float8's numerics, slowly; tests, CPU
    debugging) or false. Needs train.dtype=bfloat16."""
    activation_checkpointing: bool = False
    offload_activations: bool = False
    """What each transformer block saves for backward is copied to (pinned) host memory in
    forward and back to the device for backward, overlapped with compute on CUDA
    (rayhybrid/parallel/offload.py). With activation_checkpointing only each block's input moves.
    The planner shows the device peak without the blocks' activations and a host figure."""
    compile: bool = False
    """torch.compile each transformer block on its own (regional compilation, inductor), after
    tensor parallelism and activation checkpointing, before FSDP2 (rayhybrid/parallel/compile.py).
    The first step pays the compile; its artifacts are cached on the node
    ($TORCHINDUCTOR_CACHE_DIR/rayhybrid, else /tmp/torchinductor_<user>/rayhybrid), so the next
    process there loads them. Off by default: docs/configuration.md has the measured trade."""
    loss_chunk: int = 1024
    """Tokens per chunk of the output projection and cross-entropy (rayhybrid/trainer/loss.py):
    no float32 logits of the whole micro-batch exist, forward or backward; 0: whole logits.
    Models with `chunked_head` (gpt, llama3) and the default cross-entropy only; a family's own
    loss reads whole logits."""
    log_every: int = 1


@dataclass(frozen=True)
class ClusterConfig:
    address: str = ""
    """Ray address to join; empty: RAY_ADDRESS, else start a local Ray on 127.0.0.1."""
    use_gpu: str = "auto"
    """auto: one GPU per rank when the cluster has GPUs; true: require them; false: CPU (gloo)."""
    placement_timeout_s: float = 120.0
    connect_timeout_s: float = 30.0
    """How long to try to reach cluster.address (or RAY_ADDRESS) before giving up with exit 2."""
    num_cpus: int = 0
    """Logical CPUs for a local Ray; 0: enough for the ranks."""
    cpus_per_rank: float = 1.0
    torch_threads: int = 1
    spot_notices: bool = True
    """Watch for AWS and GCP spot notices on every node of the run and turn one into Ray's drain
    with the notice's deadline (rayhybrid/cluster/spot_watch.py); the run then saves and moves
    off the node. Without a cloud metadata server it starts nothing (one failed probe)."""
    spot_poll_s: float = 5.0
    """How often each node's watcher asks the metadata server (AWS suggests every 5 s)."""
    code: str = "auto"
    """The model's code on every node, shipped by the driver with Ray's runtime environment
    (rayhybrid/cluster/code.py): auto (the top-level package directory or the .py file that
    defines model.module, as py_modules, unless it is installed, is rayhybrid, or came with
    the Ray Job's own runtime environment), off (ship nothing: install it on every node), or a
    directory to ship as Ray's working_dir (the workers run in it)."""
    code_max_file_mb: float = 10.0
    """A file larger than this (MB of 2**20 bytes) in what would be shipped stops the run before
    it starts (exit 2, one line naming the files); .rayignore and .gitignore leave files out."""
    ray_metrics: bool = False
    """Ray's metrics (every Ray process's stats and the node's Prometheus endpoint) on the
    local Ray that rayhybrid starts itself when neither cluster.address nor RAY_ADDRESS is
    set. Off: nothing reads them there, and exporting them takes CPU from the ranks. A
    cluster the run joins keeps its own setting."""
    check: str = "brief"
    """At the start of every run, a check of each node the run will use (rayhybrid/check/, the
    per-node checks of `python -m rayhybrid.check` without its bandwidth test): brief (its
    problems logged as warnings and recorded as a `check` event; a node whose torch or
    rayhybrid version differs from the driver's stops the run, exit 2) or off."""
    intra_node_gbps: float = 0.0
    """The all-reduce bandwidth (bus GB/s, as nccl-tests count it) the run counts on between
    the ranks of one node; 0: the default for the backend (rayhybrid/check/bandwidth.py:
    nccl 20, gloo 0.5). `python -m rayhybrid.check` names a node below half of it."""
    inter_node_gbps: float = 0.0
    """The same between nodes; 0: the default for the backend (nccl 5, gloo 0.1)."""


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""
    """Where checkpoints go: a path (on a multi-node cluster, a mount every node shares) or a URL
    of any fsspec store whose package is installed (s3://bucket/prefix, gs://..., file://...);
    empty: <run dir>/checkpoints. A run whose dir holds a checkpoint resumes from it."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Options for the store's fsspec filesystem (s3: endpoint_url, profile, ...). Credentials
    are better left to the store's own environment variables and files; values under secret
    keys (key, secret, token, ...) are redacted wherever the config is written."""
    async_save: bool = True
    """Write checkpoints in the background: training waits only while the state is copied."""
    every: int = 50
    """Save every N optimizer steps (and at the end); 0: never."""
    keep: int = 2
    """How many published checkpoints to keep; 0: all."""
    keep_best: bool = False
    """Also keep the checkpoint with the lowest val_loss (needs eval.every, and checkpoint.every
    a multiple of it, so every checkpoint has one)."""

    def due(self, step: int, steps: int) -> bool:
        """Whether a checkpoint is saved after `step` of a run of `steps` steps."""
        return every_n(self.every, step, steps)

    @property
    def enabled(self) -> bool:
        """Whether the run writes checkpoints at all (checkpoint.every=0: never)."""
        return self.every > 0


@dataclass(frozen=True)
class FaultConfig:
    max_restarts: int = 3
    """Restarts from the latest checkpoint after a worker or node failure before giving up."""
    step_timeout_s: float = 300.0
    """A step that makes no progress for this long counts as a failure (a hung worker)."""
    inject: tuple[str, ...] = ()
    """Faults to inject, to rehearse failures: each KIND@STEP or KIND@STEP:RANK, e.g.
    `fault.inject=[kill@5,hang@9:3]`. KIND: one of rayhybrid/faults/kinds.py's KINDS, which says
    where each fires and what it does (kill, hang, raise at the start of step STEP; kill_save in
    its checkpoint save; kill_eval in its evaluation). STEP: 1-based optimizer step. RANK: the
    victim; without it, one drawn with fault.inject_seed. Each fires once per run."""
    inject_rate: float = 0.0
    """Random faults: the chance in [0, 1] that a step gets one (each step number drawn once)."""
    inject_kinds: tuple[str, ...] = ("kill", "hang", "raise")
    """Kinds a random fault is drawn from (rayhybrid/faults/kinds.py's RANDOM_KINDS)."""
    inject_seed: int = 0
    """Seeds the random faults and the ranks drawn for fault.inject entries without a RANK."""
    standby: int = 1
    """Warm standby workers per node of the run's ranks: processes started ahead of need, torch,
    rayhybrid and the model's code imported, holding no CPU or GPU of Ray's, that take a lost
    rank's place (or a new replica's) at no process start (rayhybrid/cluster/standby.py); 0: off.
    None start for tuning trials, nor with fault.max_restarts=0 unless elastic.enabled."""
    heal: bool = True
    """Peer healing: after a failure, when every shard of the lost ranks still has a live copy
    on another data-parallel replica, the survivors keep their state in memory and the new
    ranks receive theirs from those copies: no completed step is trained again. Otherwise (dp=1,
    topology.dp_shard=true, both copies lost) the run restores the latest checkpoint. With dp >= 2
    each step ends with a one-value all-reduce of every rank (the commit vote)."""
    nccl_like: bool = False
    """A test mode for gloo (CPU): collectives fail as they do on NCCL when a peer dies. A failed
    collective is recorded instead of raised, its tensor left partly reduced, and the host goes
    on; the failure is raised as the next step begins (rayhybrid/faults/async_collectives.py)."""
    straggler: str = "warn"
    """What a straggler makes the run do: `warn` (name it: a warning, a `straggler` event,
    summary.json's `stragglers`), `evacuate` (name it, then move off its node as off a drained
    one: the step checkpointed, Ray asked to drain the node) or `off`. A straggler: a rank
    whose own compute time is at least fault.straggler_slowdown times the median of its peers'
    (the other ranks of its pipeline stage) for fault.straggler_steps steps in a row
    (rayhybrid/driver/stragglers.py)."""
    straggler_slowdown: float = 1.2
    """How much slower than its peers' median a rank's compute must be to count (> 1)."""
    straggler_steps: int = 5
    """Steps in a row a rank must be that slow to be named (>= 1); as many steps below it end
    its episode (it may then be named again)."""


@dataclass(frozen=True)
class ElasticConfig:
    enabled: bool = False
    """Vary the number of data-parallel replicas (pp x tp each) with what the cluster can place."""
    min_dp: int = 1
    """Start as soon as this many replicas are placed; never continue with fewer."""
    max_dp: int = 0
    """Ask the cluster for this many replicas (pending ones show the autoscaler the demand);
    0: topology.dp."""
    reschedule_timeout_s: float = 10.0
    """After a failure, how long a replica that lost its node may take to be placed again
    before the run shrinks without it."""

    def dp_range(self, topology_dp: int) -> tuple[int, int]:
        return self.min_dp, self.max_dp or topology_dp


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0
    """Evaluate the loss on held-out data every N optimizer steps and after the last; 0: never."""
    batches: int = 4
    """Held-out batches per evaluation, of train.global_batch_size sequences each: the same ones
    every time (val_loss is comparable across steps, runs and topologies)."""

    def due(self, step: int, steps: int) -> bool:
        """Whether the held-out loss is evaluated after `step` of a run of `steps` steps."""
        return every_n(self.every, step, steps)


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases (pip install 'rayhybrid[wandb]'); the driver logs, the workers never do."""

    enabled: bool = False
    project: str = "rayhybrid"
    entity: str = ""
    """Team or user; empty: the API key's default entity."""
    mode: str = "online"
    """online, or offline (written under <run dir>/wandb; upload later with `wandb sync`)."""
    name: str = ""
    """Run name; empty: the run directory's name."""
    group: str = ""
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class MLflowConfig:
    """MLflow (pip install 'rayhybrid[mlflow]'); the driver logs, the workers never do."""

    enabled: bool = False
    tracking_uri: str = ""
    """A tracking server (http://host:5000), databricks, or a local file:/path store; empty:
    MLFLOW_TRACKING_URI, else file:./mlruns."""
    experiment: str = "rayhybrid"
    run_name: str = ""
    """Run name; empty: the run directory's name."""


@dataclass(frozen=True)
class MetricsConfig:
    memory: bool = False
    """Measure peak memory per pipeline stage and phase (forward, backward, optimizer) every
    step: the CUDA allocator's peaks, or on CPU an exact count of tensor bytes (slower: every
    operator is seen by a dispatch mode). See rayhybrid/trainer/memory_meter.py."""
    trace_steps: tuple[int, ...] = ()
    """Optimizer steps (1-based) to record in trace.json: a Chrome trace, one track per rank with
    forward, backward, optimizer and communication spans."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s of one device, for MFU; 0: from a table of known GPUs (none on CPU)."""
    tensorboard: bool = False
    """Also log the step metrics for TensorBoard, into <run dir>/tensorboard."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)


@dataclass(frozen=True)
class TuneConfig:
    """`python -m rayhybrid.tune`: find the largest micro-batch that fits, then the fastest
    configuration under it; or, with `search=layout`, the fastest parallel layout for a device
    count (see rayhybrid/tune/)."""

    search: str = "micro_batch"
    """`micro_batch`: the batch shape for the topology given; `layout`: dp x pp x tp, the
    schedule, dp_shard, checkpointing and the micro-batch for `tune.devices` devices."""
    memory_budget_mb: float = 0.0
    """Memory each rank may use. 0: the GPU's capacity; required on CPU, where the run plays a
    device of this size (a trial over it counts as out of memory)."""
    margin: float = 0.01
    """Safety margin under the budget for the predicted micro-batch (0.01 = 1%)."""
    probes: tuple[int, ...] = ()
    """The two micro-batch sizes measured first; memory is fitted as fixed + per sample. Empty:
    the planner's predicted largest size and half of it (1 and 2 for a model it cannot plan)."""
    global_batch_size: int = 0
    """Fix the global batch (a hyper-parameter): only micro-batch sizes dividing it per replica
    are tried, each with the micro-batches that make it up. 0: free (each trial its own);
    `tune.global_batch_size=${train.global_batch_size}` keeps the training one. A layout search
    always fixes it (this, or train.global_batch_size)."""
    steps: int = 3
    """Optimizer steps per trial; memory is read after the first (once optimizer state exists),
    throughput over the steps after the first."""
    num_microbatches: int = 0
    """Micro-batches per step while searching memory with a free global batch; 0: pp (the
    fewest a pipeline fills with)."""
    activation_checkpointing: tuple[bool, ...] = (False, True)
    """Settings of train.activation_checkpointing to search and time."""
    max_micro_batch: int = 4096
    """The largest micro-batch size a search considers."""
    devices: int = 0
    """Layout search: the devices to lay out (ranks on CPU); 0: those of the topology given."""
    devices_per_node: int = 0
    """Layout search: devices per node, which tp must divide; 0: the largest node's GPUs (on
    CPU: all `tune.devices`, one node)."""
    max_trials: int = 10
    """Layout search: real trials at most."""
    step_timeout_s: float = 300.0
    """A trial step that makes no progress for this long fails the trial."""


@dataclass(frozen=True)
class Config:
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    seed: int = 0
    run_dir: str = ""
    """Where outputs go; set from Hydra's run dir (hydra.run.dir=...)."""


def with_dp(cfg: Config, dp: int) -> Config:
    """`cfg` with `topology.dp` set to `dp` (an elastic run's current size)."""
    return replace(cfg, topology=replace(cfg.topology, dp=dp))
