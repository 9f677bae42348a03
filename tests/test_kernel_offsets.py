"""Element offsets past 2^31 in the Triton kernels (issue 20), through Triton's CPU interpreter.

`offsets` checks the shared helper (lockstep_kernels/gpu/offsets.py) against exact products and shows
the same product in int32 wrapping; each `<kernel>_2g` check runs a kernel on rows or cache slots that
start past 2^31 elements of a lazily committed buffer (tests/triton_checks.py, `far`). A wrapped int32
offset points gigabytes outside the buffer and can end the process (a segfault before the fix), so every check runs in its own, with faulthandler
printing where it stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("triton")

NAMES = ["offsets", "matmul_2g", "rms_norm_2g", "log_softmax_2g", "attention_2g", "decode_attention_2g",
         "sampling_2g", "fp8_2g", "fp8_matmul_2g"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_offsets_past_2g(name):
    res = subprocess.run([sys.executable, "-X", "faulthandler", "tests/triton_checks.py", "--small", name], cwd=REPO,
                         env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=300)
    reports = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert reports, f"the check's process ended (exit status {res.returncode}) before reporting: {res.stderr[-3000:]}"
    assert reports[0]["ok"], reports[0].get("trace") or reports[0].get("error")
