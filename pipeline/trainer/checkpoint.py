"""Checkpoints: torch DCP for model + optimizer + scheduler, a JSON record of everything else.

Layout: run_dir/checkpoints/step_000012/ with DCP files (the policy and its optimizer; PPO's critic
and its optimizer) and trainer_state.json (step, weight version, data cursor, RNG). A checkpoint is
written under a temp name and renamed only when complete, so a kill during save leaves the previous
one valid; the last `keep_last` are kept.
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from pipeline import faults
from pipeline.errors import is_storage_failure, storage_error
from pipeline.run import RunDir
from pipeline.utils.fs import atomic_write_json, fsync_dir, read_json

STATE_NAME = "trainer_state.json"
log = logging.getLogger("lockstep.checkpoint")


def ckpt_root(run_dir: str) -> str:
    return RunDir(run_dir).checkpoints


def ckpt_dir(run_dir: str, step: int) -> str:
    return os.path.join(ckpt_root(run_dir), f"step_{step:06d}")


def list_checkpoints(run_dir: str) -> list[int]:
    root = ckpt_root(run_dir)
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        if name.startswith("step_") and os.path.exists(os.path.join(root, name, STATE_NAME)):
            steps.append(int(name[5:]))
    return sorted(steps)


def latest_checkpoint(run_dir: str) -> int | None:
    steps = list_checkpoints(run_dir)
    return steps[-1] if steps else None


def save(run_dir: str, step: int, model, optimizer, scheduler, state: dict, keep_last: int,
         critic: tuple | None = None) -> str:
    """Collective. `step` is the number of completed rollout steps; `critic`: (model, optimizer)."""
    final = ckpt_dir(run_dir, step)
    tmp = os.path.join(ckpt_root(run_dir), f".step_{step:06d}.tmp")
    rank = dist.get_rank()
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        model_sd, optim_sd = _state_dicts(model, optimizer)
        entries = {"model": model_sd, "optim": optim_sd}
        if critic is not None:
            entries["critic"], entries["critic_optim"] = _state_dicts(*critic)
        dcp.save(entries, checkpoint_id=tmp)
        dist.barrier()
        time.sleep(faults.slow_checkpoint_s(step))  # fault injection: a window to kill a save in
        if rank == 0:
            full = dict(state, step=step, scheduler=scheduler.state_dict(), torch_rng=torch.get_rng_state().tolist(),
                        has_critic=critic is not None)
            atomic_write_json(os.path.join(tmp, STATE_NAME), full)
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(ckpt_root(run_dir))
            for old in list_checkpoints(run_dir)[:-keep_last]:
                shutil.rmtree(ckpt_dir(run_dir, old), ignore_errors=True)
    except (Exception, dcp.api.CheckpointException) as e:  # keep only complete checkpoints
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if is_storage_failure(e):  # disk full, read-only: the user's to fix, named as such
            raise storage_error(f"checkpoint of step {step}", tmp, e) from e
        raise
    dist.barrier()
    return final


def load(run_dir: str, step: int, model, optimizer, scheduler, critic: tuple | None = None) -> dict:
    """Collective. Restores model, optimizer and scheduler (and the critic: (model, optimizer)) in place;
    returns the trainer state record."""
    path = ckpt_dir(run_dir, step)
    record = read_json(os.path.join(path, STATE_NAME))
    model_sd, optim_sd = _state_dicts(model, optimizer, for_load=True)
    state = {"model": model_sd, "optim": optim_sd}
    if critic is not None and record.get("has_critic"):
        state["critic"], state["critic_optim"] = _state_dicts(*critic, for_load=True)
    elif critic is not None:
        log.warning("checkpoint step %d holds no critic (written before critics were saved): it starts afresh", step)
    dcp.load(state, checkpoint_id=path)
    _restore(model, optimizer, state["model"], state["optim"])
    if "critic" in state:
        _restore(*critic, state["critic"], state["critic_optim"])
    scheduler.load_state_dict(record["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
    torch.set_rng_state(torch.tensor(record["torch_rng"], dtype=torch.uint8))
    return record


def _restore(model, optimizer, model_sd: dict, optim_sd: dict) -> None:
    if hasattr(model, "load_dcp_state"):
        model.load_dcp_state(optimizer, model_sd, optim_sd)
    else:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _state_dicts(model, optimizer, for_load: bool = False):
    """torch's (model, optimizer) state dicts for DCP, or the model's own (`dcp_state`: the megatron
    backend keeps each rank's shards under names of its own)."""
    if hasattr(model, "dcp_state"):
        return model.dcp_state(optimizer, for_load)
    return get_state_dict(model, optimizer)


def clean_partial(run_dir: str) -> None:
    """Remove half-written checkpoint directories left by a kill during save."""
    root = ckpt_root(run_dir)
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def save_backend(run_dir: str, step: int, backend, keep_last: int, extra: dict | None = None) -> str:
    """Collective: a TrainerBackend's state (policy, optimizer, schedule; PPO's critic) after `step`
    rollout steps, the weight version the engines then serve beside it, and `extra` (JSON: e.g. SFT's
    data cursor) in trainer_state.json."""
    b = backend
    critic = (b.critic, b.critic_optimizer) if b.critic is not None else None
    state = {"weight_version": step, **(extra or {})}
    return save(run_dir, step, b.model, b.optimizer, b.scheduler, state, keep_last, critic=critic)


def read_state(run_dir: str, step: int) -> dict:
    """The trainer_state.json record of checkpoint `step`."""
    return read_json(os.path.join(ckpt_dir(run_dir, step), STATE_NAME))


def resume_backend(run_dir: str, backend) -> int:
    """Collective: a TrainerBackend back to the latest complete checkpoint (half-written ones are
    removed); the rollout steps done (0: none, it starts afresh)."""
    clean_partial(run_dir)
    latest = latest_checkpoint(run_dir)
    if latest is None:
        return 0
    b = backend
    critic = (b.critic, b.critic_optimizer) if b.critic is not None else None
    record = load(run_dir, latest, b.model, b.optimizer, b.scheduler, critic=critic)
    log.info("resumed from checkpoint step %d", latest)
    return int(record["step"])
