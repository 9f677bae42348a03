"""The multidigit task (the GPU learning recipe's): seeded generation, the scratchpad's format and
arithmetic, a held-out set disjoint from the SFT rows and the RL prompts, the final_answer reward, the
char-100m preset, and the recipe's memory estimate on one H200."""

from __future__ import annotations

import collections
import json
import os
import re

import pytest

from pipeline.rollout.rewards import REGISTRY, final_answer_reward, resolve_reward
from pipeline.rollout.tasks import make_multidigit, multidigit_scratchpad, multidigit_splits

from conftest import REPO

STEP = re.compile(r"^(\d)([-+*])(\d)([-+]\d+)=(-?\d+)$")
OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


@pytest.fixture(scope="module")
def splits():
    return multidigit_splits()  # the recipe's sizes: 20000 SFT rows, 20000 RL prompts, 3 x 64 held out


def check_scratchpad(prompt: str, response: str, label: str) -> None:
    """Every column step is right, carries chain from one step to the next, and the answer after " >" is
    the label, which is the prompt's value."""
    a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", prompt).groups()
    assert label == str(OPS[op](int(a), int(b)))
    steps, marker, answer = response.rpartition(" >")
    assert marker and answer == label
    carry = 0
    for i, step in enumerate(steps.split(" ")):
        x, sop, y, c, v = STEP.fullmatch(step).groups()
        assert sop == op and int(x) == (int(a[::-1][i]) if i < len(a) else 0)
        assert int(y) == (int(b) if op == "*" else (int(b[::-1][i]) if i < len(b) else 0))
        assert int(c) == carry and int(v) == OPS[op](int(x), int(y)) + carry
        carry = int(v) // 10
    assert i + 1 == max(len(a), 1 if op == "*" else len(b))


def test_scratchpad_by_hand():
    assert multidigit_scratchpad(4821, "+", 395) == ("1+5+0=6 2+9+0=11 8+3+1=12 4+0+1=5 >5216", "5216")
    assert multidigit_scratchpad(4821, "-", 395) == ("1-5+0=-4 2-9-1=-8 8-3-1=4 4-0+0=4 >4426", "4426")
    assert multidigit_scratchpad(4821, "*", 7) == ("1*7+0=7 2*7+0=14 8*7+1=57 4*7+5=33 >33747", "33747")
    assert multidigit_scratchpad(1000, "-", 999) == ("0-9+0=-9 0-9-1=-10 0-9-1=-10 1-0-1=0 >1", "1")
    assert multidigit_scratchpad(999, "+", 1) == ("9+1+0=10 9+0+1=10 9+0+1=10 >1000", "1000")


def test_rows_are_right_and_in_the_tokenizer(splits):
    from pipeline.models.tokenizer import TINY_CHARS

    chars = set(TINY_CHARS)
    for row in splits["sft"]:
        check_scratchpad(row["prompt"], row["response"], row["label"])
        assert set(row["prompt"] + row["response"]) <= chars
    for row in splits["train"] + splits["test"]:
        a, op, b = row["metadata"]["a"], row["metadata"]["op"], row["metadata"]["b"]
        assert row["prompt"] == f"{a}{op}{b}=" and row["label"] == str(OPS[op](a, b)) and "response" not in row
        assert (op != "-" or a >= b) and (op != "*" or 2 <= b <= 9)


def test_test_set_is_disjoint_and_lengths_follow_the_split(splits):
    prompts = {name: [r["prompt"] for r in rows] for name, rows in splits.items()}
    for name, ps in prompts.items():
        assert len(ps) == len(set(ps)), f"{name} repeats a problem"
    assert not set(prompts["test"]) & set(prompts["sft"])
    assert not set(prompts["test"]) & set(prompts["train"])
    assert {len(ps) for ps in prompts.values()} == {20000, 192}
    digits = {name: collections.Counter(r["metadata"]["digits"] for r in rows) for name, rows in splits.items()}
    assert digits["test"] == {2: 64, 3: 64, 4: 64}
    assert set(digits["sft"]) == {1, 2, 3, 4} and set(digits["train"]) == {1, 2, 3, 4}
    # a longer max_digits: RL prompts and the held-out set go past what SFT shows
    longer = multidigit_splits(n_sft=500, n_train=500, n_test_per_digits=8, sft_max_digits=3, max_digits=5)
    longer_digits = {name: collections.Counter(r["metadata"]["digits"] for r in rows) for name, rows in longer.items()}
    assert max(longer_digits["sft"]) == 3 and max(longer_digits["train"]) == 5
    assert longer_digits["test"] == {2: 8, 3: 8, 4: 8, 5: 8}
    assert collections.Counter(r["metadata"]["op"] for r in splits["train"]).keys() == {"+", "-", "*"}


def test_generation_is_seeded_and_the_cli_writes_the_files(tmp_path):
    from pipeline.cli import main

    sizes = dict(n_sft=300, n_train=300, n_test_per_digits=10, sft_max_digits=2, max_digits=3)
    assert multidigit_splits(seed=3, **sizes) == multidigit_splits(seed=3, **sizes)
    assert multidigit_splits(seed=3, **sizes) != multidigit_splits(seed=4, **sizes)
    assert main(["data", "make-multidigit", str(tmp_path / "d"), "--n-sft", "300", "--n-train", "300",
                 "--n-test-per-digits", "10", "--sft-max-digits", "2", "--max-digits", "3", "--seed", "3"]) == 0
    files = {}
    for name in ("sft", "train", "test"):
        with open(tmp_path / "d" / f"{name}.jsonl") as f:
            files[name] = [json.loads(line) for line in f]
    assert files == multidigit_splits(seed=3, **sizes)
    assert make_multidigit(str(tmp_path / "e"), seed=3, **sizes) == {"sft": 300, "train": 300, "test": 20}


def test_impossible_sizes_are_refused(capsys):
    from pipeline.cli import main

    with pytest.raises(ValueError, match="only 235 distinct problems of up to 1 digits"):
        multidigit_splits(n_sft=1000, n_train=10, n_test_per_digits=1, sft_max_digits=1, max_digits=2)
    assert main(["data", "make-multidigit", "/tmp/unused", "--sft-max-digits", "6"]) == 2
    assert "sft_max_digits (6) must be in 1..max_digits (4)" in capsys.readouterr().err


def test_final_answer_reward():
    response, label = multidigit_scratchpad(4821, "+", 395)
    assert resolve_reward("final_answer") is final_answer_reward is REGISTRY["final_answer"]
    assert final_answer_reward(response, label, {}) == 1.0
    assert final_answer_reward(response + "\n", label, {}) == 1.0  # whitespace around the answer is not an answer
    assert final_answer_reward("1+5+0=6 >5216", label, {}) == 1.0  # only the final answer is checked
    assert final_answer_reward(response.replace(">5216", ">5217"), label, {}) == 0.0
    assert final_answer_reward(response + "0", label, {}) == 0.0  # 52160: not an exact match
    assert final_answer_reward(response + " >1", label, {}) == 0.0  # the last ">" counts
    assert final_answer_reward("1+5+0=6 2+9+0=11 8+3+1=12 4+0+1=5 5216", label, {}) == 0.0  # no marker
    assert final_answer_reward("", label, {}) == 0.0
    assert final_answer_reward(">-4", "-4", {}) == 1.0


def test_char_100m_preset_and_the_recipe_fits_one_h200():
    from pipeline.config import load_config, memory
    from pipeline.models.config import model_preset
    from pipeline.models.tokenizer import TINY_CHARS, TINY_SPECIALS

    vocab = len(TINY_SPECIALS) + len(TINY_CHARS)
    args = model_preset("char-100m", vocab, None, 0, 0)
    assert args.vocab_size == vocab and 50e6 <= args.num_params() <= 200e6
    sft = load_config(os.path.join(REPO, "configs/multidigit-sft.yaml"))
    grpo = load_config(os.path.join(REPO, "configs/multidigit-grpo.yaml"), ["model.path=null", "model.init=char-100m"])
    assert sft.sft and sft.model.init == "char-100m" and grpo.determinism.true_on_policy and grpo.eval.interval > 0
    for cfg in (sft, grpo):
        est = memory.estimate(cfg, memory.local_placement(cfg, gpu_visible=True), 139.0)
        assert est.total / memory.GIB < 139 * 0.5, est.line()
