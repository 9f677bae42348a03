"""Weights & Biases (a MetricSink): one W&B run per run directory, its files under run_dir/wandb/.

The run's id lives in run_dir/wandb/lockstep_run.json, so a resumed run (requeue, restart) continues
the same W&B run (resume="allow"); offline, each start writes its own run_dir/wandb/offline-run-*
directory with that id, and `wandb sync` of them all uploads one run. W&B steps only increase: a
step that a resume re-runs is not logged again (the file also holds the last step logged), so W&B
keeps the values of that step's first run (the same numbers in deterministic runs, apart from
timings), while metrics.jsonl and TensorBoard hold the re-run's. A kill between W&B's log and that
file's update can log one step twice offline (online, W&B drops the second).

History gets the same numeric keys as TensorBoard (base.scalars); the resolved config is the run's
config, logged at init; a string value in a record goes to the run config under its key.
Offline mode reaches no network: no system-metrics sampler, no machine-info probes, no console capture.
"""

from __future__ import annotations

import os
import secrets

from pipeline.config.schema import WandbConfig
from pipeline.observability.base import scalars
from pipeline.utils.fs import atomic_write_json, read_json

WANDB_DIR = "wandb"
STATE_NAME = "lockstep_run.json"


def wandb_dir(run_dir: str) -> str:
    return os.path.join(run_dir, WANDB_DIR)


def wandb_state(run_dir: str) -> dict | None:
    """{"id", "last_step", "mode", "url"} of the run directory's W&B run, or None if it has none."""
    path = os.path.join(wandb_dir(run_dir), STATE_NAME)
    return read_json(path) if os.path.exists(path) else None


class WandbSink:
    def __init__(self, cfg: WandbConfig, run_dir: str, config: dict, aliases: dict[str, str] | None = None):
        import wandb

        self.aliases = aliases
        os.makedirs(wandb_dir(run_dir), exist_ok=True)
        self.state_path = os.path.join(wandb_dir(run_dir), STATE_NAME)
        self.state = wandb_state(run_dir) or {"id": secrets.token_hex(4), "last_step": -1}
        offline = cfg.mode == "offline"
        settings = wandb.Settings(console="off", x_disable_stats=offline, x_disable_machine_info=offline)
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, group=cfg.group,
                              name=cfg.name or os.path.basename(os.path.normpath(run_dir)),
                              id=self.state["id"], resume="allow", mode=cfg.mode, dir=run_dir,
                              config=config, settings=settings)
        self.state.update(mode=cfg.mode, url=None if offline else self.run.url)
        atomic_write_json(self.state_path, self.state)

    def write(self, record: dict, step: int) -> None:
        if step <= self.state["last_step"]:
            return  # a re-run step after a resume: W&B holds it already (steps only increase)
        strings = {k: v for k, v in record.items() if isinstance(v, str)}
        if strings:
            self.run.config.update(strings, allow_val_change=True)
        self.run.log(scalars(record, self.aliases), step=step)
        self.state["last_step"] = step
        atomic_write_json(self.state_path, self.state)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return before wandb-core has written the run's records (offline: the .wandb file
        # held only its header for a moment); teardown waits for them and ends the service process.
        wandb.teardown()
