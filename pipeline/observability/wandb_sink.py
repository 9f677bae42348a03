"""Weights & Biases (a MetricSink): one W&B run per run directory, its files under run_dir/wandb/.

The run's id lives in run_dir/wandb/lockstep_run.json, so a resumed run (requeue, restart) continues
the same W&B run (resume="allow"); offline, each start writes its own run_dir/wandb/offline-run-*
directory with that id, and `wandb sync` of them all uploads one run.

W&B steps only increase, so a step that a resume re-runs is not logged again if W&B already holds it:
W&B keeps that step's first values (the same numbers in a deterministic run, timings aside), while
metrics.jsonl and TensorBoard hold the re-run's. What W&B holds is asked of W&B itself, not of our
own bookkeeping: wandb-core writes its records in batches (every 15 s), so a killed trainer can take
the last steps with it, and those are then logged by the re-run. Online that is the server's next
step for the resumed run; offline, the last step in the run's offline files (read_wandb_file).

History gets the same numeric keys as TensorBoard (base.scalars); the resolved config is the run's
config, logged at init; a string value in a record goes to the run config under its key. Offline
mode reaches no network: no system-metrics sampler, no machine-info probes, no console capture.
"""

from __future__ import annotations

import glob
import os
import secrets
import struct

from pipeline.config.schema import WandbConfig
from pipeline.observability.base import scalars
from pipeline.utils.fs import atomic_write_json, read_json
from pipeline.run import RunDir

STATE_NAME = "lockstep_run.json"


def wandb_dir(run_dir: str) -> str:
    return RunDir(run_dir).wandb


def wandb_state(run_dir: str) -> dict | None:
    """{"id", "mode", "url"} of the run directory's W&B run, or None if it has none."""
    path = os.path.join(wandb_dir(run_dir), STATE_NAME)
    return read_json(path) if os.path.exists(path) else None


def offline_files(run_dir: str, run_id: str) -> list[str]:
    """The run's offline .wandb files, oldest start first."""
    return sorted(glob.glob(os.path.join(wandb_dir(run_dir), f"offline-run-*-{run_id}", f"run-{run_id}.wandb")))


def read_wandb_file(path: str):
    """The records (wandb's own protobuf Record) of a .wandb file: a 7-byte ':W&B' header, then
    LevelDB-log blocks of 32 KiB holding chunks with a 7-byte header (crc32c, length, type: 1 full,
    2 first, 3 middle, 4 last). Stops at a torn tail (a killed writer)."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B transaction log")
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # too small for a chunk header: the block's zero trailer
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + n > len(data):
            return
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 0:  # zero padding
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def last_offline_step(run_dir: str, run_id: str) -> int:
    """The highest step W&B's offline files of this run hold (-1: none)."""
    for path in reversed(offline_files(run_dir, run_id)):  # the newest start that logged anything
        steps = [r.history.step.num for r in read_wandb_file(path) if r.WhichOneof("record_type") == "history"]
        if steps:
            return max(steps)
    return -1


class WandbSink:
    def __init__(self, cfg: WandbConfig, run_dir: str, config: dict, aliases: dict[str, str] | None = None):
        import wandb

        self.aliases = aliases
        os.makedirs(wandb_dir(run_dir), exist_ok=True)
        state = wandb_state(run_dir) or {"id": secrets.token_hex(4)}
        offline = cfg.mode == "offline"
        held = last_offline_step(run_dir, state["id"]) if offline else None
        settings = wandb.Settings(console="off", x_disable_stats=offline, x_disable_machine_info=offline)
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, group=cfg.group,
                              name=cfg.name or os.path.basename(os.path.normpath(run_dir)),
                              id=state["id"], resume="allow", mode=cfg.mode, dir=run_dir,
                              config=config, settings=settings)
        self.held = held if offline else self.run.starting_step - 1  # online: the server's next step
        atomic_write_json(os.path.join(wandb_dir(run_dir), STATE_NAME),
                          {"id": state["id"], "mode": cfg.mode, "url": None if offline else self.run.url})

    def write(self, record: dict, step: int) -> None:
        if step <= self.held:
            return  # a re-run step after a resume: W&B holds it already (steps only increase)
        strings = {k: v for k, v in record.items() if isinstance(v, str)}
        if strings:
            self.run.config.update(strings, allow_val_change=True)
        self.run.log(scalars(record, self.aliases), step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return before wandb-core has written the run's last records (offline, the
        # .wandb file held only its header for a moment); teardown waits for them and ends wandb-core.
        wandb.teardown()
