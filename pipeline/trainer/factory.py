"""The training backend a run config names (train.backend), built on its model."""

from __future__ import annotations

import torch

from pipeline.config.schema import RunConfig
from pipeline.trainer.base import TrainerBackend


def make_backend(cfg: RunConfig, model_dir: str, device: torch.device) -> TrainerBackend:
    """The train.backend's implementation, with the model of `model_dir` loaded on `device`."""
    if cfg.train.backend == "fsdp":
        from pipeline.trainer.fsdp import FSDPBackend

        return FSDPBackend(cfg, model_dir, device)
    if cfg.train.backend == "megatron":
        from pipeline.trainer.megatron.backend import MegatronBackend

        return MegatronBackend(cfg, model_dir, device)
    raise ValueError(f"unknown train.backend {cfg.train.backend!r}")
