"""What the in-job driver does about a failed component: restart it in place, requeue the job without
the node it failed on, or give up. Pure: the driver feeds it failures, the tests feed it stories.

  engine_<i>         restarted in place up to engine.max_restarts times (per job attempt)
  trainer, rollout   restarted in place up to slurm.max_restarts times (the trainer from its last
                     checkpoint; the rollout manager after its last committed step)
  a second failure on one node (across attempts), or a component out of restarts: requeue the job
  (up to slurm.max_requeues times) excluding the nodes that failed; after the last attempt: give up.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum


class Action(str, Enum):
    RESTART = "restart"
    REQUEUE = "requeue"
    FAIL = "fail"


@dataclass(frozen=True)
class Failure:
    step: str  # the job step: trainer | rollout | engine_<i>
    node: str | None  # where it happened, when known
    reason: str  # "exit status 137", "no heartbeat for 63 s", ...


@dataclass
class RecoveryPolicy:
    engine_restarts: int
    restarts: int
    attempt: int  # this job attempt, from 1
    max_attempts: int  # 1 + slurm.max_requeues
    node_failures: Counter = field(default_factory=Counter)  # node -> failures so far, earlier attempts included
    used: Counter = field(default_factory=Counter)  # step -> restarts used in this attempt

    def limit(self, step: str) -> int:
        return self.engine_restarts if step.startswith("engine") else self.restarts

    def decide(self, f: Failure) -> tuple[Action, str]:
        """The action, and why (one phrase for the event log and the user)."""
        if f.node:
            self.node_failures[f.node] += 1
        if f.node and self.node_failures[f.node] >= 2:
            why = f"second failure on node {f.node}"
        elif self.used[f.step] < self.limit(f.step):
            self.used[f.step] += 1
            return Action.RESTART, f"restart {self.used[f.step]}/{self.limit(f.step)}"
        else:
            why = f"{f.step} is out of restarts ({self.limit(f.step)})"
        if self.attempt < self.max_attempts:
            return Action.REQUEUE, why
        return Action.FAIL, f"{why}, and attempt {self.attempt}/{self.max_attempts} was the last"

    def exclude(self, f: Failure) -> list[str]:
        """Nodes the requeued job should not get: this failure's, and every node that failed twice."""
        bad = {n for n, k in self.node_failures.items() if k >= 2}
        return sorted(bad | ({f.node} if f.node else set()))


def safe_exclusions(exclude: list[str], partition_nodes: int, needed_nodes: int) -> list[str]:
    """The first exclusions that still leave the job enough nodes to start; [] when the partition size
    is unknown (0)."""
    room = partition_nodes - needed_nodes
    return exclude[:max(room, 0)] if partition_nodes else []
