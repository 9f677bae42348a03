"""A prefix cache keyed by token ids: the KV (and routing rows) of finished requests, reused by later ones.

When a request leaves the engine, the KV rows of its tokens (all but the last, which was never fed)
are copied out of its slot and kept under its token ids. A new request whose ids start with (part
of) a kept sequence gets those rows copied into its slot and prefills only the rest. So a
conversation's next turn (the previous turn's input + output + the environment's ids) recomputes only
the environment's tokens, and a group's samples share their prompt. A kept sequence that extends
another replaces it (a session keeps its latest turn); the least recently used go first when the
cache holds more than `max_tokens` tokens. Entries are flushed with new weights.

In true on-policy mode the reused rows are the rows a full prefill computes, bit for bit
(batch-invariant kernels: a position's keys and values do not depend on how many tokens were
prefilled with it), so logprobs with and without the cache are equal (tests/test_multiturn.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Entry:
    ids: np.ndarray  # [n] the tokens whose rows are kept
    rows: list[torch.Tensor]  # the cache's own per-tensor rows of those n positions (KVCache.read)
    routing: torch.Tensor | None  # [n, moe_layers, k] int16, or None if the request recorded none


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


class PrefixCache:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.tokens = 0
        self.next_key = 0
        self.stats = {"queried_tokens": 0, "hit_tokens": 0, "stored_tokens": 0}

    def match(self, ids: list[int], limit: int, need_routing: bool) -> tuple[int, Entry | None]:
        """The longest kept prefix of `ids` (at most `limit` tokens) and its entry; counts the lookup."""
        q = np.asarray(ids, dtype=np.int64)
        best, best_key = 0, None
        for key, e in self.entries.items():
            if need_routing and e.routing is None:
                continue
            n = min(common_prefix(e.ids, q), limit)
            if n > best:
                best, best_key = n, key
        self.stats["queried_tokens"] += len(ids)
        self.stats["hit_tokens"] += best
        if best_key is None:
            return 0, None
        self.entries.move_to_end(best_key)
        return best, self.entries[best_key]

    def insert(self, ids: list[int], rows: list[torch.Tensor], routing: torch.Tensor | None) -> None:
        n = len(ids)
        if n == 0 or n > self.max_tokens:
            return
        q = np.asarray(ids, dtype=np.int64)
        for key, e in list(self.entries.items()):
            c = common_prefix(e.ids, q)
            if c == n and len(e.ids) >= n and (e.routing is not None or routing is None):
                self.entries.move_to_end(key)  # already kept (as this or a longer sequence)
                return
            if c == len(e.ids):  # the new sequence extends a kept one: it replaces it
                self._drop(key)
        self.entries[self.next_key] = Entry(q, rows, routing)
        self.next_key += 1
        self.tokens += n
        self.stats["stored_tokens"] += n
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: int) -> None:
        self.tokens -= len(self.entries.pop(key).ids)

    def flush(self) -> None:
        self.entries.clear()
        self.tokens = 0

    @property
    def hit_rate(self) -> float:
        q = self.stats["queried_tokens"]
        return self.stats["hit_tokens"] / q if q else 0.0
