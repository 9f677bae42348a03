"""What the in-job driver does about a failed component: restart it in place, move it to a spare node,
requeue the job without the node it failed on, or give up. Pure: the driver feeds it failures, the
tests feed it stories.

  engine_<i>         restarted in place up to engine.max_restarts times (per job attempt)
  trainer, rollout   restarted in place up to slurm.max_restarts times (the trainer from its last
                     checkpoint; the rollout manager after its last committed step)
  a node gone bad    (down, or a second failure on it across attempts): the step moves to a spare node
                     of its component when one is left (slurm.<component>.spare_nodes); else, like a
                     component out of restarts: requeue the job (up to slurm.max_requeues times)
                     excluding the nodes that failed; after the last attempt: give up.
  a user error       (the component exited with USER_ERROR_EXIT: a checkpoint that does not match its
                     config, ...): give up at once, naming it; a restart, a spare or a requeue would
                     fail the same way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum


class Action(str, Enum):
    RESTART = "restart"
    MOVE = "move"  # restart on a spare node of the step's component
    REQUEUE = "requeue"
    FAIL = "fail"


@dataclass(frozen=True)
class Failure:
    step: str  # the job step: trainer | rollout | engine_<i>
    node: str | None  # where it happened, when known
    reason: str  # "exit status 137", "no heartbeat for 63 s", "node failure", ...
    node_down: bool = False  # Slurm took the node away (srun: "Node failure on n2")
    user_error: bool = False  # it died of a UserError (component.USER_ERROR_EXIT): deterministic


def component_of(step: str) -> str:
    """The component (het group, or paired job) a step runs in."""
    return "trainer" if step == "trainer" else "rollout"


@dataclass
class SparePool:
    """One component's nodes: the first `needed` run its steps, the rest are spares. A bad node's steps
    move to one spare (all of them: engines that shared the node share its replacement)."""

    nodes: list[str]
    needed: int
    bad: set = field(default_factory=set)
    replacement: dict = field(default_factory=dict)  # bad node -> the spare its steps moved to

    def replace(self, node: str) -> str | None:
        """Mark `node` bad; the node its steps move to (None: no spare left)."""
        self.bad.add(node)
        if node in self.replacement and self.replacement[node] not in self.bad:
            return self.replacement[node]
        taken = set(self.replacement.values()) | self.bad
        free = [n for n in self.nodes[self.needed:] if n not in taken]
        if not free:
            return None
        self.replacement[node] = free[0]
        # a spare that went bad hands its steps on, so follow the chain from every node that used it
        for old, new in self.replacement.items():
            if new == node:
                self.replacement[old] = free[0]
        return free[0]

    def where(self, node: str) -> str:
        """Where a step placed on `node` runs now."""
        return self.replacement.get(node, node)


@dataclass
class RecoveryPolicy:
    engine_restarts: int
    restarts: int
    attempt: int  # this job attempt, from 1
    max_attempts: int  # 1 + slurm.max_requeues
    node_failures: Counter = field(default_factory=Counter)  # node -> failures so far, earlier attempts included
    used: Counter = field(default_factory=Counter)  # step -> restarts used in this attempt
    pools: dict = field(default_factory=dict)  # component -> SparePool (components with spare nodes)

    def limit(self, step: str) -> int:
        return self.engine_restarts if step.startswith("engine") else self.restarts

    def decide(self, f: Failure) -> tuple[Action, str]:
        """The action, and why (one phrase for the event log and the user)."""
        if f.user_error:
            return Action.FAIL, f"{f.step} failed on a user error: starting it again would fail the same way"
        if f.node:
            self.node_failures[f.node] += 1
        bad = f.node and (f.node_down or self.node_failures[f.node] >= 2)
        if bad:
            why = f"node {f.node} down" if f.node_down else f"second failure on node {f.node}"
            pool = self.pools.get(component_of(f.step))
            spare = pool.replace(f.node) if pool is not None else None
            if spare is not None:
                return Action.MOVE, f"{why}: to spare node {spare}"
            if pool is not None:
                why += ", no spare node left"
        elif self.used[f.step] < self.limit(f.step):
            self.used[f.step] += 1
            return Action.RESTART, f"restart {self.used[f.step]}/{self.limit(f.step)}"
        else:
            why = f"{f.step} is out of restarts ({self.limit(f.step)})"
        if self.attempt < self.max_attempts:
            return Action.REQUEUE, why
        return Action.FAIL, f"{why}, and attempt {self.attempt}/{self.max_attempts} was the last"

    def exclude(self, f: Failure) -> list[str]:
        """Nodes the requeued job should not get: this failure's, every node that failed twice, and the
        nodes its steps were moved off."""
        bad = {n for n, k in self.node_failures.items() if k >= 2}.union(*(p.bad for p in self.pools.values()))
        return sorted(bad | ({f.node} if f.node else set()))


def safe_exclusions(exclude: list[str], partition_nodes: int, needed_nodes: int) -> list[str]:
    """The first exclusions that still leave the job enough nodes to start; [] when the partition size
    is unknown (0)."""
    room = partition_nodes - needed_nodes
    return exclude[:max(room, 0)] if partition_nodes else []
