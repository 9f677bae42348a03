"""Packing stays under the token budget and loses no sample; ranks get balanced token counts."""

from __future__ import annotations

import random

import pytest

from pipeline.trainer.batching import balance_across_ranks, pack_micro_batches


@pytest.mark.parametrize("seed", range(5))
def test_packing_never_exceeds_budget_and_loses_nothing(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 200))]
    bins = pack_micro_batches(lengths, 512)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 512 for b in bins)
    assert len(bins) <= 2 * sum(lengths) / 512 + 1  # first-fit decreasing is within 2x of optimal


def test_packing_refuses_oversize():
    with pytest.raises(ValueError, match="exceeds max_tokens_per_gpu"):
        pack_micro_batches([10, 600], 512)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_balance_across_ranks(world):
    rng = random.Random(world)
    lengths = [rng.randint(5, 100) for _ in range(64)]
    parts = balance_across_ranks(lengths, world)
    assert sorted(i for p in parts for i in p) == list(range(64))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)
    assert parts == balance_across_ranks(lengths, world)  # deterministic
