"""A prefix cache keyed by token ids: the KV (and routing rows) of finished requests, reused by later ones.

When a request leaves the engine, the KV rows of its tokens (all but the last, which was never fed)
are copied out of its slot and kept under its token ids. A new request whose ids start with (part
of) a kept sequence gets those rows copied into its slot and prefills only the rest. So a
conversation's next turn (the previous turn's input + output + the environment's ids) recomputes only
the environment's tokens, and a group's samples share their prompt. A kept sequence that extends
another replaces it (a session keeps its latest turn); the least recently used go first when the
cache holds more than `max_tokens` tokens. Entries are flushed with new weights. Lookups go through
rolling hashes of every prefix (O(length) per request, like walking a radix tree; a prefix shared by
several entries points at the latest of them).

In true on-policy mode the reused rows are the rows a full prefill computes, bit for bit
(batch-invariant kernels: a position's keys and values do not depend on how many tokens were
prefilled with it), so logprobs with and without the cache are equal (tests/test_multiturn.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class Entry:
    ids: list[int]  # the tokens whose rows are kept
    rows: list[torch.Tensor]  # the cache's own per-tensor rows of those positions (KVCache.read)
    routing: torch.Tensor | None  # [n, moe_layers, k] int16, or None if the request recorded none
    hashes: list[int]  # prefix_hashes(ids)


def prefix_hashes(ids: list[int]) -> list[int]:
    """h[j] identifies ids[:j+1] (a rolling hash: one pass, so a lookup costs O(len), not O(entries))."""
    out, h = [], 0
    for t in ids:
        h = hash((h, t))
        out.append(h)
    return out


class PrefixCache:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.index: dict[int, int] = {}  # prefix hash -> the entry that last kept that prefix
        self.whole: dict[int, int] = {}  # hash of an entry's whole sequence -> the entry
        self.tokens = 0
        self.next_key = 0
        self.stats = {"queried_tokens": 0, "hit_tokens": 0, "stored_tokens": 0}

    def match(self, ids: list[int], limit: int, need_routing: bool) -> tuple[int, Entry | None]:
        """The longest kept prefix of `ids` (at most `limit` tokens) and its entry; counts the lookup."""
        self.stats["queried_tokens"] += len(ids)
        hs = prefix_hashes(ids[:limit])
        for j in range(len(hs) - 1, -1, -1):
            key = self.index.get(hs[j])
            if key is None:
                continue
            e = self.entries[key]
            if (need_routing and e.routing is None) or e.ids[:j + 1] != list(ids[:j + 1]):
                continue  # no routing rows kept / a hash collision
            self.entries.move_to_end(key)
            self.stats["hit_tokens"] += j + 1
            return j + 1, e
        return 0, None

    def insert(self, ids: list[int], rows: list[torch.Tensor], routing: torch.Tensor | None) -> None:
        n = len(ids)
        if n == 0 or n > self.max_tokens:
            return
        hs = prefix_hashes(ids)
        kept = self.index.get(hs[-1])
        if kept is not None and (self.entries[kept].routing is not None or routing is None):
            self.entries.move_to_end(kept)  # already kept (as this or a longer sequence)
            return
        for h in hs:  # a kept sequence this one extends is replaced by it
            key = self.whole.get(h)
            if key is not None:
                self._drop(key)
        key, self.next_key = self.next_key, self.next_key + 1
        self.entries[key] = Entry(list(ids), rows, routing, hs)
        for h in hs:
            self.index[h] = key
        self.whole[hs[-1]] = key
        self.tokens += n
        self.stats["stored_tokens"] += n
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: int) -> None:
        e = self.entries.pop(key)
        self.tokens -= len(e.ids)
        for h in e.hashes:
            if self.index.get(h) == key:
                del self.index[h]
        if self.whole.get(e.hashes[-1]) == key:
            del self.whole[e.hashes[-1]]

    def flush(self) -> None:
        self.entries.clear()
        self.index.clear()
        self.whole.clear()
        self.tokens = 0

    @property
    def hit_rate(self) -> float:
        q = self.stats["queried_tokens"]
        return self.stats["hit_tokens"] / q if q else 0.0
