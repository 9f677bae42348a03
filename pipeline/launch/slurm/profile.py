"""Cluster profiles (env/<name>.yaml): what differs between sites, kept out of run configs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from pipeline.config.core import from_dict, load_yaml
from pipeline.errors import ConfigError, UserError

ENV_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "env")


@dataclass
class ContainerProfile:
    runtime: Literal["none", "apptainer"] = "none"
    """How components run: directly, or inside `apptainer exec FLAGS IMAGE`."""
    image: str | None = None
    """Path of the .sif image (built from containers/*.def); null runs on the host."""
    flags: list[str] = field(default_factory=list)
    """apptainer exec flags (--nv for NVIDIA, --rocm for AMD)."""


@dataclass
class ClusterProfile:
    name: str = ""
    """Profile name (the file name without .yaml)."""
    description: str = ""
    """One line about the cluster."""
    gpu_vendor: Literal["nvidia", "amd", "none"] = "nvidia"
    """GPU vendor; decides NCCL vs RCCL naming and the container flags."""
    gpus_per_node: int = 8
    """GPUs per node; a request for more is refused before submission."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU in GiB (an H200: ~139): `lockstep submit` refuses a run whose estimated per-GPU
    peak exceeds it (train.gpu_memory_gib overrides it). null: the memory check is skipped."""
    partition: str | None = None
    """Default partition."""
    modules: list[str] = field(default_factory=list)
    """`module load` these in the batch script."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment of every component (NCCL/RCCL, InfiniBand/Slingshot, threads)."""
    bind: str = "hostname"
    """Address components publish: hostname | loopback | interface:NAME."""
    container: ContainerProfile = field(default_factory=ContainerProfile)
    """Container to run components in."""

    def __post_init__(self):
        if not (self.bind in ("hostname", "loopback") or self.bind.startswith("interface:")):
            raise ConfigError(f"profile {self.name!r}: bind {self.bind!r} is not hostname, loopback or interface:NAME")
        if self.container.runtime == "apptainer" and self.container.image and not self.container.image.endswith(".sif"):
            raise ConfigError(f"profile {self.name!r}: container.image must be a .sif file")


def available_profiles() -> list[str]:
    return sorted(n[:-5] for n in os.listdir(ENV_DIR) if n.endswith(".yaml"))


def load_profile(name_or_path: str) -> ClusterProfile:
    path = name_or_path if name_or_path.endswith(".yaml") else os.path.join(ENV_DIR, f"{name_or_path}.yaml")
    if not os.path.exists(path):
        raise UserError(f"cluster profile {name_or_path!r} not found (available: {', '.join(available_profiles())})")
    try:
        return from_dict(ClusterProfile, load_yaml(path))
    except ConfigError as e:
        raise ConfigError(f"cluster profile {path}: {e}") from None
