"""Talking to Slurm about one job: its state (sacct, squeue), requeueing it without some nodes.

The parsing is pure (tested on sacct's own output); the calls are thin wrappers around the Slurm
commands. A heterogeneous job is one job id with components `ID+0`, `ID+1`, ...: sacct lists each.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time

log = logging.getLogger("lockstep.slurm")

ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING", "RESIZING",
          "SUSPENDED", "STAGE_OUT", "SIGNALING", "RESV_DEL_HOLD", "PREEMPTED"}
"""States of a job that is not over (PREEMPTED: a requeue follows with --requeue)."""


def parse_states(sacct_out: str) -> dict[str, str]:
    """`sacct -X -n -o JobID,State --parsable2` (latest record of each id) -> component id -> state word."""
    states = {}
    for line in sacct_out.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 2 and parts[0] and "." not in parts[0]:
            states[parts[0]] = parts[1].split()[0]  # "CANCELLED by 0" -> CANCELLED
    return states


def job_state(states: dict[str, str]) -> str:
    """One state for a (heterogeneous) job: active while any component is; else the first bad one,
    else COMPLETED."""
    words = list(states.values())
    if not words:
        return "UNKNOWN"
    for w in words:
        if w in ACTIVE:
            return "RUNNING" if w == "RUNNING" or "RUNNING" in words else w
    bad = [w for w in words if w != "COMPLETED"]
    return bad[0] if bad else "COMPLETED"


def parse_node_events(sacctmgr_out: str) -> list[dict]:
    """`sacctmgr -n -P show event nodes=... start=... format=NodeName,TimeStart,State,Reason`: the nodes
    that went down (or failed, or were drained) and why, as {node, start, state, reason}."""
    rows = []
    for line in sacctmgr_out.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 4 and parts[0]:
            rows.append({"node": parts[0], "start": parts[1], "state": parts[2], "reason": parts[3]})
    return rows


def _run(cmd: list[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)


def states(job_id: str) -> dict[str, str]:
    """Component id -> state of the job's latest attempt ({} while sacct does not know it yet)."""
    res = _run(["sacct", "-X", "-n", "-j", job_id, "-o", "JobID,State", "--parsable2"])
    return parse_states(res.stdout) if res.returncode == 0 else {}


def node_events(nodes: list[str], since: float) -> list[dict]:
    """Node state events (DOWN, FAIL, DRAIN: slurmctld records them in the accounting database) of
    `nodes` since the epoch time `since`."""
    if not nodes:
        return []
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since))
    res = _run(["sacctmgr", "-n", "-P", "show", "event", f"nodes={','.join(nodes)}", f"start={start}",
                "format=NodeName,TimeStart,State,Reason"])
    return parse_node_events(res.stdout) if res.returncode == 0 else []


def queued(job_id: str) -> bool:
    """The job is in the controller's queue (pending, running, completing, being requeued)."""
    res = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
    return res.returncode == 0 and bool(res.stdout.strip())


def expand_nodes(nodelist: str) -> list[str]:
    if not nodelist or nodelist in ("None assigned", "(null)"):
        return []
    res = _run(["scontrol", "show", "hostnames", nodelist])
    return res.stdout.split() if res.returncode == 0 else [nodelist]


def _ignore_term() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def requeue(job_id: str, components: list[str], exclude: list[str]) -> None:
    """Requeue the (running) job, then exclude `exclude` from every component of its next attempt.

    Called by the job's own driver: Slurm signals the whole job at once, so the commands ignore
    SIGTERM (the exclusion must land while the job is pending again)."""
    cmds = [["scontrol", "requeue", job_id]]
    if exclude:
        cmds += [["scontrol", "update", f"JobId={c}", f"ExcNodeList={','.join(sorted(exclude))}"] for c in components]
    for cmd in cmds:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30, preexec_fn=_ignore_term)
        if res.returncode != 0:
            log.warning("%s: %s", " ".join(cmd), (res.stderr or res.stdout).strip())


def torn(states: dict[str, str]) -> bool:
    """A heterogeneous job Slurm requeued only in part: after a node failure it requeues the component
    on the failed node and lets the others end, so the job never starts again."""
    words = list(states.values())
    return len(words) > 1 and any(w in ("PENDING", "REQUEUED") for w in words) and \
        any(w not in ACTIVE for w in words)


def requeue_whole(job_id: str) -> None:
    """Requeue the ended components of a torn heterogeneous job (the leader's requeue does that; it
    answers an error for the pending leader itself)."""
    _run(["scontrol", "requeue", job_id])
