"""bench/bi_attention_probe.py's whole loop on the CPU interpreter: a device call is too scarce to find a
broken launch or a malformed result file with."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("triton")


def test_the_attention_probe_runs_end_to_end_on_the_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    run = subprocess.run([sys.executable, "bench/bi_attention_probe.py", "--tiny", "--out", str(tmp_path)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    probe = json.loads((tmp_path / "bi_attention_probe.json").read_text())
    (row,) = probe["rows"]
    assert row["flash_ms"] > 0 and row["pinned_ms"] > 0
    # every candidate either timed (same bits) or recorded as differing; none failed to launch
    assert not [d for d in probe["differing"] if "error" in d], probe["differing"]
    assert len(row["times_ms"]) + len(probe["differing"]) == 4 and "m64/w4/s2" in row["times_ms"]
    # the pinned tile without the heavy-first order keeps the bits (the interpreter's tiles are the same)
    assert "m64/w4/s3" in row["times_ms"], probe["differing"]
    assert row["best"] in row["times_ms"]


def test_the_probe_refuses_tiny_without_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "bench/bi_attention_probe.py", "--tiny"], cwd=REPO, env=dict(env, PYTHONPATH=REPO),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "TRITON_INTERPRET=1" in run.stderr
