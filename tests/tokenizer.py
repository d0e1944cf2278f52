"""A tiny real tokenizer and corpus for the data tests, built offline in the test process.

    tok_dir = make_tokenizer(tmp_path / "tok")      # a Hugging Face tokenizer directory
    docs = corpus(200, seed=0)                       # documents of varied text (unicode included)

The tokenizer is a byte-level BPE trained with the `tokenizers` package on `corpus(...)` and
saved with transformers' `save_pretrained` (tokenizer.json + tokenizer_config.json), so
`AutoTokenizer.from_pretrained(tok_dir)` loads it as users load theirs. Nothing is downloaded.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

WORDS = [
    "the",
    "model",
    "reads",
    "tokens",
    "from",
    "shards",
    "on",
    "a",
    "store",
    "and",
    "every",
    "window",
    "of",
    "an",
    "epoch",
    "once",
    "données",
    "über",
    "naïve",
    "café",
    "東京",
    "数据",
    "пример",
    "λόγος",
    "✓",
    "🙂",
    "def",
    "return",
    "import",
    "class",
    "yield",
    "0",
    "1",
    "2",
    "3",
    "42",
]
SPECIALS = ["<|eos|>", "<|bos|>", "<|pad|>"]


def corpus(n: int, seed: int = 0, words: tuple[int, int] = (5, 120)) -> list[str]:
    """`n` documents of random words, lines and punctuation; lengths vary over `words`."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        k = rng.randint(*words)
        text = " ".join(rng.choice(WORDS) for _ in range(k))
        if i % 3 == 0:
            text = text.replace(" the ", "\nthe ", 2) + "."
        docs.append(f"doc {i}: {text}")
    return docs


def make_tokenizer(path: str | os.PathLike, vocab_size: int = 400, seed: int = 0) -> Path:
    """Train a byte-level BPE of `vocab_size` ids (specials included) and save it as a Hugging
    Face tokenizer directory at `path`; returns the path. EOS id 0, BOS id 1."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(300, seed=seed), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=SPECIALS[0], bos_token=SPECIALS[1], pad_token=SPECIALS[2]
    )
    path = Path(path)
    fast.save_pretrained(path)
    return path
