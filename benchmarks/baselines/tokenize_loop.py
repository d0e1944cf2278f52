"""The baseline prepare is measured against: the tokenizer's own batch encoding in a plain loop,
in one process on this machine's cores (the Rust tokenizer spreads a batch over every core).

    python benchmarks/baselines/tokenize_loop.py <tokenizer dir> <jsonl file>...

Reads every document (the "text" field) first, then times only the encoding: each batch of
1,000 documents as prepare encodes them, `tokenizer(texts, add_special_tokens=False)`, plus
an EOS id each. Prints one JSON line: documents, tokens, seconds, tokens_per_s.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    texts = []
    for path in sys.argv[2:]:
        with open(path) as f:
            texts += [json.loads(line)["text"] for line in f if line.strip()]
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), 1000):
        ids = tokenizer(texts[i : i + 1000], add_special_tokens=False)["input_ids"]
        tokens += sum(len(x) + 1 for x in ids)  # + EOS
    seconds = time.perf_counter() - start
    print(json.dumps({"documents": len(texts), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}))


if __name__ == "__main__":
    main()
