"""bench/profile_modes.py end to end on the CPU (a device call is too scarce to find a broken script with),
and its kernel-name classification on names the GPU profiler gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))

from profile_modes import kind_of  # noqa: E402


def test_kernel_names_fall_in_their_kind():
    assert kind_of("nvjet_tst_128x64_64x8_1x1_v_bz_coopA_TNT") == "gemm"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kind_of("_bi_matmul_kernel") == "gemm" and kind_of("_bi_matmul_tma_kernel") == "gemm"
    assert kind_of("_grouped_matmul_kernel") == "gemm"
    assert kind_of("_bi_attention_kernel") == "attention" and kind_of("_decode_attention_split_kernel") == "attention"
    assert kind_of("flash_fwd_splitkv_kernel") == "attention"
    assert kind_of("_rms_norm_fwd_kernel") == "norm"
    assert kind_of("_sample_rows_kernel") == "sampling"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>") \
        == "elementwise/other"


def test_profile_modes_runs_both_modes_on_the_cpu(tmp_path):
    run = subprocess.run([sys.executable, "bench/profile_modes.py", "--tiny", "--out", str(tmp_path)], cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads((tmp_path / "profile_modes.json").read_text())
    for mode in ("default", "batch_invariant"):
        served = res[mode]["served"]
        # the first step prefills and samples a token; every other token is one decode step
        assert served["decode_steps"] == res["new"] - 1, served
        assert served["total_s"] >= served["prefill_s"] > 0
        assert sum(res[mode]["per_kind_ms"].values()) > 0
    assert "default / batch-invariant" in run.stdout
