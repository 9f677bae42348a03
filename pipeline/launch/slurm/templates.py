"""The reference batch scripts in slurm/ (hetjob, colocated, paired): rendered from
configs/cluster-example.yaml by the same function `lockstep submit` uses. Regenerate with
`python -m pipeline.launch.slurm.templates` after changing the renderer; a test keeps them in sync."""

from __future__ import annotations

import dataclasses
import os

from pipeline.config import load_config
from pipeline.launch.slurm.plan import render_script
from pipeline.launch.slurm.profile import load_profile
from pipeline.launch.slurm.submit import driver_command

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXAMPLE = os.path.join(REPO, "configs", "cluster-example.yaml")


def reference_scripts() -> dict[str, str]:
    base = load_config(EXAMPLE)
    out = {}
    for mode, roles in (("hetjob", ["all"]), ("colocated", ["all"]), ("paired", ["trainer", "rollout"])):
        cfg = dataclasses.replace(base, slurm=dataclasses.replace(base.slurm, mode=mode))
        if mode == "colocated":
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, num_gpus=16))
        profile = load_profile(cfg.slurm.cluster)
        for role in roles:
            name = f"{mode}.sbatch" if role == "all" else f"{mode}-{role}.sbatch"
            out[name] = render_script(cfg, profile, cfg.run_dir, driver_command(cfg.run_dir, role, python="python3"),
                                      role=role, python="python3")
    return out


if __name__ == "__main__":
    for name, text in reference_scripts().items():
        with open(os.path.join(REPO, "slurm", name), "w") as f:
            f.write(text)
        print("wrote slurm/" + name)
