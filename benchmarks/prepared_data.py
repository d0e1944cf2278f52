"""Prepared data, end to end: `python -m rayhybrid.prepare` against the tokenizer's own loop, and
dp2 training on the prepared dataset read from S3 with and without read-ahead."""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

import common
import s3
from figures import fmt, header, table


def run(tmp: Path, quick: bool) -> dict:
    """Prepared data, end to end. (1) `python -m rayhybrid.prepare` on a generated JSON Lines
    corpus against the tokenizer's own batch encoding in a plain loop on the same cores
    (baselines/tokenize_loop.py; goal: prepare within 20%). (2) dp2 training on the prepared
    dataset in S3 (moto's server on 127.0.0.1, in this process), with read-ahead (the default,
    2 steps) and without: the share of step time the slowest rank waited for its samples (goal:
    at most 1% with it). Runs alternate A B B A."""
    # The corpus is large enough that prepare's fixed costs (Ray's start, the actors' processes)
    # are a small share; at 12 MB they were most of its time.
    megabytes, steps, pairs = (96, 12, 1) if quick else (256, 20, 2)
    corpus, tok = tmp / "corpus", tmp / "tokenizer"
    files = _corpus(corpus, megabytes)
    _tokenizer(tok, files[0], vocab_size=2048)
    loop = common.baseline("tokenize_loop.py", [str(tok), *map(str, files)])
    out = tmp / "prepared"
    started = time.perf_counter()
    proc = subprocess.run(
        [common.PY, "-m", "rayhybrid.prepare", f"input={corpus}", f"output={out}", f"tokenizer={tok}", "format=jsonl"],
        cwd=common.ROOT,
        env=common.env(),
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    wall = time.perf_counter() - started
    output = (proc.stdout + proc.stderr).splitlines()
    line = next(ln for ln in output if "tokenized and wrote" in ln)
    index = json.loads((out / "index.json").read_text())
    prepare = {
        "tokens": index["tokens"],
        "documents": index["documents"],
        "shards": len(index["shards"]),
        "wall_s": wall,
        "tokens_per_s": float(line.rsplit(",", 1)[1].split()[0]),
        "line": line.strip(),
        "actors": next((ln.split("tokenizing with ", 1)[1] for ln in output if "tokenizing with " in ln), ""),
    }
    runs = {"read-ahead 2": [], "read-ahead 0": []}
    order = [name for i in range(pairs) for name in (list(runs) if i % 2 == 0 else list(runs)[::-1])]
    with s3.loopback_aws(), s3.moto_server() as endpoint:
        aws = {**s3.CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
        s3.make_bucket("bench", endpoint)
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing").put(
            str(out), "bench/prepared", recursive=True
        )
        for i, name in enumerate(order):
            overrides = [*common.MODEL, *common.QUIET, "+topology=dp2", "train.global_batch_size=16", "train.micro_batch_size=2",
                         f"train.steps={steps}", "data=prepared", "data.seq_len=128", "data.path=s3://bench/prepared",
                         f"data.read_ahead={name.split()[-1]}"]  # fmt: skip
            _, records, _ = common.train(overrides, tmp / f"data-{i}", extra_env=aws)
            kept = records[2:]
            runs[name].append({"wait_s": sum(r["data_wait_s"] for r in kept),
                               "step_s": sum(r["step_time_s"] for r in kept),
                               "median_wait_ms": 1e3 * statistics.median(r["data_wait_s"] for r in kept),
                               "median_step_s": statistics.median(r["step_time_s"] for r in kept)})  # fmt: skip
    rows = [{"case": name, "share": sum(x["wait_s"] for x in xs) / sum(x["step_s"] for x in xs),
             "median_wait_ms": statistics.median(x["median_wait_ms"] for x in xs),
             "median_step_s": statistics.median(x["median_step_s"] for x in xs), "runs": len(xs)}
            for name, xs in runs.items()]  # fmt: skip
    return {"megabytes": megabytes, "steps": steps, "loop": loop, "prepare": prepare,
            "prepare_vs_loop": prepare["tokens_per_s"] / loop["tokens_per_s"], "rows": rows}  # fmt: skip


WORDS_SEED = 20261125


def _corpus(directory: Path, megabytes: int, files: int = 4) -> list[Path]:
    """JSON Lines of generated prose: Zipf-distributed words of a fixed made-up lexicon, in
    sentences and documents of varied length (so BPE has merges to learn)."""
    import random

    rng = random.Random(WORDS_SEED)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    lexicon = ["".join(rng.choices(letters, k=rng.randint(1, 9))) for _ in range(20000)]
    weights = [1 / (r + 1) for r in range(len(lexicon))]
    directory.mkdir(parents=True, exist_ok=True)
    paths, per_file = [], megabytes * 2**20 // files
    for i in range(files):
        path, size = directory / f"part-{i}.jsonl", 0
        with open(path, "w") as f:
            while size < per_file:
                words = rng.choices(lexicon, weights, k=rng.randint(20, 600))
                text = " ".join(words).capitalize() + "."
                line = json.dumps({"id": size, "text": text}) + "\n"
                f.write(line)
                size += len(line)
        paths.append(path)
    return paths


def _tokenizer(directory: Path, sample: Path, vocab_size: int) -> None:
    """A byte-level BPE trained on the first file, saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|eos|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    with open(sample) as f:
        tok.train_from_iterator((json.loads(line)["text"] for line in f), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>").save_pretrained(directory)


def section(r: dict) -> str:
    """Its section of BENCHMARKS.md."""
    out = (
        "## 8. Data: preparing a corpus, and reading it from S3 while training\n\n"
        "A generated JSON Lines corpus (4 files of made-up prose, Zipf-distributed words), tokenized with a "
        "byte-level BPE of 2,048 ids trained on its first file. *Plain loop*: the tokenizer's own batch encoding "
        "(`tokenizer(texts, add_special_tokens=False)`, 1,000 documents a batch) in one process with every core, "
        "the documents read beforehand (`benchmarks/baselines/tokenize_loop.py`). *prepare*: `python -m "
        "rayhybrid.prepare` on the same files and cores, on a local Ray it starts; its tokens per second are those "
        "of its reading, tokenizing and writing (its own log line), its wall time includes starting Ray and "
        "listing the input. Then dp2 trains on the prepared dataset from S3 (moto's server on 127.0.0.1, in the "
        "benchmark's process, on the same 2 cores): *wait share* is the slowest rank's time waiting for its "
        "samples over the step time, summed over the steps after the first two.\n\n"
    )
    out += header(r)
    if "prepare" not in r:
        return out
    loop, prep = r["loop"], r["prepare"]
    out += table(
        ["", "tokens", "seconds", "tokens/s", "vs plain loop"],
        [
            ["plain loop", f"{loop['tokens']:,}", fmt(loop["seconds"], 1), f"{loop['tokens_per_s']:,.0f}", "1.00x"],
            [
                "prepare",
                f"{prep['tokens']:,}",
                f"{prep['tokens'] / prep['tokens_per_s']:.1f} (wall {prep['wall_s']:.1f})",
                f"{prep['tokens_per_s']:,.0f}",
                f"{r['prepare_vs_loop']:.2f}x",
            ],
        ],
    )
    out += (
        f"\nThe corpus: {r['megabytes']} MB. prepare wrote {prep['documents']:,} documents in {prep['shards']} shards"
    )
    out += f", tokenizing with {prep['actors'].strip()}.\n\n" if prep.get("actors") else ".\n\n"
    out += table(
        ["training from S3", "wait share", "median wait (ms)", "median step (s)", "runs"],
        [
            [
                x["case"],
                fmt(x["share"], 2, pct=True),
                fmt(x["median_wait_ms"], 1),
                fmt(x["median_step_s"], 3),
                str(x["runs"]),
            ]
            for x in r["rows"]
        ],
    )
    return out + "\n"


def summary(r: dict) -> str:
    """Its line of the printed table (after its name): the figures that matter."""
    return f"prepare/plain loop {fmt(r['prepare_vs_loop'])}x; wait share from S3 " + "  ".join(
        f"{x['case']} {fmt(x['share'], pct=True)}" for x in r["rows"]
    )
