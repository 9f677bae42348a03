"""The persistent TMA matmul's launch (lockstep_kernels/gpu/matmul_tma.py) compiles once per tiling, not
once per M.

Triton compiles a kernel anew for every new set of compile-time arguments. The launcher once passed
min(SMs, tiles) as NUM_SMS, so every M whose tile count fell below the SM count (each new prefill
length in the engine, each short micro-batch in the trainer) compiled the kernel again inside the run;
a probe at fixed M never sees that. Here every launch's compile-time arguments are recorded for a range
of M at one tiling and must all be the same, while the grid still never starts more programs than tiles."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.tools.tensor_descriptor")

import torch  # noqa: E402

from lockstep_kernels.gpu import matmul_tma  # noqa: E402

CFG = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "GROUP_M": 8}


class _Recorder:
    """Stands in for the jitted kernel: `kernel[grid](*args, **constexprs)` records grid and keywords."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, kwargs))


@pytest.mark.parametrize("n,k", [(2048, 2048), (1024, 2048), (151936, 2048)])
def test_compile_time_arguments_do_not_depend_on_m(monkeypatch, n, k):
    rec = _Recorder()
    monkeypatch.setattr(matmul_tma, "_bi_matmul_tma_kernel", rec)
    w = torch.zeros(n, k, dtype=torch.bfloat16)
    ms = [1, 77, 128, 300, 1000, 2047, 4096]
    for m in ms:
        matmul_tma.bi_matmul_tma(torch.zeros(m, k, dtype=torch.bfloat16), w, cfg=CFG, num_sms=132)
    assert len(rec.launches) == len(ms)
    constexprs = {tuple(sorted(kw.items())) for _, kw in rec.launches}
    assert len(constexprs) == 1, f"one compile per M: {sorted({kw['NUM_SMS'] for _, kw in rec.launches})}"
    for m, (grid, kw) in zip(ms, rec.launches):
        tiles = -(-m // CFG["BLOCK_M"]) * -(-n // CFG["BLOCK_N"])
        assert grid == (min(132, tiles),) and kw["NUM_SMS"] == 132
