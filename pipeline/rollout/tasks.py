"""Synthetic tasks with verifiable rewards, written as the JSONL files a user would bring.

`arith`: single-digit addition, "3+4=" -> "7". A randomly initialised tiny model answers about 1 in
40 correctly (the answer token is one of ~60); GRPO raises that above 0.8 in a few minutes on a CPU.
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


def make_arith(out_dir: str, seed: int = 0) -> None:
    """Write out_dir/train.jsonl (all 55 sums) and out_dir/test.jsonl (the same, shuffled)."""
    rows = arith_rows()
    write_jsonl(os.path.join(out_dir, "train.jsonl"), rows)
    shuffled = rows[:]
    random.Random(seed).shuffle(shuffled)
    write_jsonl(os.path.join(out_dir, "test.jsonl"), shuffled)
