"""The plan as one JSON-able dict (`build_plan`) and as text (`format_text`)."""

from __future__ import annotations

import os

from rayhybrid.config.schema import Config
from rayhybrid.config.topology import Layout, Topology, describe_data_parallel
from rayhybrid.errors import ConfigError
from rayhybrid.models.registry import BUILTIN, settings_of
from rayhybrid.plan import estimate as est
from rayhybrid.plan.peak_memory import rank_memory

MB = est.MB


DEVICES = ("cpu", "cuda")


def plan_device(cfg: Config, placement: dict | None = None, device: str | None = None) -> str:
    """The device the memory plan is for: `device` when given ("cpu" or "cuda"), else GPUs when
    the cluster placed the ranks on them, or cluster.use_gpu=true; else CPU."""
    if device is not None:
        if device not in DEVICES:
            raise ConfigError("--device", f"is cpu or cuda, got {device!r}")
        return device
    if placement:
        return "cuda" if placement["device"] == "GPU" else "cpu"
    return "cuda" if str(cfg.cluster.use_gpu).lower() == "true" else "cpu"


def build_plan(cfg: Config, placement: dict | None = None, device: str | None = None) -> dict:
    """The plan of `cfg` as one JSON-able dict (`python -m rayhybrid.plan --json`); `placement`:
    where a cluster put the ranks (rayhybrid/plan/trial_placement.py), or None; `device`: the
    memory plan's device ("cpu", "cuda"; None: `plan_device`'s default)."""
    t, model = cfg.topology, cfg.model
    topo = Topology(t.dp, t.pp, t.tp)
    all_stages = est.stages(cfg)
    owned = {r: est.owned_stages(cfg, r) for r in range(t.pp)}
    ranks = _rank_rows(topo, all_stages, owned, placement)
    # A model whose spec has no memory model (ModelSpec.memory None, e.g. one loaded with
    # model.module) lists no parameter tensors: no per-stage counts, memory or communication.
    modelled = est.has_memory_model(cfg)
    parameters = _parameters(cfg, all_stages, owned, modelled)
    # What autograd saves (fused kernels), AdamW's temporaries (for-loop against foreach), the
    # allocator's reserve: CUDA's differ from CPU's.
    cuda = plan_device(cfg, placement, device) == "cuda"
    memory = _memory(cfg, topo, cuda) if modelled else None
    comm = {r: est.communication(cfg, r) for r in range(t.pp)} if modelled else {}
    bubble = _bubble(cfg)
    return {
        "config": _config_section(cfg, topo.world_size, len(all_stages)),
        "ranks": ranks,
        "placement": ({"device": placement["device"]} if placement else None),
        "not_modelled": None
        if modelled
        else (
            f"memory, communication and per-stage parameters (model {model.module or model.name} "
            "has no memory model: its ModelSpec.memory is None)"
        ),
        "parameters": parameters,
        "memory": memory,
        "communication": {"per_pp_rank": [{"pp_rank": r, **comm[r]} for r in range(t.pp)]} if modelled else None,
        "bubble": bubble,
        "flops": _flops(cfg, topo.world_size),
        "megatron": _megatron(cfg) if modelled else None,
    }


def _parameters(cfg: Config, all_stages: list[est.Stage], owned: dict[int, list[int]], modelled: bool) -> dict:
    """The plan's "parameters": the model's, each stage's, each pipeline rank's."""
    total = est.num_params(cfg.model, cfg.data.seq_len)
    stage_rows = _stage_rows(cfg, all_stages, modelled)
    return {
        "total": total,
        "stages": stage_rows,
        "per_pp_rank": [
            {
                "pp_rank": r,
                "stages": owned[r],
                "params_per_rank": sum(stage_rows[i]["params_per_rank"] for i in owned[r]) if modelled else None,
            }
            for r in range(cfg.topology.pp)
        ],
    }


def _memory(cfg: Config, topo: Topology, cuda: bool) -> dict:
    """The plan's "memory": each pipeline rank's peak (`rank_memory`), each rank's total."""
    memory = {r: rank_memory(cfg, r, cuda=cuda) for r in range(topo.pp)}
    return {
        "device": "cuda" if cuda else "cpu",
        "per_pp_rank": [memory[r].as_dict() for r in range(topo.pp)],
        "per_rank_total_mb": [memory[topo.coord(r).pp].total / MB for r in range(topo.world_size)],
        "max_mb": max(mem.total for mem in memory.values()) / MB,
        # CUDA: what the caching allocator reserves at the peak, what must fit the card.
        "max_reserved_mb": max(mem.reserved for mem in memory.values()) / MB if cuda else None,
        "host_activations_mb": [memory[r].host_activations / MB for r in range(topo.pp)],
    }


def host_memory_mb(cfg: Config, cuda: bool) -> float:
    """train.offload_activations: the most host memory one rank's offloaded activations take
    (MB, the busiest pipeline rank's); 0 without offload or without the model's memory model."""
    if not cfg.train.offload_activations or not est.has_memory_model(cfg):
        return 0.0
    return max(rank_memory(cfg, r, cuda=cuda).host_activations for r in range(cfg.topology.pp)) / MB


def host_ram_mb() -> float:
    """This machine's physical memory (MB)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / MB


def check_host_memory(cfg: Config, host_mb: float, ranks_per_node: int, cuda: bool) -> None:
    """One ConfigError line when the offloaded activations of `ranks_per_node` ranks (each the
    busiest rank's) are planned over a node's `host_mb` of host memory."""
    per_rank = host_memory_mb(cfg, cuda)
    if per_rank * ranks_per_node <= host_mb:
        return
    raise ConfigError(
        "train.offload_activations",
        f"the offloaded activations are planned at {per_rank:,.0f} MB of host memory per rank x {ranks_per_node} "
        f"rank(s) per node at train.micro_batch_size={cfg.train.micro_batch_size}, over the node's "
        f"{host_mb:,.0f} MB; lower train.micro_batch_size, set train.activation_checkpointing=true "
        "(it offloads only each block's input) or train.offload_activations=false",
    )


def check_run_host_memory(cfg: Config) -> None:
    """train.offload_activations: a run whose offloaded activations are planned over this host's
    memory stops before Ray starts (one ConfigError line). A local Ray (no cluster.address nor
    RAY_ADDRESS) puts every rank on this machine; a cluster it joins has at least one per node."""
    local = not (cfg.cluster.address or os.environ.get("RAY_ADDRESS"))
    ranks = cfg.topology.dp * cfg.topology.pp * cfg.topology.tp if local else 1
    check_host_memory(cfg, host_ram_mb(), ranks, cuda=plan_device(cfg) == "cuda")


def _bubble(cfg: Config) -> dict:
    t = cfg.topology
    m, v = est._microbatches(cfg), Layout.of(cfg).virtual_stages
    fraction, formula = est.bubble_fraction(t.schedule, t.pp, m, v)
    return {
        "fraction": fraction,
        "formula": formula,
        "schedule": t.schedule if t.pp > 1 else None,
        "pp": t.pp,
        "num_microbatches": m,
        "stages_per_rank": v,
    }


def _flops(cfg: Config, world_size: int) -> dict:
    model, s = cfg.model, cfg.data.seq_len
    per_token = est.model_flops_per_token(model, s)
    per_step = per_token * cfg.train.global_batch_size * s
    return {
        "per_token": per_token,
        "per_token_no_attention": est.model_flops_per_token(model, s, attention=False),
        "per_step": per_step,
        "per_rank_per_step": per_step / world_size,
    }


def _config_section(cfg: Config, world_size: int, num_stages: int) -> dict:
    """The plan's "config": the settings it was made for."""
    t, tr, model = cfg.topology, cfg.train, cfg.model
    own = settings_of(model)  # the family's own settings (llama3's key/value heads, tied output)
    return {
        "dp": t.dp,
        "pp": t.pp,
        "tp": t.tp,
        "world_size": world_size,
        "schedule": t.schedule if t.pp > 1 else None,
        "stages_per_rank": Layout.of(cfg).virtual_stages,
        "num_stages": num_stages,
        "dp_shard": t.dp_shard,
        "shard_group": t.shard_group,
        "loss_parallel": t.tp > 1 and t.use_loss_parallel(model.vocab_size),
        "model": model.module or model.name,
        "flavor": model.flavor,
        "n_layers": model.n_layers,
        "d_model": model.d_model,
        "n_heads": model.n_heads,
        "n_kv_heads": getattr(own, "n_kv_heads", 0) or model.n_heads,
        "head_dim": model.head_width,
        "attn_dim": model.attn_dim,
        "ffn_dim": model.hidden_dim,
        "tie_embeddings": getattr(own, "tie_embeddings", False),
        "vocab_size": model.vocab_size,
        "seq_len": cfg.data.seq_len,
        "global_batch_size": tr.global_batch_size,
        "micro_batch_size": tr.micro_batch_size,
        "num_microbatches": est._microbatches(cfg),
        "dtype": tr.dtype,
        "activation_checkpointing": tr.activation_checkpointing,
        "offload_activations": tr.offload_activations,
    }


def _rank_rows(
    topo: Topology, all_stages: list[est.Stage], owned: dict[int, list[int]], placement: dict | None
) -> list[dict]:
    """The plan's "ranks": each rank's coordinates, stages and (placed) node and bundle."""
    placed = {p["rank"]: p for p in placement["ranks"]} if placement else {}
    ranks = []
    for rank in range(topo.world_size):
        c = topo.coord(rank)
        row = {
            "rank": rank,
            "dp": c.dp,
            "pp": c.pp,
            "tp": c.tp,
            "replica": c.dp,
            "stages": [
                {
                    "stage": i,
                    "layers": [all_stages[i].layers.start, all_stages[i].layers.stop - 1],
                    "first": all_stages[i].first,
                    "last": all_stages[i].last,
                }
                for i in owned[c.pp]
            ],
        }
        if placement:
            row.update(node=placed[rank]["node"], node_id=placed[rank]["node_id"], bundle=placed[rank]["bundle"])
        ranks.append(row)
    return ranks


def _stage_rows(cfg: Config, all_stages: list[est.Stage], modelled: bool) -> list[dict]:
    """The plan's parameters per stage (None where the model has no memory model)."""
    t = cfg.topology
    shard = t.shard_group
    return [
        {
            "stage": st.index,
            "layers": [st.layers.start, st.layers.stop - 1],
            "describe": st.describe(),
            "params": st.params if modelled else None,
            "params_per_tp_rank": sum(p.local_numel(t.tp) for p in st.tensors) if modelled else None,
            "params_per_rank": sum(p.local_numel(t.tp, shard) for p in st.tensors) if modelled else None,
        }
        for st in all_stages
    ]


def _megatron(cfg: Config) -> dict | None:
    """The GPT-3 models' activations per layer against Megatron-LM's formula (None for others)."""
    t, model, s = cfg.topology, cfg.model, cfg.data.seq_len
    if model.module or model.name != "gpt" or not model.flavor.startswith("gpt3"):
        return None
    b = cfg.train.micro_batch_size
    megatron = {
        "source": "Korthikanti et al. 2022: s*b*h*(34 + 5*a*s/h) bytes per layer (16-bit, no recompute); "
        "tp without sequence parallelism: s*b*h*(10 + 24/t + 5*a*s/(h*t))",
        "micro_batch_size": b,
        "seq_len": s,
        "tp": t.tp,
        "per_layer_bytes": est.megatron_activation_bytes(model, s, b),
        "per_layer_tp_bytes": est.megatron_activation_bytes(model, s, b, t.tp),
        "this_trainer_per_layer_bytes": {
            dtype: b * est.block_bytes(cfg, tp=t.tp, dtype=dtype) for dtype in ("float32", "bfloat16")
        },
    }
    megatron["difference"] = (
        "the formula's 5*a*s/h term is the attention's score and dropout matrices; "
        "fused attention (scaled_dot_product_attention) keeps only a log-sum-exp per head "
        "and token, and this model has no dropout"
    )
    if model.attn_dim != model.d_model:
        megatron["note"] = (
            f"the formula assumes attention width = d_model; this model's is {model.attn_dim} "
            f"(heads x head_dim) on d_model {model.d_model}"
        )
    return megatron


def _mb(x: float) -> str:
    return f"{x:,.2f}"


def _bytes(x: float) -> str:
    for unit, size in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if x >= size:
            return f"{x / size:,.2f} {unit}"
    return f"{x:,.0f} B"


def _count(x: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= size:
            return f"{x / size:,.2f}{unit}"
    return f"{x:,.0f}"


def _table(header: list[str], rows: list[list], left: tuple[int, ...] = ()) -> list[str]:
    """Columns right-aligned (numbers) but those in `left`."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" if i in left else f"{{:>{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*header).rstrip(), *(fmt.format(*map(str, r)).rstrip() for r in rows)]


def _stage_label(st: dict) -> str:
    lo, hi = st["layers"]
    text = f"s{st['stage']} L{lo}" + (f"-{hi}" if hi != lo else "")
    return text + ("+emb" if st["first"] else "") + ("+head" if st["last"] else "")


def format_text(plan: dict) -> str:
    """The plan as `python -m rayhybrid.plan` prints it."""
    out = _title_lines(plan["config"])
    out += _rank_lines(plan)
    out += _parameter_lines(plan["parameters"])
    if plan["not_modelled"]:
        out += ["", f"Not modelled: {plan['not_modelled']}"]
    else:
        out += _memory_lines(plan["memory"])
        out += _communication_lines(plan["communication"])
    b = plan["bubble"]
    out += ["", f"Pipeline bubble: {b['fraction']:.1%}  [{b['formula']}; m={b['num_microbatches']}]"]
    f = plan["flops"]
    out += [
        "",
        (
            f"FLOPs: {f['per_token']:.4g} per token (6N + 12 L s a; 6N alone: {f['per_token_no_attention']:.4g}), "
            f"{f['per_step']:.4g} per step, {f['per_rank_per_step']:.4g} per rank and step"
        ),
    ]
    if plan["megatron"]:
        out += _megatron_lines(plan["megatron"])
    return "\n".join(out)


def _title_lines(c: dict) -> list[str]:
    """The layout and the model, in two lines."""
    sched = ""
    if c["pp"] > 1:
        sched = f", {c['schedule']}" + (f" ({c['stages_per_rank']} stages/rank)" if c["stages_per_rank"] > 1 else "")
    shape = f"{c['n_layers']} layers, d {c['d_model']}, {c['n_heads']} heads"
    if c["model"] in BUILTIN:  # a model.module's may ignore these settings
        if c["n_kv_heads"] != c["n_heads"]:
            shape += f" sharing {c['n_kv_heads']} key/value heads"
        shape += f", ffn {c['ffn_dim']}" + (", tied output" if c["tie_embeddings"] else "")
    flavor = f" {c['flavor']}" if c["flavor"] and c["flavor"] != c["model"] else ""
    return [
        (
            f"rayhybrid plan: dp={c['dp']} x pp={c['pp']} x tp={c['tp']} = {c['world_size']} ranks{sched}"
            f"{', ' + describe_data_parallel(c['dp'], c['shard_group']) if c['shard_group'] > 1 else ''}"
        ),
        f"model {c['model']}{flavor} ({shape}, vocab {c['vocab_size']}), "
        f"seq {c['seq_len']}, global batch {c['global_batch_size']} = dp {c['dp']} x {c['num_microbatches']} "
        f"micro-batches x {c['micro_batch_size']}, {c['dtype']}"
        + (", activation checkpointing" if c["activation_checkpointing"] else "")
        + (", activation offload" if c.get("offload_activations") else "")
        + (", loss parallel" if c["loss_parallel"] else ""),
    ]


def _rank_lines(plan: dict) -> list[str]:
    out = ["", "Ranks (rank = (dp_i * pp + pp_i) * tp + tp_i):"]
    placed = plan["placement"] is not None
    header = ["rank", "dp", "pp", "tp", "replica", "stages (layers)"] + (["node (id)", "bundle"] if placed else [])
    rows = []
    for r in plan["ranks"]:
        row = [r["rank"], r["dp"], r["pp"], r["tp"], r["replica"], " ".join(_stage_label(s) for s in r["stages"])]
        if placed:
            row += [f"{r['node']} ({r['node_id'][:8]})", r["bundle"]]
        rows.append(row)
    out += ["  " + line for line in _table(header, rows, left=(5, 6))]
    if placed:
        out.append(f"  placed on {plan['placement']['device']}s; the placement groups were released again")
    return out


def _parameter_lines(p: dict) -> list[str]:
    out = ["", f"Parameters: {p['total']:,} ({_count(p['total'])})"]
    header = ["stage", "layers", "params", "per tp rank", "per rank"]
    rows = [
        [
            s["stage"],
            s["describe"].split(": ", 1)[1],
            *("-" if s[k] is None else f"{s[k]:,}" for k in ("params", "params_per_tp_rank", "params_per_rank")),
        ]
        for s in p["stages"]
    ]
    return out + ["  " + line for line in _table(header, rows, left=(1,))]


def _megatron_lines(mg: dict) -> list[str]:
    ours = mg["this_trainer_per_layer_bytes"]
    line = f"  Megatron-LM formula (Korthikanti et al. 2022, 16-bit, no recompute): {_bytes(mg['per_layer_bytes'])}"
    if mg["tp"] > 1:
        line += f"; tp={mg['tp']} (no sequence parallelism): {_bytes(mg['per_layer_tp_bytes'])}"
    out = [
        "",
        f"Activation memory per layer, micro-batch {mg['micro_batch_size']}, seq {mg['seq_len']}:",
        line,
        (
            f"  this trainer's count (tp={mg['tp']}): {_bytes(ours['float32'])} float32, "
            f"{_bytes(ours['bfloat16'])} bfloat16 autocast"
        ),
        f"  difference: {mg['difference']}",
    ]
    if "note" in mg:
        out.append(f"  note: {mg['note']}")
    return out


def _memory_lines(memory: dict) -> list[str]:
    out = [
        "",
        (
            f"Memory per rank, MB at the predicted peak on {memory['device'].upper()} "
            "(same on every dp and tp rank of a pipeline rank):"
        ),
    ]
    header = ["pp rank", "params", "grads", "optimizer", "activations", "buffers", "transient", "other", "total"]
    rows = []
    for mem in memory["per_pp_rank"]:
        other = mem["batch_mb"] + mem["dp_buffers_mb"] + mem["autocast_weights_mb"] + mem["workspace_mb"]
        parts = ("params", "grads", "optimizer", "activations", "pipeline_buffers", "transient")
        rows.append(
            [mem["pp_rank"], *(_mb(mem[f"{k}_mb"]) for k in parts), _mb(other), _mb(mem["total_mb"]), mem["peak_at"]]
        )
    out += ["  " + line for line in _table([*header, "peak at"], rows, left=(9,))]
    notes = dict.fromkeys(n for mem in memory["per_pp_rank"] for n in mem["notes"])
    in_flight = [f"stage {k}: {v}" for mem in memory["per_pp_rank"] for k, v in mem["in_flight"].items()]
    out.append(f"  activations: saved for backward by the micro-batches in flight at the peak ({', '.join(in_flight)})")
    out.append(
        "  buffers: pipeline receive buffers, kept logits and sends; "
        "other: batch, data-parallel copies, autocast copies"
        + (", cuBLAS workspaces" if memory["device"] == "cuda" else "")
    )
    if memory["device"] == "cuda":
        reserved = ", ".join(_mb(mem["reserved_mb"]) for mem in memory["per_pp_rank"])
        out.append(
            f"  reserved (CUDA caching allocator: rounding + one largest block of fragmentation), MB by pp rank: "
            f"{reserved}; a card must hold this"
        )
    return out + _host_lines(memory) + [f"  note: {n}" for n in notes]


def _host_lines(memory: dict) -> list[str]:
    """train.offload_activations: the host memory the blocks' saved activations take per rank."""
    host = memory.get("host_activations_mb") or []
    if not any(host):
        return []
    each = ", ".join(f"pp rank {r}: {_mb(mb)}" for r, mb in enumerate(host))
    return [f"  host memory (offloaded activations, MB per rank at most): {each}"]


def _communication_lines(communication: dict) -> list[str]:
    out = ["", "Communication per optimizer step, per rank (payload / on the wire with ring algorithms):"]
    header = ["pp rank", "dp", "tp", "pp send", "pp recv", "total wire"]
    rows = []
    for cm in communication["per_pp_rank"]:
        rows.append(
            [
                cm["pp_rank"],
                f"{_bytes(cm['dp']['payload_bytes'])} / {_bytes(cm['dp']['wire_bytes'])}",
                f"{_bytes(cm['tp']['payload_bytes'])} / {_bytes(cm['tp']['wire_bytes'])}",
                _bytes(cm["pp"]["send_bytes"]),
                _bytes(cm["pp"]["recv_bytes"]),
                _bytes(cm["total_wire_bytes"]),
            ]
        )
    out += ["  " + line for line in _table(header, rows)]
    kinds = {
        f"{k}: {cm[k]['kind']}" for cm in communication["per_pp_rank"] for k in ("dp", "tp") if cm[k]["kind"] != "none"
    }
    return out + [f"  {k}" for k in sorted(kinds)]
