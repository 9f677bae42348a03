"""Apptainer definitions: apptainer is not in Debian 12 and cannot be built here, so the definition
files are linted (sections, base images, the project installed, the vendor's flags in its profile)
and the srun line a profile with an image produces is checked."""

from __future__ import annotations

import os
import re

import pytest

from pipeline.launch.slurm.steps import srun_command
from pipeline.launch.slurm.profile import load_profile

from conftest import REPO

SECTIONS = {"%labels", "%files", "%post", "%environment", "%runscript", "%test"}


def parse_def(path):
    header, sections, current = {}, {}, None
    for line in open(path):
        line = line.rstrip("\n")
        if line.startswith("%"):
            current = line.split()[0]
            assert current not in sections, f"{path}: {current} twice"
            sections[current] = []
        elif current is None:
            if line.strip():
                key, _, value = line.partition(":")
                header[key.strip()] = value.strip()
        else:
            sections[current].append(line)
    return header, sections


@pytest.mark.parametrize("name, vendor, flag", [("lockstep-cuda.def", "nvidia", "--nv"), ("lockstep-rocm.def", "amd", "--rocm")])
def test_definition_files(name, vendor, flag):
    header, sections = parse_def(os.path.join(REPO, "containers", name))
    assert header["Bootstrap"] == "docker" and re.match(r"^[\w./-]+:[\w.-]+$", header["From"]), header
    assert SECTIONS <= set(sections), SECTIONS - set(sections)
    post = "\n".join(sections["%post"])
    assert "set -eu" in post and "pip install --no-cache-dir --no-deps -e /opt/lockstep" in post
    assert re.search(r"megatron-core==[\d.]+", post)  # pinned
    assert any(f"org.lockstep.vendor {vendor}" in line for line in sections["%labels"])
    assert "python -m pipeline.cli" in "\n".join(sections["%runscript"])
    profile = load_profile({"nvidia": "generic-nvidia", "amd": "frontier-amd"}[vendor])
    assert profile.gpu_vendor == vendor and profile.container.flags == [flag]


def test_profile_with_image_runs_components_in_apptainer():
    import dataclasses

    profile = load_profile("generic-nvidia")
    profile = dataclasses.replace(profile, container=dataclasses.replace(profile.container, image="/sw/lockstep-cuda.sif"))
    cmd = srun_command("trainer", "/runs/x", group=0, nodes=2, ntasks=16, ntasks_per_node=8, profile=profile)
    i = cmd.index("apptainer")
    assert cmd[i:i + 6] == ["apptainer", "exec", "--nv", "--bind", "/runs/x", "/sw/lockstep-cuda.sif"]
    assert cmd[i + 6:] == ["python3", "-m", "pipeline.launch.component", "trainer", "--run-dir", "/runs/x"]
