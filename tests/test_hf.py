"""Hugging Face checkpoints in and out (rayhybrid/models/hf.py, trainer/hf_load.py, export/).

A tiny random LlamaForCausalLM, built offline and saved with save_pretrained, is the reference:
- `model.init_from` loads it under any topology and the first step's loss is transformers' loss
  on the same global batch;
- a run trained from it, checkpointed and exported with `python -m rayhybrid.export` loads in
  transformers with the loss rayhybrid reports for the next step; from s3:// too;
- bad input is one line and exit code 2 (composition and export).

Its weights are drawn far from transformers' initialisation (norm scales, large embeddings), so
the loss is far from uniform and a weight loaded into the wrong place shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never download

import pytest
import torch

from rayhybrid.config.compose import compose
from rayhybrid.errors import ConfigError
from rayhybrid.models.llama3.settings import kv_heads
from rayhybrid.models.registry import settings_of
from rayhybrid.preflight import load_config, to_run_config
from rayhybrid.storage import checkpoints as checkpoint_store
from rayhybrid.storage import generation as generations
from rayhybrid.storage.generation import Generations
from rayhybrid.storage.store import Store
from tests.distributed import checkpoint_then_continue, resume_many, run_configs, run_ranks, train_many

REPO = Path(__file__).resolve().parents[1]
LOSS_RTOL = 1e-5
"""rayhybrid's loss vs transformers' in float32 (observed ~1e-7: reduction order)."""
GLOBAL_BATCH = 8
SEQ_LEN = 32
TRAIN_STEPS = 5
BUCKET = "rayhybrid-hf-tests"


def hf_model(tied: bool, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    """{"untied": dir, "tied": dir}: save_pretrained of two tiny Llamas."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, kind in enumerate(("untied", "tied")):
        path = root / kind
        hf_model(kind == "tied", seed=i).save_pretrained(path)
        out[kind] = str(path)
    return out


def config(directory: str, *extra: str):
    return load_config(
        [
            "model=llama3_debug",
            f"model.init_from={directory}",
            f"data.seq_len={SEQ_LEN}",
            f"train.global_batch_size={GLOBAL_BATCH}",
            "train.micro_batch_size=2",
            "checkpoint.async_save=false",
            *extra,
        ]
    )


def hf_loss(directory: str, cfg, start: int) -> float:
    """transformers' mean token cross-entropy over global samples [start, start + G) of the
    trainer's stream, inputs and targets as the stream gives them."""
    from transformers import AutoModelForCausalLM

    from rayhybrid.data.streams import build_stream

    inputs, targets = build_stream(cfg.data, cfg.model.vocab_size, cfg.seed).batch(start, cfg.train.global_batch_size)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(inputs).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()))


def assert_close(ours: float, theirs: float, what: str, reference: str = "transformers") -> None:
    print(f"{what}: rayhybrid {ours:.7f} {reference} {theirs:.7f} rel {abs(ours - theirs) / abs(theirs):.1e}")
    assert abs(ours - theirs) <= LOSS_RTOL * abs(theirs), f"{what}: rayhybrid {ours!r} vs {reference} {theirs!r}"


# -- composition: config.json sets the shape ---------------------------------------------------


def test_config_json_sets_the_shape(hf_dirs):
    cfg = load_config(["model=llama3.2_1b", f"model.init_from={hf_dirs['untied']}"])  # the preset's shape goes
    m, own = cfg.model, settings_of(cfg.model)
    assert (m.name, m.n_layers, m.d_model, m.n_heads, kv_heads(m), m.hidden_dim, m.vocab_size) == (
        "llama3",
        4,
        64,
        4,
        2,
        176,
        256,
    )
    assert (own.rope_theta, own.rope_scaling, m.max_positions, own.tie_embeddings) == (500000.0, {}, 128, False)
    assert m.init_from == os.path.abspath(hf_dirs["untied"])
    assert settings_of(load_config(["model=llama3_debug", f"model.init_from={hf_dirs['tied']}"]).model).tie_embeddings
    # Overrides that agree with config.json are fine (head_dim 16 is d_model / n_heads).
    agreeing = ["model=llama3_debug", f"model.init_from={hf_dirs['untied']}", "model.n_layers=4", "model.head_dim=16"]
    assert load_config(agreeing).model.n_layers == 4
    # A tied checkpoint may be trained untied (not the other way round: see test_init_from_errors).
    untied = ["model=llama3_debug", f"model.init_from={hf_dirs['tied']}", "model.options.tie_embeddings=false"]
    assert not settings_of(load_config(untied).model).tie_embeddings
    # The path of `rayhybrid.train` and `python -m rayhybrid.tune`: a node with its Hydra overrides.
    node = compose(["model=llama3_debug", f"model.init_from={hf_dirs['untied']}"], return_hydra_config=True)
    assert to_run_config(node).model.max_positions == 128
    bad = compose(
        ["model=llama3_debug", f"model.init_from={hf_dirs['untied']}", "model.d_model=32"], return_hydra_config=True
    )
    with pytest.raises(ConfigError, match="model.d_model: 32 contradicts config.json's hidden_size=64"):
        to_run_config(bad)


def write_config_json(path: Path, config: dict, weights: bool = True) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    return str(path)


def llama_config_json(**changes) -> dict:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
    }
    return {**base, **changes}


@pytest.mark.parametrize(
    "case, overrides, words",
    [
        ("no_config", [], ["model.init_from", "no config.json"]),
        ("no_weights", [], ["model.init_from", "no model.safetensors"]),
        ("missing_shard", [], ["model.init_from", "lacks 1 of the 2 shards"]),
        ("gpt2", [], ["model.init_from", "GPT2LMHeadModel", "LlamaForCausalLM"]),
        ("yarn", [], ["model.init_from", "rope type 'yarn'"]),
        ("llama", ["model.n_layers=3"], ["model.n_layers", "num_hidden_layers=4", "remove the override"]),
        ("llama", ["model.options.tie_embeddings=true"], ["model.options.tie_embeddings", "tie_word_embeddings=false"]),
        ("llama", ["++model.options.rope_scaling.factor=8"], ["model.options.rope_scaling", "contradicts"]),
        ("llama", ["model.options.n_kv_heads=1"], ["model.options.n_kv_heads", "num_key_value_heads=2"]),
        ("missing_dir", [], ["model.init_from", "is not a directory"]),
        ("s3", [], ["model.init_from", "not a local directory"]),
    ],
)
def test_init_from_errors(tmp_path, case, overrides, words):
    path = tmp_path / case
    if case == "no_config":
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"")
    elif case == "no_weights":
        write_config_json(path, llama_config_json(), weights=False)
    elif case == "missing_shard":
        write_config_json(path, llama_config_json(), weights=False)
        index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
        (path / "model-00001-of-00002.safetensors").write_bytes(b"")
    elif case == "gpt2":
        write_config_json(path, {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 4})
    elif case == "yarn":
        write_config_json(
            path, llama_config_json(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
        )
    elif case == "llama":
        write_config_json(path, llama_config_json())
    init_from = "s3://bucket/llama" if case == "s3" else str(path)
    with pytest.raises(ConfigError) as err:
        load_config(["model=llama3_debug", f"model.init_from={init_from}", *overrides])
    text = str(err.value)
    assert "\n" not in text
    for word in words:
        assert word in text, text


def test_init_from_a_model_without_adapter(tmp_path):
    path = write_config_json(tmp_path / "llama", llama_config_json())
    with pytest.raises(ConfigError) as err:
        load_config([f"model.init_from={path}"])  # the default model: gpt
    assert err.value.setting == "model.init_from"
    for word in ("model.name=gpt has no Hugging Face adapter", "LlamaForCausalLM", "add model.name=llama3"):
        assert word in str(err.value), err.value
    # ... which works: config.json sets every shape field the preset (gpt_tiny) gave.
    assert settings_of(load_config([f"model.init_from={path}", "model.name=llama3"]).model).n_kv_heads == 2


def run_module(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])))
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def assert_one_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.slow
def test_cli_contradicting_override_is_one_line(hf_dirs):
    proc = run_module("rayhybrid", "model=llama3_debug", f"model.init_from={hf_dirs['untied']}", "model.n_layers=3")
    assert_one_line(proc, "model.n_layers: 3 contradicts config.json's num_hidden_layers=4", "remove the override")


# -- loading: parity with transformers under any topology --------------------------------------


@pytest.fixture(scope="module")
def trained(hf_dirs, tmp_path_factory) -> dict:
    """dp2 x pp2 x tp2 from the untied model: 5 steps, a checkpoint, one more step."""
    root = tmp_path_factory.mktemp("ckpts") / "run"
    cfg = config(hf_dirs["untied"], "+topology=dp2_pp2_tp2")
    ranks = run_ranks(checkpoint_then_continue, 8, cfg, str(root), TRAIN_STEPS, 1)
    return {"cfg": cfg, **ranks[0]}


@pytest.mark.slow
def test_first_loss_matches_transformers(hf_dirs, trained):
    labels = {
        1: {"dp1": ("untied", ()), "dp1_tied": ("tied", ())},
        2: {
            "tp2": ("untied", ("+topology=tp2",)),
            "pp2": ("untied", ("+topology=pp2",)),
            "dp2_fsdp": ("untied", ("+topology=dp2", "topology.dp_shard=true")),
            "tp2_tied": ("tied", ("+topology=tp2", "topology.loss_parallel=true")),
            "dp2_tied": ("tied", ("+topology=dp2",)),
            "dp2_fsdp_tied": ("tied", ("+topology=dp2", "topology.dp_shard=true")),
            # Tied across stages: the last stage's copy of the embedding is read from it.
            "pp2_tied": ("tied", ("+topology=pp2",)),
            # A tied checkpoint trained untied (pipelines need it): the output starts as a copy.
            "pp2_untied_from_tied": ("tied", ("+topology=pp2", "model.options.tie_embeddings=false")),
        },
    }
    first: dict[str, tuple[str, float]] = {"dp2_pp2_tp2": ("untied", trained["before"][0])}
    cfgs = {}
    for world, runs in labels.items():
        cfgs[world] = {label: config(hf_dirs[kind], *extra) for label, (kind, extra) in runs.items()}
        ranks = run_configs(train_many, cfgs[world], 1)[0]  # every rank reports the global loss
        first.update({label: (runs[label][0], ranks[label][0]["loss"]) for label in runs})
    reference = {kind: hf_loss(hf_dirs[kind], trained["cfg"], 0) for kind in ("untied", "tied")}
    assert reference["untied"] > 7.0  # far from uniform (5.55): the weights matter
    for label, (kind, loss) in first.items():
        assert_close(loss, reference[kind], label)


@pytest.mark.slow
def test_resume_restores_the_checkpoint_not_init_from(hf_dirs, trained):
    """A run that resumes keeps its checkpoint's weights: init_from is read first, then the
    checkpoint over it (under another topology here)."""
    root = os.path.dirname(trained["path"])
    (ranks,) = run_configs(resume_many, {"tp2": config(hf_dirs["untied"], "+topology=tp2")}, root, 1)[:1]
    assert ranks["tp2"]["start"] == TRAIN_STEPS
    assert_close(ranks["tp2"]["losses"][0], trained["after"][0], "step 6 resumed under tp2", "dp2_pp2_tp2")


# -- export ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("export") / "hf"
    proc = run_module("rayhybrid.export", "--checkpoint", trained["path"], "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"exported step {TRAIN_STEPS}" in proc.stdout and "model.safetensors" in proc.stdout, proc.stdout
    return str(out)


@pytest.mark.slow
def test_export_loads_in_transformers_with_the_next_loss(trained, exported):
    assert sorted(os.listdir(exported)) == ["config.json", "generation_config.json", "model.safetensors"]
    # transformers' loss on step 6's batch = what rayhybrid reported for step 6 (weights after step 5).
    theirs = hf_loss(exported, trained["cfg"], TRAIN_STEPS * GLOBAL_BATCH)
    assert_close(trained["after"][0], theirs, "step 6 after export")
    assert trained["after"][0] < trained["before"][0]  # it trained
    # The exported directory is an init_from of the same shape.
    back = load_config(["model=llama3_debug", f"model.init_from={exported}"]).model
    assert {**vars(back), "init_from": ""} == {**vars(trained["cfg"].model), "init_from": ""}


@pytest.mark.slow
def test_export_from_s3(trained, exported, tmp_path, capsys):
    from safetensors.torch import load_file

    from rayhybrid.export import main
    from tests.s3 import s3_session

    with s3_session(BUCKET):
        store = Store.open(f"s3://{BUCKET}/run")
        step = os.path.basename(trained["path"])
        store.fs.put(trained["path"], f"{store.root}/{step}", recursive=True)
        # The checkpoint.dir (its latest committed checkpoint) as well as the step directory.
        for i, url in enumerate((f"s3://{BUCKET}/run/{step}", f"s3://{BUCKET}/run")):
            main(["--checkpoint", url, "--out", str(tmp_path / str(i))])
            assert f"exported step {TRAIN_STEPS} of s3://{BUCKET}/run/{step}" in capsys.readouterr().out
            mine, local = (
                load_file(tmp_path / str(i) / "model.safetensors"),
                load_file(Path(exported) / "model.safetensors"),
            )
            assert mine.keys() == local.keys() and all(torch.equal(mine[k], local[k]) for k in mine)


@pytest.mark.slow
def test_export_sharded_and_bfloat16(trained, tmp_path, capsys):
    from safetensors.torch import load_file

    from rayhybrid.export import main

    main(["--checkpoint", trained["path"], "--out", str(tmp_path), "--dtype", "bfloat16", "--max-shard-gb", "0.0001"])
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(name.endswith(f"-of-{len(shards):05d}.safetensors") for name in shards)
    tensors = {}
    for name in shards:
        tensors.update(load_file(tmp_path / name))
    assert tensors.keys() == index["weight_map"].keys() and "lm_head.weight" in tensors
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def fake_checkpoint(root: Path, model: dict | None, commit: bool = True) -> str:
    store = Store.open(root)
    path = checkpoint_store.begin(store, 3)
    store.write_bytes(f"{path}/.metadata", b"meta")
    if commit:
        meta = {"step": 3, "seq_len": 32, **({"model": model} if model is not None else {})}
        checkpoint_store.commit(store, path, meta)
    return path


@pytest.mark.parametrize(
    "case, words",
    [
        ("uncommitted", ["--checkpoint", "not a usable checkpoint", "not committed"]),
        ("fenced", ["--checkpoint", "not a usable checkpoint", "fenced off", "generation 0", "generation 1"]),
        ("empty_root", ["--checkpoint", "holds no committed checkpoint"]),
        ("missing", ["--checkpoint", "does not exist"]),
        ("gpt", ["--checkpoint", "model.name=gpt has no Hugging Face adapter"]),
        ("old", ["--checkpoint", "records no model"]),
        ("out_not_empty", ["--out", "not an empty directory"]),
        ("no_args", ["arguments", "--checkpoint"]),
    ],
)
def test_export_errors(tmp_path, capsys, case, words):
    from rayhybrid.export import main

    out = tmp_path / "out"
    if case == "uncommitted":
        checkpoint = fake_checkpoint(tmp_path / "ckpts", None, commit=False)
    elif case == "empty_root":
        checkpoint = str(tmp_path)
    elif case == "missing":
        checkpoint = str(tmp_path / "nowhere" / "step_00000001")
    elif case in ("gpt", "out_not_empty"):
        checkpoint = fake_checkpoint(tmp_path / "ckpts", {"name": "gpt", "n_layers": 4})
    elif case == "old":
        checkpoint = fake_checkpoint(tmp_path / "ckpts", None)
    elif case == "fenced":  # generation 0 committed step 3 after the run moved to generation 1
        checkpoint = fake_checkpoint(tmp_path / "ckpts", {"name": "llama3", "n_layers": 4})
        generations.publish(Store.open(tmp_path / "ckpts"), Generations(1, {0: None}))
        assert checkpoint_store.latest(tmp_path / "ckpts") is None  # what a reader of the run takes
    if case == "out_not_empty":
        out.mkdir()
        (out / "config.json").write_text("{}")
    args = [] if case == "no_args" else ["--checkpoint", checkpoint, "--out", str(out)]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    for word in words:
        assert word in lines[0], lines[0]
    assert not out.exists() or case == "out_not_empty"


def test_export_help():
    """--help prints the command line's usage (rayhybrid/export/cli.py's docstring), whose
    options are the parser's."""
    from rayhybrid.export.cli import __doc__ as doc

    proc = run_module("rayhybrid.export", "--help")
    assert proc.returncode == 0 and proc.stdout.strip() == doc.strip()
    for option in ("--checkpoint", "--out", "--storage-option", "--dtype", "--max-shard-gb"):
        assert option in doc


@pytest.mark.slow
def test_each_rank_reads_only_its_own_slices(hf_dirs):
    """Under pp2 x tp2, a rank reads the tensors of its own pipeline stage only, and of each
    tensor that tp splits, its 1/tp share: never the whole checkpoint."""
    from tests.distributed import hf_reads

    cfg = config(hf_dirs["untied"], "topology.pp=2", "topology.tp=2")
    reads = run_ranks(hf_reads, 4, cfg)
    from safetensors import safe_open

    with safe_open(str(Path(hf_dirs["untied"]) / "model.safetensors"), "pt") as f:
        sizes = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    numel = {name: int(torch.tensor(shape).prod()) for name, shape in sizes.items()}
    for rank, got in enumerate(reads):
        pp = rank // 2  # rank = pp_i * tp + tp_i
        layers = {0: ("0", "1"), 1: ("2", "3")}[pp]
        for name, n in got.items():
            if name.startswith("model.layers."):
                assert name.split(".")[2] in layers, f"rank {rank} (stage {pp}) read {name}"
            else:
                assert name == ("model.embed_tokens.weight" if pp == 0 else "model.norm.weight") or (
                    pp == 1 and name == "lm_head.weight"
                ), f"rank {rank} read {name}"
            split = "norm" not in name  # norms are replicated over tp; every matrix is split
            assert n == (numel[name] // 2 if split else numel[name]), f"rank {rank}: {name} {n} of {numel[name]}"
        assert sum(got.values()) < sum(numel.values()) / 3
    # Together the ranks read every tensor of the checkpoint.
    assert set().union(*reads) == set(numel)
