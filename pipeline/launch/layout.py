"""Where everything of a run lives inside its run directory."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipeline.config.schema import RunConfig


@dataclass(frozen=True)
class RunLayout:
    root: str

    @property
    def config(self) -> str:
        return os.path.join(self.root, "config.yaml")

    @property
    def buffer(self) -> str:
        return os.path.join(self.root, "buffer")

    @property
    def logs(self) -> str:
        return os.path.join(self.root, "logs")

    @property
    def model_init(self) -> str:
        return os.path.join(self.root, "model_init")

    @property
    def token(self) -> str:
        """The run's shared secret for engine requests (mode 600)."""
        return os.path.join(self.root, ".token")

    @property
    def hf_export(self) -> str:
        return os.path.join(self.root, "hf")

    def model_dir(self, cfg: RunConfig) -> str:
        """The HF directory every component loads its starting weights and tokenizer from."""
        return cfg.model.path or self.model_init

    def log_file(self, component: str) -> str:
        return os.path.join(self.logs, f"{component}.log")
