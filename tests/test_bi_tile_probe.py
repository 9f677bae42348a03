"""bench/bi_tile_probe.py's proposal of tilings.py's tables from a probe's results, and the tables' lookup
(pure; no GPU)."""

from __future__ import annotations

import os
import sys

import pytest

from conftest import REPO

pytest.importorskip("triton")
sys.path.insert(0, os.path.join(REPO, "bench"))

from bi_tile_probe import cfg_key, cfg_of, merged, propose_shape_tilings, propose_tilings  # noqa: E402

from lockstep_kernels.gpu import tilings  # noqa: E402

PINNED = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def row(m, cublas, n=64, k=64, tma=None, **times):
    keyed = {cfg_key(*map(int, key[1:].split("_"))): t for key, t in times.items()}
    return {"m": m, "n": n, "k": k, "cublas_ms": cublas, "times_ms": keyed,
            "tma_ms": {"tma:" + cfg_key(*cfg): t for cfg, t in (tma or {}).items()}}


def test_each_m_takes_the_fastest_tiling_that_kept_the_bits_at_every_shape():
    probe = {"gpu": "H200", "pinned": PINNED, "differing": [
        {"cfg": [16, 64, 64, 4, 3], "frac_bits_differ": 0.4},  # fastest at M=1, but other bits: never chosen
    ], "rows": [
        # M = 1, two shapes: 32x64 wins on both
        row(1, 1.0, c128_128_64_8_3=10.0, c32_64_64_4_3=2.0, c64_64_64_4_3=3.0, c16_64_64_4_3=1.0),
        row(1, 1.0, c128_128_64_8_3=10.0, c32_64_64_4_3=2.5, c64_64_64_4_3=3.0, c16_64_64_4_3=1.0),
        # M = 2048: the pinned tiling wins: its row stays, so M 2..2048 do not fall through to M=16384's
        row(2048, 1.0, c128_128_64_8_3=1.2, c32_64_64_4_3=5.0, c64_64_64_4_3=2.0),
        # M = 16384: a BLOCK_K 128 candidate is fastest and kept the bits: eligible like any other tiling
        row(16384, 1.0, c128_128_64_8_3=1.3, c128_256_64_8_3=1.1, c128_128_128_8_3=0.5),
    ]}
    assert propose_tilings(probe) == [(1, 32, 64, 64, 4, 3), (2048, 128, 128, 64, 8, 3), (16384, 128, 128, 128, 8, 3)]
    # and a last measured M whose best is the pinned tiling adds nothing: past the table is the pinned one
    probe["rows"] = probe["rows"][:3]
    assert propose_tilings(probe) == [(1, 32, 64, 64, 4, 3)]


def test_shape_tables_take_each_shapes_fastest_tiling_that_kept_the_bits_everywhere():
    probe = {"gpu": "H100", "pinned": PINNED, "differing": [
        {"cfg": [16, 64, 64, 4, 3], "frac_bits_differ": 0.1},  # differed at some shape: never chosen anywhere
    ], "rows": [
        row(1, 1.0, n=128, k=256, c128_128_64_8_3=9.0, c16_64_64_4_3=1.0, c16_64_128_4_3=2.0, c32_64_64_4_3=3.0),
        row(16, 1.0, n=128, k=256, c128_128_64_8_3=9.0, c16_64_128_4_3=2.5, c32_64_64_4_3=2.0),
        row(64, 1.0, n=128, k=256, c128_128_64_8_3=9.0, c16_64_128_4_3=2.5, c32_64_64_4_3=2.0),
        row(2048, 1.0, n=128, k=256, c128_128_64_8_3=1.0, c32_64_64_4_3=2.0),
        row(1, 1.0, n=512, k=256, c128_128_64_8_3=1.0, c32_64_64_4_3=2.0),  # pinned is fastest: no table
    ]}
    # M=1: 16x64x128 (16x64x64 differed); M=16 and 64: 32x64x64, one row up to 64; M=2048: pinned, dropped
    assert propose_shape_tilings(probe) == {(128, 256): [(1, 16, 64, 128, 4, 3), (64, 32, 64, 64, 4, 3)]}


def test_lookup_prefers_the_shape_table_then_the_every_shape_table_then_the_pinned_tiling():
    import torch

    bf16, hopper = torch.bfloat16, tilings.HOPPER
    shape_rows = tilings.SHAPE_TILINGS[hopper][bf16][(2048, 2048)]
    assert tilings.pick(1, 2048, 2048, bf16, hopper) == shape_rows[0]
    assert tilings.pick(shape_rows[-1][0], 2048, 2048, bf16, hopper) == shape_rows[-1]
    assert tilings.pick(shape_rows[-1][0] + 1, 2048, 2048, bf16, hopper) is None  # past the table: pinned
    every = tilings.TILINGS[hopper][bf16]
    assert tilings.pick(1, 1000, 3000, bf16, hopper) == every[0]  # a shape the probe did not see
    assert tilings.pick(1, 2048, 2048, bf16, None) is None  # the interpreter, a GPU without tables
    assert tilings.pick(1, 2048, 2048, torch.float32, hopper) is None
    for table in [tilings.TILINGS[hopper][bf16], *tilings.SHAPE_TILINGS[hopper][bf16].values()]:
        assert [r[0] for r in table] == sorted({r[0] for r in table}), "rows ascending in M, each M once"


def test_a_tiling_missing_at_one_shape_of_an_m_is_not_proposed_for_it():
    probe = {"gpu": "H200", "pinned": PINNED, "differing": [], "rows": [
        row(64, 1.0, c128_128_64_8_3=4.0, c64_128_64_4_3=1.0),
        row(64, 1.0, c128_128_64_8_3=4.0),  # the 64x128 tiling did not run at this shape
    ]}
    assert propose_tilings(probe) == []


def test_the_probe_runs_end_to_end_on_the_interpreter(tmp_path):
    """The GPU probe's own loop (its kernels' launches, the bit comparisons, the TMA kernel at M >= 256,
    the JSON, --propose on it) on a small shape under the CPU interpreter: a device call is too scarce to
    find a broken launch with."""
    import json
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    run = subprocess.run([sys.executable, "bench/bi_tile_probe.py", "--tiny", "--out", str(tmp_path)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    probe = json.loads((tmp_path / "bi_tile_probe.json").read_text())
    assert [r["m"] for r in probe["rows"]] == [1, 17, 256]
    assert all(r["times_ms"] and r["cublas_ms"] > 0 for r in probe["rows"])
    assert not probe["rows"][0]["tma_ms"] and probe["rows"][2]["tma_ms"], "the TMA kernel runs at M >= 256 only"
    assert not [d for d in probe["differing"] if "error" in d], probe["differing"]
    proposal = subprocess.run([sys.executable, "bench/bi_tile_probe.py", "--propose", str(tmp_path / "bi_tile_probe.json")],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proposal.returncode == 0 and "SHAPE_TILINGS" in proposal.stdout, proposal.stderr[-2000:]


def test_the_tma_kernel_takes_a_row_where_it_kept_the_bits_and_was_fastest():
    probe = {"gpu": "H100", "pinned": PINNED, "differing": [
        {"kernel": "tma", "cfg": [128, 128, 64, 8, 4], "frac_bits_differ": 0.2},  # fastest, other bits: never
    ], "rows": [
        row(256, 1.0, n=4096, k=2048, c64_64_64_4_4=1.5, tma={(128, 256, 64, 8, 3): 2.0}),  # tiles kernel wins
        row(2048, 1.0, n=4096, k=2048, c128_128_64_8_3=1.4,
            tma={(128, 256, 64, 8, 3): 1.1, (128, 128, 64, 8, 4): 0.9}),  # TMA at 128x256 (128x128/s4 differed)
        row(16384, 1.0, n=4096, k=2048, c128_128_64_8_3=1.3, tma={(128, 256, 64, 8, 3): 1.0}),
    ]}
    assert cfg_of("tma:128x256x64/w8/s3") == (128, 256, 64, 8, 3, "tma")
    assert propose_shape_tilings(probe) == {(4096, 2048): [(256, 64, 64, 64, 4, 4), (16384, 128, 256, 64, 8, 3, "tma")]}
    assert propose_tilings(probe) == [(256, 64, 64, 64, 4, 4), (16384, 128, 256, 64, 8, 3, "tma")]


def test_a_later_probe_replaces_an_earlier_ones_shapes_and_its_bit_differences_count_everywhere():
    old = {"gpu": "H100", "pinned": PINNED, "differing": [{"cfg": [32, 64, 64, 4, 3], "frac_bits_differ": 0.1}],
           "rows": [row(1, 1.0, n=128, k=256, c16_64_64_4_3=2.0), row(1, 1.0, n=512, k=256, c16_64_64_4_3=2.0)]}
    new = {"gpu": "H100", "pinned": PINNED, "differing": [],  # a cut-off run: only the first shape
           "rows": [row(1, 1.0, n=128, k=256, c16_64_64_4_3=3.0, c32_64_64_4_3=1.0)]}
    probe = merged([old, new])
    assert sorted((r["n"], r["times_ms"].get("16x64x64/w4/s3")) for r in probe["rows"]) == [(128, 3.0), (512, 2.0)]
    # 32x64 is fastest in the new probe, but differed in the old one: 16x64 at both shapes
    assert propose_shape_tilings(probe) == {(128, 256): [(1, 16, 64, 64, 4, 3)], (512, 256): [(1, 16, 64, 64, 4, 3)]}


def test_a_later_probe_at_a_few_m_keeps_the_earlier_rows_at_the_others():
    old = {"gpu": "H100", "pinned": PINNED, "differing": [],
           "rows": [row(16, 1.0, n=128, k=256, c16_64_64_4_3=2.0), row(2048, 1.0, n=128, k=256, c64_64_64_4_4=1.0)]}
    new = {"gpu": "H100", "pinned": PINNED, "differing": [],  # decode sizes only, a new narrow tiling fastest
           "rows": [row(16, 1.0, n=128, k=256, c16_64_64_4_3=2.0, c64_16_64_4_3=1.0)]}
    probe = merged([old, new])
    assert sorted(r["m"] for r in probe["rows"]) == [16, 2048]
    assert propose_shape_tilings(probe) == {(128, 256): [(16, 64, 16, 64, 4, 3), (2048, 64, 64, 64, 4, 4)]}


def test_a_row_naming_the_tma_kernel_reaches_the_launch_config():
    import torch

    from lockstep_kernels.gpu.matmul import tiling

    bf16, hopper = torch.bfloat16, tilings.HOPPER
    tma_rows = [(shape, r) for shape, rows in tilings.SHAPE_TILINGS[hopper][bf16].items() for r in rows if r[6:] == ("tma",)]
    assert tma_rows, "the H100 probe put the TMA kernel in the tables"
    (n, k), r = tma_rows[0]
    cfg = tiling(r[0], bf16, hopper, n, k)
    assert cfg["kernel"] == "tma" and (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) == r[1:4]
    assert "kernel" not in tiling(1, bf16, None, n, k), "no table (the interpreter): matmul.py's kernel"
