"""`prepare(cfg)`: list the inputs, load the tokenizer, check the output, then read, tokenize
and write the shards with Ray Data, and commit with index.json.

Everything that can be checked without Ray is checked first (the inputs exist and have the
field, the tokenizer loads and has an EOS id, the output is writable and holds no other
dataset), so most mistakes cost no cluster. Ray Data runs one pipeline, in the input's order
(`preserve_order`): read tasks -> an actor pool of tokenizers -> one shard per write task.
Errors raised inside Ray arrive wrapped in Ray's own; `refusal` takes the one line back out.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass

from rayhybrid.config.prepare import PrepareConfig
from rayhybrid.errors import ConfigError, RayHybridError
from rayhybrid.prepare.inputs import Inputs, check_field, find_bad_file, list_inputs, sees_file
from rayhybrid.prepare.output import (
    build_index,
    clear_stale,
    committed,
    make_recipe,
    open_output,
    write_index,
)
from rayhybrid.prepare.reading import TaskFailed
from rayhybrid.prepare.tokenize import TokenizerInfo, load_tokenizer
from rayhybrid.storage.store import Store, forwarded_env, one_line
from rayhybrid.storage.visibility import check_storage, first_refusal

log = logging.getLogger(__name__)

TASK_CPUS = 0.5  # each read and write task: two of them fit in the CPU the actors leave free
READ_TASKS = 200
READ_TASK_BYTES = 256 << 20


@dataclass(frozen=True)
class Prepared:
    """What a prepare did: the dataset's URL and size; `already`: it was there, committed."""

    url: str
    documents: int
    tokens: int
    shards: int
    seconds: float = 0.0
    already: bool = False


def prepare(cfg: PrepareConfig) -> Prepared:
    """Prepare `cfg.input` into `cfg.output` (see the module's docstring); raises ConfigError
    (a one-line refusal naming the setting) or RayHybridError (a failure)."""
    inputs = list_inputs(cfg.input, cfg.format, cfg.storage_options)
    if inputs.format.field:
        check_field(inputs, cfg.field)
    store = open_output(cfg.output, cfg.storage_options, inputs)
    tokenizer = load_tokenizer(cfg.tokenizer, cfg.bos)
    recipe = make_recipe(inputs, tokenizer, cfg)
    done = committed(store, recipe)
    if done is not None:
        log.info("already prepared: %s (%d documents, %d tokens)", store.display, done.documents, done.tokens)
        return Prepared(store.display, done.documents, done.tokens, len(done.shards), already=True)
    removed = clear_stale(store)
    if removed:
        log.info("removed %d files of a prepare that did not finish at %s", removed, store.display)
    log.info(
        "reading %d files (%s) from %s as %s",
        len(inputs.files),
        _size(inputs.num_bytes),
        inputs.display,
        f"{inputs.format.name}, field {cfg.field!r}" if inputs.format.field else inputs.format.name,
    )
    try:
        shards, seconds = tokenize_and_write(cfg, inputs, tokenizer, store)
        index = build_index(recipe, shards, tokenizer.dtype)
        if index["documents"] == 0:
            raise ConfigError("input", f"{inputs.display} holds no documents; nothing to prepare")
    except BaseException:
        with contextlib.suppress(Exception):
            clear_stale(store)  # a failed prepare leaves no shards behind (a killed one may: see clear_stale)
        raise
    tokens = index["tokens"]
    log.info(
        "tokenized and wrote %d documents, %d tokens in %d shards, %.0f tokens/s",
        index["documents"],
        tokens,
        len(shards),
        tokens / max(seconds, 1e-9),
    )
    log.info("committed %s", write_index(store, index))
    return Prepared(store.display, index["documents"], tokens, len(shards), seconds)


def _size(num_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    return ""


@contextlib.contextmanager
def ray_session(address: str):
    """Ray for the prepare: the one already initialised (a notebook, a test), else the cluster
    at `address` or RAY_ADDRESS, else a local Ray on this machine's CPUs. Yields which of them
    ("reused", "joined", "local"); a Ray this call joined or started is left at the end."""
    import ray

    if ray.is_initialized():
        yield "reused"
        return
    target = address or os.environ.get("RAY_ADDRESS", "")
    if target:
        from rayhybrid.cluster.connect import join

        join(target, "address" if address else "RAY_ADDRESS", 30.0)
    else:
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        ray.init(
            address="local",
            num_cpus=os.cpu_count(),
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    try:
        yield "joined" if target else "local"
    finally:
        ray.shutdown()


@contextlib.contextmanager
def data_context():
    """Ray Data keeps the input's order (else blocks come out as they finish); progress bars
    only on a terminal; Parquet is read by the first reader (Ray 2.60's DataSourceV2 spent
    10-15 s listing three local files per read, where the first reader took 1 s). The previous
    settings come back afterwards."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    saved = ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.use_datasource_v2
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = sys.stderr.isatty()
    ctx.use_datasource_v2 = False
    try:
        yield ctx
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.use_datasource_v2 = saved


def actor_plan(requested: int, cpus: float | None = None) -> tuple[int, float]:
    """(tokenizer actors, CPUs each) on a cluster of `cpus` CPUs (default: Ray's count). By
    default one actor per CPU, each single-threaded: separate processes tokenize in parallel
    better than one process's Rust threads (on 2 cores, two actors ran at 0.88x of the plain
    loop with 2 threads, one actor at 0.63x). Together they reserve all but one CPU, which the
    read and write tasks take (actors holding every CPU starve the reads and the job hangs
    without an error); the reads and writes are a small share of the work, so the actors still
    get the cores."""
    if cpus is None:
        import ray

        cpus = float(ray.cluster_resources().get("CPU", 1.0))
    cpus = max(1.0, cpus)
    workers = requested or int(cpus)
    spare = cpus - 1.0 if cpus >= 2 else cpus / 2
    return workers, max(0.001, math.floor(1000 * min(1.0, spare / workers)) / 1000)  # rounded down: the spare stays


def read_tasks(files) -> int:
    """Read tasks for these files: one per file up to READ_TASKS, then files grouped into
    tasks of about READ_TASK_BYTES (many small files: few tasks; large ones: one each)."""
    return max(1, min(len(files), max(READ_TASKS, math.ceil(sum(s.size for s in files) / READ_TASK_BYTES))))


def read_dataset(inputs: Inputs, field: str, runtime_env: dict | None):
    """The documents, in input order: batches of texts (text: a file's bytes), each row with
    its file's path; a task that fails names its file (rayhybrid.prepare.reading)."""
    import ray.data

    from rayhybrid.prepare.reading import read_files

    files = inputs.readable
    items = ray.data.from_items([{"path": s.path} for s in files], override_num_blocks=read_tasks(files))
    kwargs = {"fs": inputs.fs, "fmt": inputs.format, "field": field, "protocol": inputs.protocol}  # the Format itself
    remote = {"num_cpus": TASK_CPUS, "runtime_env": runtime_env}
    # Not fused into the tokenizers' operator (Ray Data fuses maps whose remote args agree): the
    # fused operator would bundle the file names up to a tokenizer batch, so one actor would
    # read and tokenize every file in one task, alone, into one shard. A `ray_remote_args_fn`
    # keeps the read tasks apart (one per file, each a block for any actor).
    return items.map_batches(read_files, batch_size=1, fn_kwargs=kwargs, ray_remote_args_fn=dict, **remote)


NODES_FIX = (
    "read and write tasks run on every node of the cluster: give {setting}= a mount every node shares, "
    "or a bucket URL (s3://bucket/prefix, gs://...)"
)


def check_nodes(store: Store, inputs: Inputs, env: dict) -> None:
    """On a cluster of several nodes, the tasks run on any node with CPUs, so a local output
    (or input) must be a path every node sees, as one mount: a ConfigError naming `output`
    (or `input`) when a node does not see it (rayhybrid.storage.visibility checks it as it
    checks checkpoint.dir). Nodes that join during the prepare are not checked."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
    nodes = [n for n in nodes if n != here]
    if not nodes:
        return
    if inputs.local:
        for source in {inputs.readable[0], inputs.readable[-1]}:
            found = first_refusal(nodes, env, sees_file, source.path, source.size)
            if found:
                node, reason = found
                raise ConfigError("input", f"{source.url}: {node} {reason}; {NODES_FIX.format(setting='input')}")
    if store.local:
        check_storage(store, nodes, env, setting="output", fix=NODES_FIX.format(setting="output"))


def tokenize_and_write(
    cfg: PrepareConfig, inputs: Inputs, tokenizer: TokenizerInfo, store: Store
) -> tuple[list[dict], float]:
    """Run the pipeline; returns the shards in stream order and the seconds it took."""
    with ray_session(cfg.address) as how, data_context():
        import ray.data

        from rayhybrid.prepare.shards import ShardSink
        from rayhybrid.prepare.tokenize import Tokenize

        # Read and write tasks reach the stores with the driver's settings (the workers of a
        # Ray this call started inherit them; the tokenizers need none).
        env = forwarded_env() if how != "local" else {}
        check_nodes(store, inputs, env)
        workers, cpus = actor_plan(cfg.workers)
        log.info("tokenizing with %d actor(s) of %s, %s CPU each", workers, tokenizer.name, cpus)
        task_env = {"env_vars": env} if env else None
        kwargs = {
            "tokenizer": tokenizer,
            "fmt": inputs.format,
            "field": cfg.field,
            "bos": cfg.bos,
            "protocol": inputs.protocol,
            "threads": max(1, round(cpus)),
        }
        sink = ShardSink(store.url, store.options, tokenizer.dtype)
        start = time.monotonic()
        try:
            ds = read_dataset(inputs, cfg.field, task_env).map_batches(
                Tokenize,
                fn_constructor_kwargs=kwargs,
                compute=ray.data.ActorPoolStrategy(size=workers),
                num_cpus=cpus,
                batch_size=inputs.format.batch_documents,
                batch_format="numpy",
            )
            ds.write_datasink(sink, ray_remote_args={"num_cpus": TASK_CPUS, "runtime_env": task_env})
        except Exception as err:  # noqa: BLE001 - Ray wraps whatever failed; `refusal` unwraps it
            raise refusal(err, inputs, cfg.field) from None
        return sink.shards, time.monotonic() - start


_CONFIG_ERROR = re.compile(r"rayhybrid\.errors\.ConfigError: ([^\s:]+): ([^\n]*)")
_TASK_FAILED = re.compile(r"rayhybrid\.prepare\.reading\.TaskFailed: ([^\n]*)")
_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Invalid)): (.+)$", re.MULTILINE)


def refusal(err: BaseException, inputs: Inputs, field: str) -> RayHybridError:
    """An error of the Ray pipeline as the one-line error to raise: the ConfigError a task
    raised (Ray keeps only its text), else the failure of a task, which names its file, else
    (Ray's own failure: a process or a node lost) the failure itself, after a search for a
    bad input file bounded in time and bytes (inputs.find_bad_file), whose extent it says."""
    seen, cause = set(), err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, TaskFailed):
            return RayHybridError(f"prepare failed: {cause}"[:400])
        if isinstance(cause, RayHybridError):
            return cause
        seen.add(id(cause))
        cause = getattr(cause, "cause", None) or cause.__cause__
    text = str(err)
    found = _CONFIG_ERROR.findall(text)
    if found:
        setting, message = found[-1]
        return ConfigError(setting, message.strip())
    failed = _TASK_FAILED.findall(text)
    if failed:
        return RayHybridError(f"prepare failed: {failed[-1].strip()}"[:400])
    search = find_bad_file(inputs, field)
    if search.problem is not None:
        return search.problem
    lines = [f"{name}: {message}" for name, message in _ERROR_LINE.findall(text) if "ray." not in name]
    what = (lines[-1] if lines else one_line(err))[:300]
    return RayHybridError(f"prepare failed: {what} (no input file was named; {search.note()})")
