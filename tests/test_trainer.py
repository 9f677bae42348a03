"""The trainer-backend interface (pipeline/trainer/base.py) and what both backends build alike
(pipeline/trainer/optim.py)."""

from __future__ import annotations

import ast
import os
import typing

import pytest
import torch

import dist_helpers
from pipeline.trainer.base import TrainerBackend

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the modules that drive a backend: the step loop and the helpers it hands the backend to
DRIVERS = ("pipeline/trainer/loop.py", "pipeline/trainer/scoring.py", "pipeline/trainer/objective.py",
           "pipeline/trainer/checkpoint.py")


def backend_reads(path: str) -> set[str]:
    """Attributes read off a backend in `path`: `backend.x`, `b.x`, `self.backend.x`."""
    names = set()
    for node in ast.walk(ast.parse(open(os.path.join(REPO, path)).read())):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Name) and v.id in ("b", "backend")) or \
                (isinstance(v, ast.Attribute) and v.attr == "backend" and isinstance(v.value, ast.Name)):
            names.add(node.attr)
    return names


def test_the_loop_uses_only_the_backend_interface():
    members = set(typing._get_protocol_attrs(TrainerBackend))
    used = set().union(*(backend_reads(p) for p in DRIVERS))
    assert used and used <= members, used - members


def test_both_backends_implement_the_interface_and_build_the_same_optimizers(dense_dir, tmp_path):
    """FSDP2 and megatron on one gloo rank (PPO with a KL loss: critic and reference model too, a cosine
    schedule after warm-up): both are TrainerBackends, with AdamW of the same settings for policy and
    critic and the same learning-rate schedule."""
    out = tmp_path / "setup.pt"
    overrides = ["algo.advantage_estimator=ppo", "algo.kl_loss_coef=0.1", "train.lr_warmup_steps=2",
                 "train.lr_decay_style=cosine", "train.min_lr=1e-4", "train.weight_decay=0.05", "num_rollout=3"]
    dist_helpers.spawn(dist_helpers.backend_setup, 1, str(tmp_path / "init"), dense_dir, str(out), overrides)
    got = torch.load(out)
    fsdp, mg = got["fsdp"], got["megatron"]
    assert fsdp["interface"] and mg["interface"]
    assert fsdp == mg
    kind, policy = fsdp["optimizer"]
    assert kind == "AdamW" and policy["lr"] == 3e-3 and policy["weight_decay"] == 0.05
    assert policy["fused"] is None  # CPU: torch's default implementation; fused on GPUs
    assert fsdp["critic_optimizer"][1]["lr"] == 1e-3 and fsdp["reference"]
    assert fsdp["lr_factors"][:2] == [0.5, 1.0] and fsdp["lr_factors"][-1] < 1.0


def test_adamw_is_fused_on_gpus_only():
    from pipeline.config import load_config
    from pipeline.trainer.optim import adamw_settings

    cfg = load_config(None, [])
    assert adamw_settings(cfg, torch.device("cuda"))["fused"] is True
    assert adamw_settings(cfg, torch.device("cpu"))["fused"] is None
    assert adamw_settings(cfg, torch.device("cuda"), critic=True)["lr"] == cfg.algo.critic_lr


@pytest.mark.parametrize("name", ["fsdp", "megatron"])
def test_backends_import_nothing_of_each_other(name):
    path = {"fsdp": "pipeline/trainer/fsdp.py", "megatron": "pipeline/trainer/megatron/backend.py"}[name]
    other = {"fsdp": "pipeline.trainer.megatron", "megatron": "pipeline.trainer.fsdp"}[name]
    tree = ast.parse(open(os.path.join(REPO, path)).read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m.startswith(other) for m in imported), imported
