"""Run configuration: typed sections (schema.py), strict loading with overrides (core.py), checks against
the model's shape (validate.py)."""

from __future__ import annotations

import yaml

from pipeline.config.core import apply_overrides, from_dict, load_yaml, to_dict
from pipeline.config.schema import RunConfig
from pipeline.run import RunDir

__all__ = ["RunConfig", "load_config", "config_from_dict", "dump_config", "load_resolved"]


def config_from_dict(data: dict, overrides: list[str] | None = None) -> RunConfig:
    return from_dict(RunConfig, apply_overrides(RunConfig, data, overrides or []))


def load_config(path: str | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML recipe (or the defaults when path is None) and apply `key.sub=value` overrides."""
    data = load_yaml(path) if path else {}
    return config_from_dict(data, overrides)


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def load_resolved(run_dir: str) -> RunConfig:
    """The config a launcher wrote into the run directory (what every component reads)."""
    return load_config(RunDir(run_dir).config)
