"""Synthetic tasks with verifiable rewards, written as the JSONL files a user would bring.

`arith`: single-digit addition, "3+4=" -> "7". A randomly initialised tiny model answers about 1 in
40 correctly (the answer token is one of ~60); GRPO raises that above 0.8 in a few minutes on a CPU.
test.jsonl holds problems train.jsonl does not: 11 sums a+b (a != b) whose mirror b+a stays in
training, so a held-out problem is a new prompt whose answer the training ones imply (commutativity).
"""

from __future__ import annotations

import json
import os
import random


def arith_rows(max_sum: int = 9) -> list[dict]:
    rows = []
    for a in range(10):
        for b in range(10):
            if a + b <= max_sum:
                rows.append({"prompt": f"{a}+{b}=", "label": str(a + b), "metadata": {"a": a, "b": b}})
    return rows


def write_jsonl(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def split_arith(rows: list[dict], n_test: int = 11, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, test), disjoint: test takes n_test sums a+b with a < b (the mirror b+a stays in train)."""
    candidates = [i for i, r in enumerate(rows) if r["metadata"]["a"] < r["metadata"]["b"]]
    held = set(random.Random(seed).sample(candidates, n_test))
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]


def make_arith(out_dir: str, seed: int = 0) -> None:
    """Write out_dir/train.jsonl (44 of the 55 sums) and out_dir/test.jsonl (the other 11)."""
    train, test = split_arith(arith_rows(), seed=seed)
    write_jsonl(os.path.join(out_dir, "train.jsonl"), train)
    write_jsonl(os.path.join(out_dir, "test.jsonl"), test)
