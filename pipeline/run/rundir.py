"""The run directory: the API between Lockstep's processes (what Ray's actors are in slime).

Everything a run is lives in one directory on the shared filesystem, and every process finds the
others through it. `RunDir` owns every name in it; nothing else joins a path inside a run directory.

  config.yaml                  the resolved config: the launcher writes it, every component reads it
  .token                       the run's shared secret for engine requests (mode 600)
  model_init/                  the starting model when model.path is unset (written once by prepare)
  logs/<component>.log         each process's output (logs/slurm-<job>.out: the batch script's)
  buffer/                      rollouts, HDF5 shards per step (pipeline/buffer owns what is inside)
  checkpoints/                 trainer checkpoints (pipeline/trainer/checkpoint.py owns what is inside)
  hf/                          the trained model in Hugging Face format
  metrics.jsonl, reward.png    one record per step; the reward curve
  tensorboard/, wandb/         the experiment trackers' files (logging.tensorboard, logging.wandb)
  eval/step_K/<name>.jsonl     per-sample results of evaluating weights version K on eval set <name>
  eval/step_K/summary.json     {metrics, weight_version}: published last, so its presence means done
  eval/hf/                     `lockstep eval RUN_DIR` on the exported hf/ model (same files)
  startup/<component>.json     start-up phases (pipeline/observability/startup.py: the record's format)
  slurm/                       batch scripts of `submit --dry-run`, submitit's job folder
  rendezvous/engine_<i>.json   {url, host, port, pid}        each engine, once it serves
  rendezvous/trainer.json      {master_addr, master_port}    trainer rank 0's process group
  rendezvous/weights.json      {master_address, master_port, world_size, backend}  the weight group
  control/version.json         {weight_version}   the engines hold it; rollout step k may start
                                                  once it is >= k - staleness
  control/STOP                 the run is over; the rollout side exits
  control/CHECKPOINT           checkpoint at the next step boundary and exit (pre-emption); the
                               trainer answers with control/CHECKPOINT_DONE {step}
  control/FAILED               {component, returncode, job}: a job failed (paired jobs tell each other)
  heartbeat/<component>.json   {component, node, pid, beat}: rewritten every faults.heartbeat_interval_s
                               by each process; one older than faults.heartbeat_timeout_s is hung
  events.jsonl                 the run's history across job attempts (append-only): starts, restarts
                               in place, failures with their node, requeues, the end (lockstep status)

Control and rendezvous files are published atomically (pipeline/run/files.py), so a reader sees all
of one or nothing.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from pipeline.run.files import publish, read_json, wait_for

if TYPE_CHECKING:
    from pipeline.config.schema import RunConfig

ENGINE_PREFIX = "engine_"


@dataclass(frozen=True)
class EvalDir:
    """One evaluation's files: eval/step_K/ or eval/hf/ in a run directory, or `lockstep eval --out`."""

    root: str

    def samples(self, name: str) -> str:
        """Per-sample results of eval set `name`, one JSON object per line."""
        return os.path.join(self.root, f"{name}.jsonl")

    @property
    def summary_file(self) -> str:
        """{metrics, weight_version, ...}: published after the sample files, so it marks a complete evaluation."""
        return os.path.join(self.root, "summary.json")

    def publish_summary(self, summary: dict) -> None:
        publish(self.summary_file, summary)

    def summary(self) -> dict | None:
        return read_json(self.summary_file) if os.path.exists(self.summary_file) else None


@dataclass(frozen=True)
class RunDir:
    root: str

    def __post_init__(self):
        object.__setattr__(self, "root", os.fspath(self.root))  # a pathlib.Path is welcome too

    # ---- what the launcher writes before anything starts ------------------------------------------
    @property
    def config(self) -> str:
        """The resolved config every component reads (pipeline.config.load_resolved)."""
        return os.path.join(self.root, "config.yaml")

    @property
    def token_file(self) -> str:
        return os.path.join(self.root, ".token")

    def token(self) -> str | None:
        """The run's shared secret (engines reject HTTP requests without it); None before there is one."""
        if not os.path.exists(self.token_file):
            return None
        with open(self.token_file) as f:
            return f.read().strip()

    def create_token(self) -> str:
        """The token, made on first use (mode 600: only the run's user can read it)."""
        if not os.path.exists(self.token_file):
            fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(16))
        return self.token()

    @property
    def model_init(self) -> str:
        return os.path.join(self.root, "model_init")

    @property
    def model_init_tokenizer(self) -> str:
        """Scratch directory of the tokenizer while model_init is written (removed afterwards)."""
        return self.model_init + ".tokenizer"

    def model_dir(self, cfg: RunConfig) -> str:
        """The HF directory every component loads its starting weights and tokenizer from."""
        return cfg.model.path or self.model_init

    # ---- what the components write -----------------------------------------------------------------
    @property
    def logs(self) -> str:
        return os.path.join(self.root, "logs")

    def log_file(self, component: str) -> str:
        """`component` may carry srun's patterns (trainer_%t)."""
        return os.path.join(self.logs, f"{component}.log")

    @property
    def slurm_output(self) -> str:
        """The batch script's own output (%j: the job id)."""
        return os.path.join(self.logs, "slurm-%j.out")

    def log_files(self) -> list[str]:
        """Every file under logs/, sorted."""
        if not os.path.isdir(self.logs):
            return []
        return [os.path.join(self.logs, n) for n in sorted(os.listdir(self.logs))]

    @property
    def buffer(self) -> str:
        return os.path.join(self.root, "buffer")

    @property
    def checkpoints(self) -> str:
        return os.path.join(self.root, "checkpoints")

    @property
    def hf_export(self) -> str:
        return os.path.join(self.root, "hf")

    @property
    def metrics(self) -> str:
        return os.path.join(self.root, "metrics.jsonl")

    @property
    def tensorboard(self) -> str:
        """TensorBoard event files (pipeline/observability/tensorboard_sink.py)."""
        return os.path.join(self.root, "tensorboard")

    @property
    def wandb(self) -> str:
        """The W&B run: lockstep_run.json and offline-run-*/ (pipeline/observability/wandb_sink.py)."""
        return os.path.join(self.root, "wandb")

    @property
    def reward_plot(self) -> str:
        return os.path.join(self.root, "reward.png")

    # ---- evaluation (pipeline/rollout/evaluation.py writes; the trainer and the summary read) -------
    @property
    def eval_dir(self) -> str:
        return os.path.join(self.root, "eval")

    def eval_step(self, step: int) -> EvalDir:
        """The evaluation of weights version `step` (before step `step`, or after the last)."""
        return EvalDir(os.path.join(self.eval_dir, f"step_{step}"))

    @property
    def eval_hf(self) -> EvalDir:
        """`lockstep eval RUN_DIR`: the exported model (hf/) evaluated on its own."""
        return EvalDir(os.path.join(self.eval_dir, "hf"))

    def eval_steps(self) -> list[int]:
        """Steps whose evaluation is complete (summary published), ascending."""
        if not os.path.isdir(self.eval_dir):
            return []
        steps = [int(n[5:]) for n in os.listdir(self.eval_dir) if n.startswith("step_") and n[5:].isdigit()]
        return sorted(s for s in steps if os.path.exists(self.eval_step(s).summary_file))

    def wait_eval(self, step: int, timeout_s: float, alive: Callable[[], None] | None = None) -> dict:
        return wait_for(self.eval_step(step).summary_file, timeout_s, alive)

    @property
    def startup_dir(self) -> str:
        return os.path.join(self.root, "startup")

    def startup_file(self, component: str) -> str:
        return os.path.join(self.startup_dir, f"{component}.json")

    def startup_files(self) -> dict[str, str]:
        """component -> its published start-up record."""
        if not os.path.isdir(self.startup_dir):
            return {}
        return {n[:-5]: self.startup_file(n[:-5]) for n in sorted(os.listdir(self.startup_dir))
                if n.endswith(".json") and not n.startswith(".")}

    @property
    def slurm_dir(self) -> str:
        return os.path.join(self.root, "slurm")

    def sbatch_file(self, name: str) -> str:
        return os.path.join(self.slurm_dir, f"{name}.sbatch")

    # ---- rendezvous: who listens where --------------------------------------------------------------
    @property
    def rendezvous_dir(self) -> str:
        return os.path.join(self.root, "rendezvous")

    def engine_file(self, index: int) -> str:
        return os.path.join(self.rendezvous_dir, f"{ENGINE_PREFIX}{index}.json")

    @property
    def trainer_file(self) -> str:
        return os.path.join(self.rendezvous_dir, "trainer.json")

    @property
    def weights_file(self) -> str:
        return os.path.join(self.rendezvous_dir, "weights.json")

    def publish_engine(self, index: int, info: dict) -> None:
        """An engine serves: {url, host, port, pid, ...}."""
        publish(self.engine_file(index), info)

    def engine_urls(self, num_engines: int, timeout_s: float = 600.0,
                    alive: Callable[[], None] | None = None) -> list[str]:
        """Every engine's URL, waiting until each has published one."""
        return [wait_for(self.engine_file(i), timeout_s, alive)["url"] for i in range(num_engines)]

    def current_engine_urls(self, num_engines: int) -> list[str]:
        """The URLs engines have published so far (without waiting): a restarted engine's new one included."""
        return [read_json(p)["url"] for p in map(self.engine_file, range(num_engines)) if os.path.exists(p)]

    def publish_trainer(self, info: dict) -> None:
        """Trainer rank 0's process-group address {master_addr, master_port, ...}."""
        publish(self.trainer_file, info)

    def wait_trainer(self, timeout_s: float) -> dict:
        return wait_for(self.trainer_file, timeout_s)

    # ---- control: what the run should do next --------------------------------------------------------
    @property
    def control_dir(self) -> str:
        return os.path.join(self.root, "control")

    @property
    def version_file(self) -> str:
        return os.path.join(self.control_dir, "version.json")

    @property
    def stop_file(self) -> str:
        return os.path.join(self.control_dir, "STOP")

    @property
    def checkpoint_request_file(self) -> str:
        return os.path.join(self.control_dir, "CHECKPOINT")

    @property
    def checkpoint_done_file(self) -> str:
        return os.path.join(self.control_dir, "CHECKPOINT_DONE")

    @property
    def failed_file(self) -> str:
        return os.path.join(self.control_dir, "FAILED")

    def publish_version(self, version: int) -> None:
        """Trainer rank 0, after every weight sync: the engines now serve `version`."""
        publish(self.version_file, {"weight_version": version})

    def current_version(self) -> int:
        return int(read_json(self.version_file)["weight_version"]) if os.path.exists(self.version_file) else 0

    def wait_version(self, at_least: int, poll_s: float = 0.02) -> int | None:
        """Block until the published weight version is >= at_least (returns it) or the run stops (None)."""
        while True:
            if os.path.exists(self.version_file):
                v = int(read_json(self.version_file)["weight_version"])
                if v >= at_least:
                    return v
            if self.stop_requested():
                return None
            time.sleep(poll_s)

    def request_stop(self, reason: str = "done") -> None:
        publish(self.stop_file, {"reason": reason})

    def stop_requested(self) -> bool:
        return os.path.exists(self.stop_file)

    def request_checkpoint(self, reason: str) -> None:
        """Ask the trainer to checkpoint at its next safe point and exit (pre-emption, time limit)."""
        publish(self.checkpoint_request_file, {"reason": reason})

    def checkpoint_requested(self) -> bool:
        return os.path.exists(self.checkpoint_request_file)

    def publish_checkpoint_done(self, step: int) -> None:
        publish(self.checkpoint_done_file, {"step": step})

    def checkpoint_done(self) -> bool:
        return os.path.exists(self.checkpoint_done_file)

    def wait_checkpoint_done(self, timeout_s: float) -> dict:
        return wait_for(self.checkpoint_done_file, timeout_s)

    def publish_failure(self, info: dict) -> None:
        """{component, returncode, job}; the first failure stays (later ones are its consequences)."""
        if not os.path.exists(self.failed_file):
            publish(self.failed_file, info)

    def failure(self) -> dict | None:
        return read_json(self.failed_file) if os.path.exists(self.failed_file) else None

    # ---- liveness and history: heartbeats, the event log --------------------------------------------
    @property
    def heartbeat_dir(self) -> str:
        return os.path.join(self.root, "heartbeat")

    def heartbeat_file(self, component: str) -> str:
        return os.path.join(self.heartbeat_dir, f"{component}.json")

    def heartbeats(self) -> dict[str, dict]:
        """component -> its last heartbeat record."""
        if not os.path.isdir(self.heartbeat_dir):
            return {}
        out = {}
        for name in sorted(os.listdir(self.heartbeat_dir)):
            if name.endswith(".json") and not name.startswith("."):
                try:
                    out[name[:-5]] = read_json(os.path.join(self.heartbeat_dir, name))
                except (FileNotFoundError, ValueError):  # removed or replaced between listdir and read
                    pass
        return out

    def clear_heartbeats(self, component: str | None = None) -> None:
        """Forget the heartbeats of a component being restarted (`trainer` also clears trainer_<rank>),
        or of all."""
        for name in self.heartbeats():
            if component is None or name == component or name.startswith(component + "_"):
                try:
                    os.unlink(self.heartbeat_file(name))
                except FileNotFoundError:
                    pass

    @property
    def events(self) -> str:
        return os.path.join(self.root, "events.jsonl")

    def append_event(self, event: dict) -> None:
        """One line, written with a single O_APPEND write (whole lines, also from several writers)."""
        line = (json.dumps(dict(event, time=round(time.time(), 3)), sort_keys=True) + "\n").encode()
        fd = os.open(self.events, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_events(self) -> list[dict]:
        if not os.path.exists(self.events):
            return []
        with open(self.events) as f:
            return [json.loads(line) for line in f if line.strip().endswith("}")]

    def running_attempt(self, components: tuple[str, ...], fresh_s: float) -> dict | None:
        """The last `start` event, once every one of `components` has beaten since it and within the last
        `fresh_s` seconds (the attempt is up); None before that."""
        starts = [e for e in self.read_events() if e.get("event") == "start"]
        beats = self.heartbeats()
        if starts and all(n in beats and starts[-1]["time"] < beats[n]["beat"] > time.time() - fresh_s
                          for n in components):
            return starts[-1]
        return None

    # ---- (re)starting a run in this directory --------------------------------------------------------
    def reset_control(self) -> None:
        """Clear step requests, STOP and stale addresses before (re)starting a run in this directory."""
        for d in (self.control_dir, self.rendezvous_dir):
            if os.path.isdir(d):
                for name in os.listdir(d):
                    os.unlink(os.path.join(d, name))
            os.makedirs(d, exist_ok=True)

    def reset_role(self, role: str) -> None:
        """Clear what one side of a run publishes before it (re)starts: the trainer side owns control/ and
        the trainer/weights addresses, the rollout side the engine addresses (paired jobs start apart)."""
        os.makedirs(self.control_dir, exist_ok=True)
        os.makedirs(self.rendezvous_dir, exist_ok=True)
        doomed = []
        if role in ("all", "trainer"):
            doomed += [os.path.join(self.control_dir, n) for n in os.listdir(self.control_dir)]
            doomed += [self.trainer_file, self.weights_file]
        if role in ("all", "rollout"):
            doomed += [os.path.join(self.rendezvous_dir, n) for n in os.listdir(self.rendezvous_dir)
                       if n.startswith(ENGINE_PREFIX)]
        for path in doomed:
            if os.path.exists(path):
                os.unlink(path)
