"""Input formats of `python -m rayhybrid.prepare` as a registry (rayhybrid/prepare/formats/): a
format is one `Format` value in a module of its own, and one `register` call makes prepare
recognise its files, check them before Ray and read them in its tasks. The rest of prepare
names no format: a comparison with a format's name that creeps back fails here."""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path

import numpy as np
import pytest

from rayhybrid.config.prepare import PrepareConfig
from rayhybrid.data.prepared import open_prepared
from rayhybrid.errors import ConfigError
from rayhybrid.prepare import formats
from rayhybrid.prepare.formats import Format, format_of, register
from rayhybrid.prepare.inputs import find_bad_file, list_inputs
from rayhybrid.prepare.reading import read_files
from tests.tokenizer import corpus, make_tokenizer

ROOT = Path(__file__).resolve().parents[1] / "rayhybrid"


@contextlib.contextmanager
def lines_format():
    """A format of the test's own, registered for the block: `.lines` files, one document per
    line, `field=` naming nothing (a line is all text). Defined here, not in a module of
    rayhybrid: Ray's tasks get the Format itself, its functions pickled by value."""
    from rayhybrid.prepare.formats.format import rows

    def read(fs, path, field, where):
        texts = [line for line in fs.cat_file(path).decode("utf-8").splitlines() if line.strip()]
        yield rows(field, texts, path)

    def inspect(fs, path, where, field, first_only):
        data = fs.cat_file(path)
        (data.split(b"\n", 1)[0] if first_only else data).decode("utf-8")

    fmt = Format(name="lines", what="a file of lines", read=read, inspect=inspect, suffixes=(".lines",))
    before = dict(formats.FORMATS)
    register(fmt)  # the one thing a new format needs beyond its own code
    try:
        yield fmt
    finally:
        formats.FORMATS.clear()
        formats.FORMATS.update(before)


def write_lines(root: Path, texts: list[str], num_files: int = 3) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for n, part in enumerate(np.array_split(np.array(texts, dtype=object), num_files)):
        (root / f"part-{n:02d}.lines").write_text("".join(t.replace("\n", " ") + "\n" for t in part))


def test_the_built_in_formats_are_registered_in_one_place():
    assert list(formats.FORMATS) == ["text", "jsonl", "parquet", "hf"]
    assert formats.names() == ["auto", "text", "jsonl", "parquet", "hf"]
    assert format_of("a/b.jsonl.gz").name == "jsonl" and format_of("x.parquet").name == "parquet"
    assert format_of("data-0.arrow").name == "hf" and format_of("notes.md").name == "text"  # text: catch-all
    with pytest.raises(ConfigError) as err:
        formats.get("csv")
    assert err.value.setting == "format" and "auto, text, jsonl, parquet, hf" in str(err.value)


def test_a_registered_format_is_recognised_checked_and_read(tmp_path):
    texts = ["first line", "second line", "third line", "fourth", "fifth"]
    write_lines(tmp_path / "raw", texts)
    with pytest.raises(ConfigError):  # not a format before it is registered
        list_inputs(str(tmp_path / "raw"), "lines")
    with lines_format() as fmt:
        assert "lines" in formats.names()
        inputs = list_inputs(str(tmp_path / "raw"), "auto")  # recognised by its name
        assert inputs.format is fmt and [Path(s.path).name for s in inputs.files] == [
            f"part-{n:02d}.lines" for n in range(3)
        ]
        assert list_inputs(str(tmp_path / "raw"), "lines").format is fmt
        read = [
            t
            for s in inputs.files
            for b in read_files({"path": [s.path]}, fs=inputs.fs, fmt=fmt, field="text", protocol="")
            for t in b["text"]
        ]
        assert read == texts
        assert find_bad_file(inputs, "text").problem is None
        (tmp_path / "raw" / "part-01.lines").write_bytes(b"\xff\xfe not utf-8\n")
        problem = find_bad_file(inputs, "text").problem
        assert problem is not None and "part-01.lines is not UTF-8" in str(problem)
    with pytest.raises(ConfigError):  # and gone again
        formats.get("lines")


@pytest.mark.slow
def test_prepare_reads_a_registered_format_end_to_end(tmp_path):
    """The whole prepare, on a local Ray: the new format's files become documents in order,
    each tokenized as transformers does, and the index records the format's name."""
    import ray
    from transformers import AutoTokenizer

    from rayhybrid.prepare import prepare

    tok_dir = make_tokenizer(tmp_path / "tok")
    texts = [t.replace("\n", " ") for t in corpus(30, seed=9)]
    write_lines(tmp_path / "raw", texts)
    hf_tok = AutoTokenizer.from_pretrained(tok_dir)
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        with lines_format():
            cfg = PrepareConfig(input=str(tmp_path / "raw"), output=str(tmp_path / "out"), tokenizer=str(tok_dir))
            done = prepare(cfg)
    finally:
        ray.shutdown()
    ds = open_prepared(done.url)
    assert ds.index.raw["input"] == {"format": "lines", "field": "text"}
    want = [ids + [hf_tok.eos_token_id] for ids in hf_tok(texts, add_special_tokens=False)["input_ids"]]
    assert [ds.document(i).tolist() for i in range(ds.num_documents)] == want


FORMAT_WORDS = {"text", "jsonl", "parquet", "hf", "arrow", "auto"}


def format_literals(path: Path) -> list[str]:
    """Where a module compares something with a format's name, or keys a table by one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op in operands:
                items = op.elts if isinstance(op, (ast.Tuple, ast.List, ast.Set)) else [op]
                for item in items:
                    if isinstance(item, ast.Constant) and item.value in FORMAT_WORDS:
                        found.append(f"{path.name}:{node.lineno} compares with {item.value!r}")
        elif isinstance(node, ast.Dict):
            for key in node.keys:
                if isinstance(key, ast.Constant) and key.value in FORMAT_WORDS:
                    found.append(f"{path.name}:{node.lineno} keys a table by {key.value!r}")
    return found


def test_no_format_name_is_compared_outside_the_registry():
    """Adding a format touches its module and its registration: prepare's other modules and
    its settings go through the Format, never `fmt == "text"` or a table keyed by names."""
    modules = [p for p in (ROOT / "prepare").glob("*.py")] + [ROOT / "config" / "prepare.py"]
    assert [hit for path in sorted(modules) for hit in format_literals(path)] == []
