"""How long each fault costs on the local Slurm cluster: one hetjob run, one fault at a time.

  SLURM_CONF=... python bench/fault_recovery.py [--steps 70] [--faults a,b] [--out bench/results/fault_recovery_cpu.json]

Submits configs/tiny-slurm-local.yaml (checkpoint every 4 steps, faults.heartbeat_timeout_s=10), then,
each time the run is up and 3 steps past the previous recovery: kills the engine, kills the trainer
rank, stops the engine (SIGSTOP: a hang), signals USR2 (pre-emption), `scontrol requeue`s the job, and
takes the trainer's node down. Per fault: seconds until the driver noticed (its event), until the run
logged a step past the one it was at (the recovery as a user sees it), and the steps redone.
Needs the local cluster (slurm/local/cluster.sh start) and root (scontrol update).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from pipeline.observability.metrics import read_metrics  # noqa: E402
from pipeline.run import RunDir  # noqa: E402

FAULTS = ["engine_killed", "trainer_rank_killed", "engine_hung", "preempted", "admin_requeue", "node_down"]


def up(rundir: RunDir) -> dict | None:
    """The current attempt's start event once every component beats."""
    return rundir.running_attempt(("engine_0", "trainer_0", "rollout"), fresh_s=4)


def wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise TimeoutError(what)


def inject(fault: str, rundir: RunDir, job: str) -> str | None:
    beats = rundir.heartbeats()
    if fault == "engine_killed":
        os.kill(beats["engine_0"]["pid"], signal.SIGKILL)
    elif fault == "trainer_rank_killed":
        os.kill(beats["trainer_0"]["pid"], signal.SIGKILL)
    elif fault == "engine_hung":
        os.kill(beats["engine_0"]["pid"], signal.SIGSTOP)
    elif fault == "preempted":
        subprocess.run(["scancel", "-s", "USR2", "-b", job], check=True)
    elif fault == "admin_requeue":
        subprocess.run(["scontrol", "requeue", job], check=True)
    else:
        node = beats["trainer_0"]["node"]
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=bench"], check=True)
        return node
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=70)
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, in order (default: {','.join(FAULTS)})")
    p.add_argument("--run-dir", default="/tmp/lockstep-fault-recovery")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "fault_recovery_cpu.json"))
    args = p.parse_args()
    subprocess.run(["rm", "-rf", args.run_dir], check=True)
    rundir = RunDir(args.run_dir)
    cmd = [sys.executable, "-m", "pipeline.cli", "submit", "configs/tiny-slurm-local.yaml", "logging.progress=false",
           f"run_dir={args.run_dir}", f"num_rollout={args.steps}", "checkpoint.save_interval=4",
           "determinism.true_on_policy=true", "faults.heartbeat_interval_s=1", "faults.heartbeat_timeout_s=10", "--wait"]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    rows, mark, downed = [], 3, None
    try:
        for fault in args.faults.split(","):
            start = wait(lambda: len(read_metrics(args.run_dir)) >= mark and up(rundir), 600, f"run up before {fault}")
            n_events = len(rundir.read_events())
            before = len(read_metrics(args.run_dir))
            t0 = time.time()
            downed = inject(fault, rundir, start["job"]) or downed
            noticed = wait(lambda: [e for e in rundir.read_events()[n_events:]
                                    if e["event"] in ("failure", "preempted", "interrupted")], 600, f"{fault} noticed")
            if fault == "node_down":
                wait(lambda: (up(rundir) or {}).get("attempt", 0) > start["attempt"], 600, "requeued after node down")
                subprocess.run(["scontrol", "update", f"nodename={downed}", "state=resume"], capture_output=True)
            if noticed[0].get("action") != "restart" or fault == "trainer_rank_killed":  # it starts again
                wait(lambda: [e for e in rundir.read_events()[n_events:] if e["event"] == "start"
                              or e.get("resume_step") is not None], 600, "restarted")
            restarted = [e for e in rundir.read_events()[n_events:] if e["event"] == "start" or e.get("resume_step")]
            # past the step it was at (a pre-empted trainer finishes its step first: then one more)
            target = before + (1 if fault == "preempted" else 0)
            wait(lambda: len(read_metrics(args.run_dir)) > target and
                 (not restarted or up(rundir)), 900, f"past step {target} after {fault}")
            back = time.time() - t0
            resume_step = next((e.get("resume_step") for e in restarted if e.get("resume_step") is not None), None)
            rows.append({"fault": fault, "at_step": before, "noticed_s": round(noticed[0]["time"] - t0, 1),
                         "recovered_s": round(back, 1), "resumed_from": resume_step,
                         "steps_redone": before - resume_step if resume_step is not None else 0,
                         "how": noticed[0].get("action") or noticed[0]["event"]})
            print(json.dumps(rows[-1]), flush=True)
            mark = len(read_metrics(args.run_dir)) + 3
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
        if downed:
            subprocess.run(["scontrol", "update", f"nodename={downed}", "state=resume"], capture_output=True)
    step_s = sorted(r["perf/step_time_s"] for r in read_metrics(args.run_dir))[len(read_metrics(args.run_dir)) // 2]
    result = {"faults": rows, "exit_status": proc.returncode, "steps": len(read_metrics(args.run_dir)),
              "median_step_s": round(step_s, 2), "load_average": os.getloadavg(), "command": " ".join(cmd[1:])}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("\n| fault | noticed after s | recovered after s | steps redone | how |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['fault']} | {r['noticed_s']} | {r['recovered_s']} | {r['steps_redone']} | {r['how']} |")
    print(f"exit status {proc.returncode}; median step {step_s:.2f} s; load average {os.getloadavg()[0]:.1f};"
          f" {err.strip().splitlines()[-1] if err.strip() else ''}")


if __name__ == "__main__":
    main()
