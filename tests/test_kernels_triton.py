"""The Triton kernels, run through Triton's CPU interpreter (small shapes; the GPU run is bench/gpu_suite.sh).

The interpreter must be switched on before Triton compiles anything, and it would route every
batch-invariant op of the other tests through it, so the checks run in their own process. The
offsets-past-2^31 checks of the same file run in tests/test_kernel_offsets.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("triton")

NAMES = ["matmul", "matmul_tilings", "matmul_split", "matmul_tma", "attention_configs", "grouped_matmul", "rms_norm", "log_softmax", "attention", "decode_attention", "bi_decode", "fp8_matmul", "sampling"]


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "tests/triton_checks.py", "--small", *NAMES], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    out = {}
    for line in res.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[r["check"]] = r
    assert out, res.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_triton_kernel(results, name):
    r = results[name]
    assert r["ok"], r.get("trace") or r.get("error")
