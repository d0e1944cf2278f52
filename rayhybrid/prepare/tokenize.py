"""The tokenizer: its facts (read once on the driver, recorded in the index) and the actor that
turns batches of documents into token ids.

    info = load_tokenizer("/models/llama3", bos=False)    # ConfigError naming `tokenizer`
    info.facts(), info.dtype                             # {name, vocab_size, eos_id, bos_id, sha256}, "uint32"

A document is exactly `tokenizer(text, add_special_tokens=False)["input_ids"]` followed by the
EOS id (the BOS id first with bos=true). The driver loads the tokenizer with transformers'
`AutoTokenizer`; the actors get what it loaded, not a path, so actors on other nodes tokenize
alike. For a fast tokenizer that is its Rust backend as transformers configured it (a JSON
string): transformers' `__call__` is that backend's `encode_batch` without truncation or
padding, and an actor then starts without importing transformers (which imports torch: seconds
per process). The driver checks that both give the same ids on a probe text; a tokenizer that
fails the check, or is not fast, travels as its files, and each actor loads it once with
transformers, offline, from a private copy. No Ray here: `Tokenize` is plain code that Ray Data
runs.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rayhybrid.data.prepared import token_dtype
from rayhybrid.errors import ConfigError, RayHybridError
from rayhybrid.prepare.formats import Format, get
from rayhybrid.prepare.reading import TaskFailed, shown
from rayhybrid.storage.store import one_line

MAX_FILE_BYTES = 256 << 20  # a tokenizer file is never this large; model weights are
TOKENIZER_NAMES = {
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "config.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
}
FILES_NEEDED = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model")


def tokenizer_files(directory: str) -> dict[str, bytes]:
    """The files of a tokenizer directory that loading it needs (never model weights)."""
    root = Path(directory)
    out = {}
    for path in sorted(root.iterdir()):
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        if path.name.startswith("tokenizer") or path.name in TOKENIZER_NAMES:
            out[path.name] = path.read_bytes()
    return out


def load_files(files: dict[str, bytes]):
    """A transformers tokenizer from its files, loaded offline from a private copy."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    tmp = tempfile.mkdtemp(prefix="rayhybrid-tokenizer-")
    try:
        for name, data in files.items():
            Path(tmp, name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp, local_files_only=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class TokenizerInfo:
    """What the index records of a tokenizer, and its files for the actors."""

    name: str
    vocab_size: int  # len(tokenizer): every id, added tokens included
    eos_id: int
    bos_id: int | None
    sha256: str | None  # of tokenizer.json
    files: dict[str, bytes] = field(repr=False, default_factory=dict)
    backend: str | None = field(repr=False, default=None)  # the Rust tokenizer, when it gives the same ids
    split_special_tokens: bool = False

    @property
    def dtype(self) -> str:
        return token_dtype(self.vocab_size)

    def facts(self) -> dict:
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "bos_id": self.bos_id,
            "sha256": self.sha256,
        }


HOW = "give the local directory of a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json)"


def load_tokenizer(directory: str, bos: bool) -> TokenizerInfo:
    """Load the tokenizer at `directory` once, on the driver; ConfigError naming `tokenizer`
    when it is missing, cannot be loaded, or lacks the EOS id (or BOS with bos=true)."""
    path = Path(os.path.expanduser(directory))
    if not path.is_dir():
        raise ConfigError(
            "tokenizer",
            f"{directory} is not a directory; {HOW}; a hub id must be downloaded first "
            "(hf download <id> --include 'tokenizer*' --local-dir DIR)",
        )
    files = tokenizer_files(str(path))
    if not any(name in files for name in FILES_NEEDED):
        raise ConfigError("tokenizer", f"{directory} holds no tokenizer files; {HOW}")
    try:
        tok = load_files(files)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds for a bad directory
        raise ConfigError("tokenizer", f"cannot load {directory}: {one_line(err)}; {HOW}") from None
    if tok.eos_token_id is None:
        raise ConfigError(
            "tokenizer",
            f"{directory} has no EOS token, which ends every document; set eos_token in its "
            "tokenizer_config.json, or choose a tokenizer that has one",
        )
    if bos and tok.bos_token_id is None:
        raise ConfigError("tokenizer", f"{directory} has no BOS token, and bos=true asks for one; set bos=false")
    digest = hashlib.sha256(files["tokenizer.json"]).hexdigest() if "tokenizer.json" in files else None
    split = bool(getattr(tok, "split_special_tokens", False))
    return TokenizerInfo(
        name=path.resolve().name,
        vocab_size=len(tok),
        eos_id=int(tok.eos_token_id),
        bos_id=None if tok.bos_token_id is None else int(tok.bos_token_id),
        sha256=digest,
        files=files,
        backend=_backend(tok, split),
        split_special_tokens=split,
    )


PROBE = "Hello, world!\n  données über naïve 東京 ✓ 🙂\tdef f(x):\n    return x  # 42 "


def rust_tokenizer(backend: str, split_special_tokens: bool):
    """The `tokenizers.Tokenizer` of a fast tokenizer's backend JSON, set up as transformers'
    `__call__` uses it: no truncation, no padding, special tokens split or not as configured."""
    from tokenizers import Tokenizer

    rust = Tokenizer.from_str(backend)
    rust.no_truncation()
    rust.no_padding()
    rust.encode_special_tokens = split_special_tokens
    return rust


def _backend(tok, split: bool) -> str | None:
    """A fast tokenizer's backend as JSON, when it encodes a probe text (with the special
    tokens' own text in it) as transformers does; else None."""
    if not getattr(tok, "is_fast", False) or getattr(tok, "backend_tokenizer", None) is None:
        return None
    backend = tok.backend_tokenizer.to_str()
    probe = [PROBE + " ".join(getattr(tok, "all_special_tokens", [])), ""]
    try:
        ids = [e.ids for e in rust_tokenizer(backend, split).encode_batch(probe, add_special_tokens=False)]
    except Exception:  # noqa: BLE001 - any difference means: use transformers in the actors
        return None
    return backend if ids == tok(probe, add_special_tokens=False)["input_ids"] else None


class Tokenize:
    """Ray Data's stateful UDF: a batch of documents -> one row holding their tokens (bytes of
    `dtype`, little-endian) and their lengths (int64 bytes), in the batch's order."""

    def __init__(
        self, *, tokenizer: TokenizerInfo, fmt: str | Format, field: str, bos: bool, protocol: str, threads: int
    ):
        # Set here, not with a runtime_env (a worker process of its own: seconds per actor), and
        # before the first encode builds the Rust thread pool: as many threads as CPUs reserved.
        os.environ["RAYON_NUM_THREADS"] = str(threads)
        os.environ["HF_HUB_OFFLINE"] = "1"
        if tokenizer.backend is not None:
            rust = rust_tokenizer(tokenizer.backend, tokenizer.split_special_tokens)
            self.encode = lambda texts: [e.ids for e in rust.encode_batch_fast(texts, add_special_tokens=False)]
        else:
            tok = load_files(tokenizer.files)
            self.encode = lambda texts: tok(texts, add_special_tokens=False)["input_ids"]
        self.fmt, self.field, self.protocol = get(fmt), field, protocol
        self.eos_id, self.bos_id = tokenizer.eos_id, tokenizer.bos_id if bos else None
        self.dtype = np.dtype(tokenizer.dtype).newbyteorder("<")

    def texts(self, batch: dict) -> list[str]:
        """The batch's documents as text; ConfigError naming the file of a bad one."""
        paths = batch.get("path")
        if not self.fmt.field:  # a file is a document: its bytes, decoded here
            out = []
            for data, path in zip(batch["bytes"], paths):
                try:
                    out.append(bytes(data).decode("utf-8"))
                except UnicodeDecodeError as err:
                    where = shown(self.protocol, str(path))
                    raise ConfigError(
                        "input", f"{where} is not UTF-8 ({err.reason} at byte {err.start}); convert or remove it"
                    ) from None
            return out
        if self.field not in batch:
            found = ", ".join(k for k in batch if k != "path") or "none"
            where = shown(self.protocol, str(paths[0])) if paths is not None and len(paths) else "the input"
            raise ConfigError("field", f"{where} has no {self.field!r} (found: {found}); give field=<one of them>")
        values = batch[self.field]
        for i, value in enumerate(values):
            if not isinstance(value, str):
                where = shown(self.protocol, str(paths[i])) if paths is not None else "the input"
                kind = "nothing" if value is None else f"a {type(value).__name__}"
                raise ConfigError("field", f"a document of {where} has {kind} in {self.field!r}, not text")
        return [str(v) for v in values]

    def __call__(self, batch: dict) -> dict:
        try:
            return self.tokenize(self.texts(batch))
        except RayHybridError:
            raise
        except Exception as err:  # noqa: BLE001 - the error leaves with the files it was tokenizing
            paths = sorted({shown(self.protocol, str(p)) for p in batch.get("path", ())})
            files = f"{paths[0]}{f' (and {len(paths) - 1} more)' if len(paths) > 1 else ''}" if paths else "the input"
            raise TaskFailed(f"tokenizing documents of {files}: {one_line(err)}") from None

    def tokenize(self, texts: list[str]) -> dict:
        ids = self.encode(texts) if texts else []
        extra = 1 if self.bos_id is None else 2
        lengths = np.fromiter((len(x) + extra for x in ids), dtype=np.int64, count=len(ids))
        ends = np.cumsum(lengths)
        tokens = np.empty(int(ends[-1]) if len(ends) else 0, dtype=self.dtype)
        content = np.ones(len(tokens), dtype=bool)
        content[ends - 1] = False
        if self.bos_id is not None:
            content[ends - lengths] = False
            tokens[ends - lengths] = self.bos_id
        tokens[ends - 1] = self.eos_id
        tokens[content] = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(content.sum()))
        return {
            "tokens": np.array([tokens.tobytes()], dtype=object),
            "lengths": np.array([lengths.tobytes()], dtype=object),
        }
