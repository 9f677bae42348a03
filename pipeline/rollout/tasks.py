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


# `multidigit`: multi-digit addition, subtraction (a >= b) and multiplication by one digit, answered
# through a column scratchpad: one step per column from the right, "x<op>y<carry>=v" with the carry in
# signed form (+0, +1, -1, +5: the previous step's floor(v / 10)), then " >" and the answer, e.g.
#   "4821+395="  ->  "1+5+0=6 2+9+0=11 8+3+1=12 4+0+1=5 >5216"
#   "4821-395="  ->  "1-5+0=-4 2-9-1=-8 8-3-1=4 4-0+0=4 >4426"
#   "4821*7="    ->  "1*7+0=7 2*7+0=14 8*7+1=57 4*7+5=33 >33747"
# The reward (`final_answer`) is an exact match of the text after the last ">". SFT rows (sft.jsonl) show
# the scratchpad on easy problems (first operand of up to `sft_max_digits` digits); the RL prompts
# (train.jsonl) and the held-out set (test.jsonl) go up to `max_digits` (both 4 by default, the GPU recipe's
# measured setting; a larger max_digits holds problems SFT never showed). test.jsonl's problems are in
# neither of the other files.
MULTIDIGIT_OPS = ("+", "-", "*")


def multidigit_scratchpad(a: int, op: str, b: int) -> tuple[str, str]:
    """(response, answer) of the problem `a op b`: the column steps, then " >answer"."""
    assert op in MULTIDIGIT_OPS and a >= 0 and b >= 0 and (op != "-" or a >= b), (a, op, b)
    steps, carry = [], 0
    da = str(a)[::-1]
    db = str(b)[::-1] if op != "*" else ""
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = b if op == "*" else (int(db[i]) if i < len(db) else 0)
        v = {"+": x + y, "-": x - y, "*": x * y}[op] + carry
        steps.append(f"{x}{op}{y}{carry:+d}={v}")
        carry = v // 10  # floor: a negative column borrows 1 from the next
    answer = str({"+": a + b, "-": a - b, "*": a * b}[op])
    return " ".join(steps) + " >" + answer, answer


def multidigit_problem(rng: random.Random, digits: int) -> tuple[int, str, int]:
    """One problem whose first operand has `digits` digits: a op b, b of 1..digits digits (one digit,
    2-9, for *), b <= a for -."""
    lo = 10 ** (digits - 1) if digits > 1 else 0
    a = rng.randrange(lo, 10**digits)
    op = rng.choice(MULTIDIGIT_OPS)
    if op == "*":
        return a, op, rng.randrange(2, 10)
    b_digits = rng.randint(1, digits)
    b = rng.randrange(10 ** (b_digits - 1) if b_digits > 1 else 0, 10**b_digits)
    if op == "-" and b > a:
        a, b = b, a
    return a, op, b


def multidigit_row(a: int, op: str, b: int, with_response: bool) -> dict:
    response, answer = multidigit_scratchpad(a, op, b)
    row = {"prompt": f"{a}{op}{b}=", "label": answer, "metadata": {"a": a, "op": op, "b": b, "digits": len(str(a))}}
    if with_response:
        row["response"] = response
    return row


def multidigit_splits(n_sft: int = 20000, n_train: int = 20000, n_test_per_digits: int = 64, sft_max_digits: int = 4,
                      max_digits: int = 4, seed: int = 0) -> dict[str, list[dict]]:
    """{"sft", "train", "test"}: test first (n_test_per_digits distinct problems for each first-operand length
    2..max_digits), then SFT rows (lengths 1..sft_max_digits, with responses) and RL prompts (lengths
    1..max_digits), each distinct within itself and none of them a test problem."""
    if not 1 <= sft_max_digits <= max_digits:
        raise ValueError(f"sft_max_digits ({sft_max_digits}) must be in 1..max_digits ({max_digits})")
    rng = random.Random(seed)
    test: dict[str, tuple] = {}
    for digits in range(2, max_digits + 1):
        count = 0
        while count < n_test_per_digits:
            p = multidigit_problem(rng, digits)
            key = f"{p[0]}{p[1]}{p[2]}"
            if key not in test:
                test[key], count = p, count + 1

    def draw(n: int, top: int) -> list[tuple]:
        seen: dict[str, tuple] = {}
        # lengths are drawn uniformly; short ones have few problems (235 with a one-digit first operand), so
        # their share is capped by what exists, and asking for more distinct problems than exist is refused
        for _ in range(50 * n + 10_000):
            if len(seen) == n:
                return list(seen.values())
            p = multidigit_problem(rng, rng.randint(1, top))
            key = f"{p[0]}{p[1]}{p[2]}"
            if key not in test:
                seen.setdefault(key, p)
        raise ValueError(f"only {len(seen)} distinct problems of up to {top} digits found, {n} asked for:"
                         " ask for fewer rows or allow longer operands")

    return {"sft": [multidigit_row(*p, with_response=True) for p in draw(n_sft, sft_max_digits)],
            "train": [multidigit_row(*p, with_response=False) for p in draw(n_train, max_digits)],
            "test": [multidigit_row(*p, with_response=False) for p in test.values()]}


def make_multidigit(out_dir: str, seed: int = 0, **sizes) -> dict[str, int]:
    """Write out_dir/sft.jsonl, train.jsonl and test.jsonl (multidigit_splits); returns their row counts."""
    splits = multidigit_splits(seed=seed, **sizes)
    for name, rows in splits.items():
        write_jsonl(os.path.join(out_dir, f"{name}.jsonl"), rows)
    return {name: len(rows) for name, rows in splits.items()}
