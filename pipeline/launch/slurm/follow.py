"""`lockstep submit --wait`: follow a job to its end, across restarts in place and requeues.

Slurm says whether the job is still queued or running (squeue, sacct); the run directory's event log
(run_dir/events.jsonl, written by the in-job driver) says what happened inside: each attempt's start
and the step it resumes from, failures with their node and what was done about them, the end. A
requeue is news, not an error: the follower prints a line and keeps following. It returns when
Slurm has no more plans for the job, with the job's final state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from pipeline.launch.slurm import jobctl
from pipeline.run import RunDir


@dataclass(frozen=True)
class Outcome:
    ok: bool
    states: dict[str, str]  # job id -> final state
    message: str  # one line: what happened in the end


def describe(e: dict) -> str | None:
    """One line for the user per event of the log (None: nothing worth a line)."""
    kind, job = e.get("event"), e.get("job")
    where = f" on {e['node']}" if e.get("node") else ""
    if kind == "start" and e.get("attempt", 1) > 1:
        return (f"job {job} requeued (attempt {e['attempt']}/{e.get('max_attempts', '?')}),"
                f" resuming from step {e.get('resume_step', 0)}")
    if kind == "failure":
        head = f"{e['component']} failed{where} ({e['reason']})"
        if e.get("component") == "node":
            return f"node {e['node']} failed ({e['reason']}) during attempt {e['attempt']}; Slurm requeued the job"
        if e["action"] == "restart":
            resume = f", resuming from step {e['resume_step']}" if e.get("resume_step") is not None else ""
            return f"{head}: restarted in place ({e['why']}){resume}"
        if e["action"] == "move":
            resume = f", resuming from step {e['resume_step']}" if e.get("resume_step") is not None else ""
            return f"{head}: restarted on spare node {e['to']} ({e['why']}){resume}"
        if e["action"] == "requeue":
            return f"{head}: requeueing the job ({e['why']})"
        return f"{head}: giving up ({e['why']})"
    if kind == "requeue":
        return f"job {job} put back in the queue" + (f" without {', '.join(e['exclude'])}" if e.get("exclude") else "")
    if kind == "preempted":
        return f"job {job} signalled (pre-emption or time limit): checkpointed at step {e.get('checkpoint')}, requeued"
    if kind == "interrupted":
        return f"job {job} attempt {e['attempt']} ended by Slurm (requeue, cancel or node failure)"
    return None


def job_over(job_id: str) -> tuple[bool, str, bool]:
    """(Slurm has no more plans for the job, its state, the job is a torn heterogeneous one)."""
    states = jobctl.states(job_id)
    state = jobctl.job_state(states)
    if jobctl.queued(job_id):
        return False, state, jobctl.torn(states)
    return state not in jobctl.ACTIVE and state != "UNKNOWN", state, False


def follow(job_ids: list[str], rundir: RunDir, say: Callable[[str], None], since: int = 0,
           tick: Callable[[str], None] | None = None, poll_s: float = 2.0) -> Outcome:
    """Follow the jobs until Slurm is done with them all (seen twice in a row: a requeue passes
    through states that look final for a moment). `since`: events already in the log before this
    submission (not news)."""
    seen, settled = since, 0
    states: dict[str, str] = {}
    torn: dict[str, int] = {}
    while settled < 2:
        seen = _news(rundir, seen, say)
        over = {}
        for j in job_ids:
            over[j], states[j], is_torn = job_over(j)
            torn[j] = torn.get(j, 0) + 1 if is_torn else 0
            if torn[j] == 3:  # seen for a few polls: not a requeue in passing
                say(f"Slurm requeued only part of heterogeneous job {j} after a node failure; requeueing the rest")
                jobctl.requeue_whole(j)
        if tick:
            tick(", ".join(f"job {j} {s}" for j, s in states.items()))
        settled = settled + 1 if all(over.values()) else 0
        if settled < 2:
            time.sleep(poll_s)
    _news(rundir, seen, say)
    ends = [e for e in rundir.read_events()[since:] if e.get("event") == "end"]
    ok = all(s == "COMPLETED" for s in states.values()) and bool(ends) and ends[-1]["status"] == "completed"
    if ok:
        return Outcome(True, states, ", ".join(f"job {j} COMPLETED" for j in job_ids))
    failures = [e for e in rundir.read_events()[since:] if e.get("event") == "failure"]
    why = ends[-1].get("reason") if ends and ends[-1].get("reason") else (describe(failures[-1]) if failures else "")
    summary = ", ".join(f"job {j} ended {s}" for j, s in states.items())
    return Outcome(False, states, summary + (f": {why}" if why else ""))


def _news(rundir: RunDir, seen: int, say: Callable[[str], None]) -> int:
    events = rundir.read_events()
    for e in events[seen:]:
        line = describe(e)
        if line:
            say(line)
    return max(seen, len(events))
