"""`python -m rayhybrid.prepare` (rayhybrid/prepare/, rayhybrid/config/prepare.py): a corpus
tokenized once into the prepared format that `rayhybrid.data.open_prepared` reads.

- text files, JSON Lines and Parquet on a local S3 server (moto) prepared to S3, and a saved
  Hugging Face dataset: every document reads back as the tokenizer's ids plus EOS, in order;
- the token stream and the document lengths do not depend on `workers`; bos=true, val_fraction;
- the commit marker: a prepare killed with SIGKILL while writing leaves no index.json and the
  next run completes as a clean one; a committed output is "already prepared"; another input
  into it is refused;
- every refusal is one line on stderr with exit code 2, naming the setting.

One local Ray serves the module; the command line runs in subprocesses only where it is what is
tested (each starts Ray or imports transformers: seconds).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never download

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayhybrid.config.prepare import PrepareConfig, compose_prepare
from rayhybrid.data.prepared import INDEX, held_out_documents, open_prepared
from rayhybrid.errors import ConfigError
from tests.s3 import s3_session
from tests.tokenizer import corpus, make_tokenizer

REPO = Path(__file__).resolve().parents[1]
BUCKET = "rayhybrid-prepare-tests"
SPECIAL_DOCS = ["", "an <|eos|> inside the text, and a tab\tand\nnew lines ", "  leading spaces", "東京 🙂 ✓"]


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tiny-bpe")


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return corpus(90, seed=3) + SPECIAL_DOCS


@pytest.fixture(scope="module")
def s3():
    """moto's S3 endpoint with AWS_ENDPOINT_URL and test credentials set, and a bucket."""
    import s3fs

    with s3_session(BUCKET) as endpoint:
        yield s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray for the module (4 logical CPUs on this 2-core machine)."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


# -- helpers -----------------------------------------------------------------------------------


def expected(hf_tok, texts: list[str], bos: bool = False) -> list[list[int]]:
    ids = hf_tok(texts, add_special_tokens=False)["input_ids"]
    head = [hf_tok.bos_token_id] if bos else []
    return [head + x + [hf_tok.eos_token_id] for x in ids]


def chunks(items: list, n: int) -> list[list]:
    size = -(-len(items) // n)
    return [items[i : i + size] for i in range(0, len(items), size)]


def write_corpus(fmt: str, texts: list[str], put, num_files: int = 3, field: str = "text") -> None:
    """`texts` as files of `fmt`; put(name, bytes) stores one. Names sort in document order."""
    if fmt == "text":
        for i, text in enumerate(texts):
            put(f"doc-{i:04d}.txt", text.encode())
        return
    for n, part in enumerate(chunks(texts, num_files)):
        if fmt == "jsonl":
            lines = "".join(json.dumps({field: t, "n": i}) + "\n" for i, t in enumerate(part))
            put(f"part-{n:02d}.jsonl", lines.encode())
        else:
            buf = pa.BufferOutputStream()
            pq.write_table(pa.table({"id": list(range(len(part))), field: part}), buf)
            put(f"part-{n:02d}.parquet", buf.getvalue().to_pybytes())


def local_put(root: Path):
    root.mkdir(parents=True, exist_ok=True)
    return lambda name, data: (root / name).write_bytes(data)


def read_back(url: str) -> tuple[list[list[int]], object]:
    ds = open_prepared(url)
    return [ds.document(i).tolist() for i in range(ds.num_documents)], ds


def stream(url: str) -> tuple[np.ndarray, np.ndarray]:
    ds = open_prepared(url)
    return ds.read(0, ds.num_tokens), ds.lengths


def config(source, output, tokenizer, **settings) -> PrepareConfig:
    """A PrepareConfig with one tokenizer actor unless told (each actor is a process to start:
    seconds on this machine)."""
    settings.setdefault("workers", 1)
    return PrepareConfig(input=str(source), output=str(output), tokenizer=str(tokenizer), **settings)


def run_cli(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    cli_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cli_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), cli_env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "rayhybrid.prepare", *args]
    return subprocess.run(cmd, cwd=cwd, env=cli_env, capture_output=True, text=True, timeout=timeout, check=False)


def assert_refused(proc: subprocess.CompletedProcess, setting: str, *words: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"rayhybrid: error: {setting}: "), lines[0]
    for word in words:
        assert word in lines[0], lines[0]


# -- settings ----------------------------------------------------------------------------------


def test_settings_compose_like_the_trainers():
    cfg = compose_prepare(
        [
            "input=s3://b/raw/part-[0-9]*.jsonl",
            "output=s3://b/tok",
            "tokenizer=/models/tok",
            "workers=3",
            "bos=true",
            "val_fraction=0.05",
            "storage_options.endpoint_url=http://127.0.0.1:9000",
        ]
    )
    assert cfg == PrepareConfig(
        input="s3://b/raw/part-[0-9]*.jsonl",
        output="s3://b/tok",
        tokenizer="/models/tok",
        workers=3,
        bos=True,
        val_fraction=0.05,
        storage_options={"endpoint_url": "http://127.0.0.1:9000"},
    )
    base = ["input=a", "output=b", "tokenizer=c"]
    for overrides, setting in [
        (["input=a"], "output"),
        ([*base, "colour=red"], "colour"),
        ([*base, "workers=many"], "workers"),
        ([*base, "bos=perhaps"], "bos"),
        ([*base, "val_fraction=1.0"], "val_fraction"),
        ([*base, "workers=-1"], "workers"),
    ]:
        with pytest.raises(ConfigError) as err:
            compose_prepare(overrides)
        assert err.value.setting == setting, str(err.value)
    from rayhybrid.prepare.inputs import list_inputs

    # Which formats there are is the registry's (rayhybrid.prepare.formats): an unknown one is
    # refused when the inputs are listed, before any file is looked at.
    with pytest.raises(ConfigError) as err:
        list_inputs("a-path-that-is-never-listed", compose_prepare([*base, "format=csv"]).format)
    assert err.value.setting == "format" and "'csv' is not a format" in str(err.value), str(err.value)


def test_help_lists_every_setting(tmp_path):
    proc = run_cli(["--help"], tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for name in PrepareConfig.__dataclass_fields__:
        assert f"{name}=" in proc.stdout, name


# -- formats, order, tokenizer facts -----------------------------------------------------------


@pytest.mark.parametrize("cpus", [1, 2, 3, 16, 96])
def test_default_actors_use_every_core_and_leave_one_cpu_to_reads(cpus):
    """By default one single-threaded tokenizer actor per CPU (on 2 cores one actor left a core
    idle: 0.63x of the plain loop, two actors 0.88x); together they reserve all but one CPU
    (half of it on a 1-CPU machine), so the read and write tasks (0.5 CPU each) always fit."""
    from rayhybrid.prepare.run import TASK_CPUS, actor_plan

    workers, each = actor_plan(0, float(cpus))
    assert workers == cpus
    assert cpus - workers * each >= min(1.0, cpus / 2) - 1e-9
    assert cpus - workers * each >= TASK_CPUS
    assert each > 0
    assert actor_plan(3, float(cpus))[0] == 3  # an explicit count is kept


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["text", "jsonl", "parquet"])
def test_each_format_on_s3(fmt, s3, ray_local, tok_dir, hf_tok, docs):
    from rayhybrid.prepare import prepare

    raw, out = f"s3://{BUCKET}/{fmt}/raw", f"s3://{BUCKET}/{fmt}/tokens"
    texts = docs[:26] + SPECIAL_DOCS[1:] if fmt == "text" else docs  # an empty file holds no document
    write_corpus(fmt, texts, lambda name, data: s3.pipe_file(f"{raw}/{name}", data))
    done = prepare(config(raw, out, tok_dir, workers=2))

    got, ds = read_back(out)
    assert done.documents == ds.num_documents == len(texts)
    assert got == expected(hf_tok, texts)
    assert [hf_tok.decode(d[:-1]) for d in got] == texts
    index = ds.index.raw
    assert index["tokenizer"] == {
        "name": "tiny-bpe",
        "vocab_size": len(hf_tok),
        "eos_id": hf_tok.eos_token_id,
        "bos_id": hf_tok.bos_token_id,
        "sha256": index["tokenizer"]["sha256"],
    }
    assert index["dtype"] == "uint16" and index["bos"] is False and index["held_out"] is None
    assert index["input"] == {"format": fmt, "field": None if fmt == "text" else "text"}
    assert [s["path"] for s in index["sources"]] == sorted(f"s3://{p}" for p in s3.find(raw))
    assert [s["name"] for s in index["shards"]] == [f"shard-{i:05d}" for i in range(len(index["shards"]))]
    names = {f"{s['name']}{suffix}" for s in index["shards"] for suffix in (".bin", ".lengths.npy")}
    assert {p.rsplit("/", 1)[1] for p in s3.find(out)} == {INDEX, *names}


@pytest.mark.slow
def test_workers_do_not_change_the_stream(tmp_path, ray_local, tok_dir, hf_tok):
    from rayhybrid.prepare import prepare

    texts = corpus(240, seed=11)
    write_corpus("jsonl", texts, local_put(tmp_path / "raw"), num_files=6)
    streams = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        prepare(config(tmp_path / "raw", out, tok_dir, workers=workers))
        streams.append(stream(str(out)))
    (tokens1, lengths1), (tokens2, lengths2) = streams
    assert np.array_equal(tokens1, tokens2) and np.array_equal(lengths1, lengths2)
    assert lengths1.tolist() == [len(x) for x in expected(hf_tok, texts)]


def test_each_file_is_read_by_a_task_of_its_own_that_any_actor_tokenizes(tmp_path, ray_local, tok_dir):
    """Ray Data must not fuse the read tasks into the tokenizers' operator: there the file names
    would be bundled up to a tokenizer batch (256), one task would take every file, and one
    actor would tokenize the whole corpus while the others wait (seen: a 96 MB corpus in 1 shard
    at 0.63x of the plain loop). The reads stay an operator of their own, a task per file."""
    import ray.data

    from rayhybrid.prepare.inputs import list_inputs
    from rayhybrid.prepare.run import TASK_CPUS, data_context, read_dataset
    from rayhybrid.prepare.tokenize import Tokenize, load_tokenizer

    write_corpus("jsonl", corpus(900, seed=5), local_put(tmp_path / "raw"), num_files=3)
    inputs = list_inputs(str(tmp_path / "raw"), "jsonl")
    kwargs = {"tokenizer": load_tokenizer(str(tok_dir), False), "fmt": "jsonl", "field": "text", "bos": False}
    kwargs |= {"protocol": inputs.protocol, "threads": 1}
    actors = ray.data.ActorPoolStrategy(size=2)
    with data_context():
        ds = read_dataset(inputs, "text", None)
        # The actors take the read tasks' CPUs here, as `actor_plan` gives them on 2 CPUs.
        ds = ds.map_batches(
            Tokenize,
            fn_constructor_kwargs=kwargs,
            compute=actors,
            num_cpus=TASK_CPUS,
            batch_size=256,
            batch_format="numpy",
        )
        stats = ds.materialize().stats()
    assert "MapBatches(read_files): 3 tasks executed" in stats, stats


@pytest.mark.slow
def test_bos_and_held_out(tmp_path, ray_local, tok_dir, hf_tok, docs):
    from rayhybrid.prepare import prepare

    gz = tmp_path / "raw" / "docs.jsonl.gz"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress("".join(json.dumps({"body": t}) + "\n" for t in docs).encode()))
    out = tmp_path / "out"
    prepare(config(gz, out, tok_dir, field="body", bos=True, val_fraction=0.1))
    got, ds = read_back(str(out))
    assert got == expected(hf_tok, docs, bos=True)
    assert all(d[0] == hf_tok.bos_token_id and d[-1] == hf_tok.eos_token_id for d in got)
    k = len(held_out_documents(len(docs), 0.1))
    assert ds.index.raw["held_out"] == {"fraction": 0.1, "documents": k} and k == round(len(docs) * 0.1)
    assert ds.index.raw["bos"] is True and len(ds.held_out) == k


def save_hf_dataset(root: Path, texts: list[str], num_files: int = 2) -> None:
    """What `datasets.Dataset.save_to_disk` writes (datasets is no dependency): Arrow IPC stream
    files, state.json listing them in order, dataset_info.json."""
    root.mkdir(parents=True)
    features = {"text": {"dtype": "string", "_type": "Value"}, "id": {"dtype": "int64", "_type": "Value"}}
    names = []
    for n, part in enumerate(chunks(texts, num_files)):
        name = f"data-{n:05d}-of-{num_files:05d}.arrow"
        table = pa.table({"text": part, "id": list(range(len(part)))})
        table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
        with pa.OSFile(str(root / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=7):
                writer.write_batch(batch)
        names.append(name)
    state = {
        "_data_files": [{"filename": name} for name in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": "train",
    }
    (root / "state.json").write_text(json.dumps(state, indent=2))
    (root / "dataset_info.json").write_text(json.dumps({"description": "", "features": features}))


@pytest.mark.slow
def test_saved_hugging_face_dataset(tmp_path, ray_local, tok_dir, hf_tok, docs):
    from rayhybrid.prepare import prepare

    save_hf_dataset(tmp_path / "ds", docs)
    out = tmp_path / "out"
    prepare(config(tmp_path / "ds", out, tok_dir))
    got, ds = read_back(str(out))
    assert got == expected(hf_tok, docs)
    assert ds.index.raw["input"] == {"format": "hf", "field": "text"}
    assert [Path(s["path"]).name for s in ds.index.raw["sources"]] == [
        "data-00000-of-00002.arrow",
        "data-00001-of-00002.arrow",
    ]


# -- refusals found inside Ray, and the commit -------------------------------------------------


@pytest.mark.slow
def test_refusals_found_inside_ray_are_one_line(tmp_path, ray_local, tok_dir):
    from rayhybrid.prepare import prepare

    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_text('{"text": "fine"}\n' * 5)
    (raw / "b.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as err:
        prepare(config(raw, out, tok_dir))
    assert err.value.setting == "input" and "b.jsonl line 2" in str(err.value), str(err.value)

    (raw / "b.jsonl").write_text('{"text": "fine"}\n{"text": null}\n')
    with pytest.raises(ConfigError) as err:
        prepare(config(raw, out, tok_dir))
    assert err.value.setting == "field" and "b.jsonl" in str(err.value), str(err.value)

    (raw / "b.jsonl").unlink()
    with pytest.raises(ConfigError) as err:
        prepare(config(raw, out, tok_dir, val_fraction=0.05))
    assert err.value.setting == "val_fraction", str(err.value)
    assert sorted(p.name for p in out.iterdir()) == []  # no index, and no shards left behind


@pytest.mark.slow
def test_committed_output_is_not_prepared_twice(tmp_path, ray_local, tok_dir, docs):
    from rayhybrid.prepare import prepare

    write_corpus("jsonl", docs, local_put(tmp_path / "raw"))
    out = tmp_path / "out"
    cfg = config(tmp_path / "raw", out, tok_dir)
    first = prepare(cfg)
    index = (out / INDEX).read_text()
    assert prepare(cfg).already and (out / INDEX).read_text() == index

    args = [f"input={tmp_path / 'raw'}", f"output={out}", f"tokenizer={tok_dir}"]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"already prepared: {out} ({first.documents} documents, {first.tokens} tokens)" in proc.stdout

    write_corpus("jsonl", docs[:10], local_put(tmp_path / "other"))
    proc = run_cli([f"input={tmp_path / 'other'}", f"output={out}", f"tokenizer={tok_dir}"], tmp_path)
    assert_refused(proc, "output", "holds another prepared dataset", "choose another output")
    assert (out / INDEX).read_text() == index


def session_processes(sid: int) -> list[int]:
    table = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True, check=True).stdout
    return [int(pid) for pid, s in (line.split() for line in table.splitlines()) if int(s) == sid]


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the prepare's driver, then every process left in the session started for it
    (the Ray it started: its workers would otherwise write on until they notice), until none
    is left (a raylet may start one more while it dies)."""
    sid = proc.pid  # started with start_new_session: it leads its own session
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while (left := session_processes(sid)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    assert not session_processes(sid), "the killed prepare's processes did not go"


@pytest.mark.slow
def test_killed_prepare_leaves_no_index_and_reruns_clean(tmp_path, ray_local, tok_dir, hf_tok):
    """SIGKILL while the shards are being written (one per Ray Data write task, written one
    after the other), then the same prepare again."""
    from rayhybrid.prepare import prepare

    texts = corpus(2400, seed=5)
    write_corpus("jsonl", texts, local_put(tmp_path / "raw"), num_files=6)
    out = tmp_path / "out"
    args = [f"input={tmp_path / 'raw'}", f"output={out}", f"tokenizer={tok_dir}"]
    cli_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cli_env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, "-m", "rayhybrid.prepare", *args]
    output = tmp_path / "cli.log"  # the killed command's own lines, for a failure's message
    with open(output, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env, stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not list(out.glob("shard-*.lengths.npy")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not (out / INDEX).exists(), "the prepare finished before it could be killed: give it more input"
        assert proc.poll() is None, f"the prepare ended by itself: {output.read_text()[-2000:]}"
        ray_log = os.readlink(f"/proc/{proc.pid}/fd/2")  # its private file for Ray's output
    finally:
        kill_session(proc)
    Path(ray_log).unlink()
    assert list(out.glob("shard-*")) and not (out / INDEX).exists()
    with pytest.raises(ConfigError, match="index.json is missing"):
        open_prepared(str(out))

    done = prepare(config(tmp_path / "raw", out, tok_dir))
    assert not done.already and done.documents == len(texts)
    tokens, lengths = stream(str(out))
    clean = expected(hf_tok, texts)  # what a prepare from scratch writes (see test_each_format_on_s3)
    assert lengths.tolist() == [len(x) for x in clean]
    assert tokens.tolist() == [t for x in clean for t in x]
    shards = open_prepared(str(out)).index.shards
    names = {f"{s['name']}{suffix}" for s in shards for suffix in (".bin", ".lengths.npy")}
    assert {p.name for p in out.iterdir()} == {INDEX, *names}  # nothing stale is left


# -- refusals on the command line --------------------------------------------------------------


REFUSALS = {
    # case: (overrides beyond the defaults, the setting, words of the message)
    "no_match": (["input={tmp}/nothing/*.jsonl"], "input", ["matches no files"]),
    "all_empty": (["input={tmp}/empty"], "input", ["empty"]),
    "no_field": (["input={tmp}/body.jsonl"], "field", ["'text'", "found: body, n"]),
    "corrupt_parquet": (["input={tmp}/broken.parquet"], "input", ["broken.parquet", "Parquet"]),
    "no_tokenizer_dir": (["tokenizer=org/some-model"], "tokenizer", ["not a directory"]),
    "no_tokenizer_files": (["tokenizer={tmp}/empty"], "tokenizer", ["no tokenizer files"]),
    "unknown_format": (["format=csv"], "format", ["csv", "jsonl"]),
    "unknown_setting": (["colour=red"], "colour", ["not a setting"]),
    "output_protocol": (["output=nosuch://bucket/x"], "output", ["nosuch://"]),
    "output_not_writable": (["output={tmp}/body.jsonl/out"], "output", ["cannot write"]),
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory, tok_dir) -> dict[str, subprocess.CompletedProcess]:
    """Every case of REFUSALS run on the command line, side by side (none reaches Ray)."""
    tmp = tmp_path_factory.mktemp("refusals")
    (tmp / "empty").mkdir()
    (tmp / "empty" / "a.txt").write_bytes(b"")
    (tmp / "empty" / "b.txt").write_bytes(b"")
    (tmp / "good").mkdir()
    (tmp / "good" / "a.jsonl").write_text('{"text": "a document"}\n')
    (tmp / "body.jsonl").write_text('{"body": "a document", "n": 1}\n')
    (tmp / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    defaults = {"input": f"{tmp}/good", "output": f"{tmp}/out", "tokenizer": str(tok_dir)}

    def run(case: str) -> subprocess.CompletedProcess:
        given = [o.format(tmp=tmp) for o in REFUSALS[case][0]]
        keys = {o.split("=", 1)[0] for o in given}
        return run_cli([*given, *(f"{k}={v}" for k, v in defaults.items() if k not in keys)], tmp, timeout=120)

    with ThreadPoolExecutor(4) as pool:
        return dict(zip(REFUSALS, pool.map(run, REFUSALS)))


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusal_on_the_command_line(case, refusals):
    _, setting, words = REFUSALS[case]
    assert_refused(refusals[case], setting, *words)


@pytest.mark.slow
def test_bad_utf8_is_refused_from_inside_ray(tmp_path, tok_dir):
    """The one refusal that only the tokenizer actors find: the command line's own Ray, and
    the error that comes back wrapped, as one line."""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.txt").write_text("good text")
    (raw / "b.txt").write_bytes(b"caf\xe9 latin-1")
    proc = run_cli([f"input={raw}", f"output={tmp_path / 'out'}", f"tokenizer={tok_dir}"], tmp_path)
    assert_refused(proc, "input", "b.txt", "UTF-8")
    assert not (tmp_path / "out" / INDEX).exists()


# -- a failure is reported at once, naming its file, without reading the corpus ---------------


@contextlib.contextmanager
def counted_opens(monkeypatch, root: Path, delay: float = 0.0):
    """Every file under `root` this process (the driver) opens through fsspec, in order; each
    open first sleeps `delay` seconds (a slow store). The Ray workers are other processes."""
    from fsspec.implementations.local import LocalFileSystem

    opened, real = [], LocalFileSystem._open

    def counting(self, path, *args, **kwargs):
        if str(path).startswith(str(root)):
            opened.append(str(path))
            time.sleep(delay)
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "_open", counting)
    yield opened


def many_jsonl(root: Path, files: int, rows: int, text: str = "fine words") -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = [root / f"part-{i:03d}.jsonl" for i in range(files)]
    for path in paths:
        path.write_text((json.dumps({"text": text}) + "\n") * rows)
    return paths


@pytest.mark.slow
def test_a_bad_file_is_named_by_its_read_task_without_a_search(tmp_path, ray_local, tok_dir, monkeypatch):
    """200 files, one of them (#150) with a line that is not JSON: the read task that meets it
    names the file and the line, and the driver opens no input file but the first (the
    check before Ray). Before, the driver searched the files one by one after the failure."""
    from rayhybrid.prepare import prepare

    paths = many_jsonl(tmp_path / "raw", 200, rows=4)
    paths[150].write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": broken\n')
    with counted_opens(monkeypatch, tmp_path / "raw") as opened, pytest.raises(ConfigError) as err:
        prepare(config(tmp_path / "raw", tmp_path / "out", tok_dir))
    assert err.value.setting == "input" and "part-150.jsonl line 3 is not JSON" in str(err.value), str(err.value)
    assert opened == [str(paths[0])], f"the driver read {len(opened)} input files"
    assert not list((tmp_path / "out").iterdir())


def test_a_failure_that_names_no_file_searches_within_a_bound(tmp_path, monkeypatch):
    """A failure of Ray's own (a lost actor: no file named) on a corpus of 200 good files: the
    driver looks for a bad file only within the search's bounds, and the one-line error says
    how far it looked; it does not read the corpus."""
    from rayhybrid.errors import RayHybridError
    from rayhybrid.prepare import inputs as inputs_module
    from rayhybrid.prepare.run import refusal

    many_jsonl(tmp_path / "raw", 200, rows=400)  # about 10 KB a file
    listed = inputs_module.list_inputs(str(tmp_path / "raw"), "auto")
    lost = RuntimeError("ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.")
    monkeypatch.setattr(inputs_module, "SEARCH_BYTES", 100_000, raising=False)  # 10 files' worth
    with counted_opens(monkeypatch, tmp_path / "raw") as opened:
        err = refusal(lost, listed, "text")
    assert type(err) is RayHybridError and "\n" not in str(err), str(err)
    assert str(err).startswith("prepare failed: RuntimeError: ray.exceptions.ActorDiedError"), str(err)
    assert f"looked at {len(opened)} of 200 input files" in str(err) and "stopped there" in str(err), str(err)
    assert 1 <= len(opened) <= 10, f"the driver read {len(opened)} input files"

    # The time bound: a slow store (0.1 s an open) is searched for 0.3 s, not 20 s.
    monkeypatch.setattr(inputs_module, "SEARCH_BYTES", 1 << 40, raising=False)
    monkeypatch.setattr(inputs_module, "SEARCH_SECONDS", 0.3, raising=False)
    start = time.monotonic()
    with counted_opens(monkeypatch, tmp_path / "raw", delay=0.1) as opened:
        err = refusal(lost, listed, "text")
    assert time.monotonic() - start < 5 and len(opened) <= 6, (time.monotonic() - start, len(opened))
    assert f"looked at {len(opened)} of 200 input files" in str(err), str(err)


def test_a_read_task_failure_carries_its_file_and_ends_the_prepare_at_once(tmp_path, monkeypatch):
    """An I/O error in a read task (the store resets the connection) is raised with the
    file's URL; the driver reports it in one line (exit 1: not a setting) without a search."""
    from fsspec.implementations.local import LocalFileSystem

    from rayhybrid.errors import RayHybridError
    from rayhybrid.prepare.inputs import list_inputs
    from rayhybrid.prepare.reading import TaskFailed, read_files
    from rayhybrid.prepare.run import refusal

    paths = many_jsonl(tmp_path / "raw", 3, rows=2)

    class Flaky(LocalFileSystem):
        def _open(self, path, *args, **kwargs):
            raise ConnectionResetError(104, "Connection reset by peer")

    batch = {"path": np.array([str(paths[1])], dtype=object)}
    with pytest.raises(TaskFailed) as failed:
        list(read_files(batch, fs=Flaky(), fmt="jsonl", field="text", protocol=""))
    assert str(failed.value) == f"reading {paths[1]}: ConnectionResetError: [Errno 104] Connection reset by peer"

    # As Ray Data hands it back: only the text of the task's error.
    wrapped = RuntimeError(f"Traceback ...\nrayhybrid.prepare.reading.TaskFailed: {failed.value}\n")
    with counted_opens(monkeypatch, tmp_path / "raw") as opened:
        err = refusal(wrapped, list_inputs(str(tmp_path / "raw"), "auto"), "text")
    assert type(err) is RayHybridError and str(err) == f"prepare failed: {failed.value}"
    assert opened == []


# -- Ray's output on the command line goes to a private file -----------------------------------


def test_ray_output_goes_to_a_new_private_file(tmp_path, monkeypatch, capfd):
    """Another user may create the old predictable name (rayhybrid-prepare-<pid>.log in the
    temporary directory) first, as a link to a file of ours: it is not followed; the log is a
    new file that only its owner can read, and the error line names it."""
    from rayhybrid.prepare import __main__ as cli
    from rayhybrid.prepare import run

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    trap = tmp_path / f"rayhybrid-prepare-{os.getpid()}.log"
    trap.symlink_to(victim)

    def failing(cfg):
        os.write(2, b"what Ray printed\n")
        raise RuntimeError("the cluster went away")

    monkeypatch.setattr(run, "prepare", failing)
    with pytest.raises(SystemExit) as code:
        cli.main(["input=in", "output=out", "tokenizer=tok"])
    assert code.value.code == 1
    assert victim.read_text() == "mine\n" and trap.is_symlink()
    line = capfd.readouterr().err.strip()
    assert "\n" not in line and "the cluster went away (Ray's log: " in line, line
    log = Path(line.rsplit("(Ray's log: ", 1)[1].rstrip(")"))
    assert log != trap and log.parent == tmp_path and log.name.startswith("rayhybrid-prepare-")
    assert not log.is_symlink() and log.read_text() == "what Ray printed\n"
    assert log.stat().st_mode & 0o777 == 0o600


def test_a_failed_shard_write_names_the_shard_but_never_a_key_in_the_output_url(monkeypatch):
    """An output URL may carry credentials (s3://KEY:SECRET@bucket/...): a write task's error
    names the shard it was writing with the URL redacted."""
    import types

    from rayhybrid.prepare.reading import TaskFailed
    from rayhybrid.prepare.shards import ShardSink

    sink = ShardSink("s3://AKIAEXAMPLEKEY:VERYSECRETVALUE@bucket/out", {}, "uint16")

    def refused(blocks, ctx):
        raise OSError("access denied")

    monkeypatch.setattr(sink, "_write", refused)
    with pytest.raises(TaskFailed) as err:
        sink.write([], types.SimpleNamespace(task_idx=3))
    message = str(err.value)
    assert "shard-00003.bin" in message and "access denied" in message
    assert "AKIAEXAMPLEKEY" not in message and "VERYSECRETVALUE" not in message


def test_a_temporary_directory_that_cannot_be_written_is_one_line_naming_tmpdir(tmp_path, monkeypatch, capfd):
    """Ray's output goes to a private file in $TMPDIR: when none can be made there, the prepare
    stops with one line (exit 1) that says to set TMPDIR, not a traceback."""
    import rayhybrid.prepare.__main__ as cli
    from rayhybrid.prepare import run

    monkeypatch.setattr(run, "prepare", lambda cfg: pytest.fail("prepared without a file for Ray's output"))
    with monkeypatch.context() as only_here, pytest.raises(SystemExit) as code:  # pytest's capture needs its own
        only_here.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
        cli.main(["input=in", "output=out", "tokenizer=tok"])
    assert code.value.code == 1
    line = capfd.readouterr().err.strip()
    assert "\n" not in line and "cannot create a file for Ray's output" in line and "set TMPDIR" in line, line
