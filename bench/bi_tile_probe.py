"""Which output tilings of the batch-invariant matmul give the same bits, and how fast each is (issue 27).

    PYTHONPATH=$PWD python3 bench/bi_tile_probe.py --out DIR        (a GPU; several minutes: --presets, --m narrow it)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 bench/bi_tile_probe.py --tiny --out DIR   (CPU: the script runs)

The batch-invariance argument of lockstep_kernels/gpu/matmul.py needs only the reduction over K to be
fixed: BLOCK_K chunks from 0 upward, one tl.dot each, fp32 accumulation. The output tiling (BLOCK_M,
BLOCK_N), the warps and the pipeline stages decide which program computes an element, not how; but a
tile shape also picks the MMA instruction (Hopper's wgmma needs 64-row tiles; smaller ones get mma.sync),
and whether those round alike is a fact of the GPU, not of the argument. If every tiling gives the same
bits on this GPU, the launcher may choose the tiling per M (small tiles at decode sizes, where 128 x 128
tiles leave most SMs idle) and stay batch-invariant: lockstep_kernels/gpu/tilings.py takes only what this
probe shows.

For every GEMM shape of the 1.7B and 4B presets (q/k/v/o, fused qkv, gate/up, fused gate_up, down, LM
head) at M from 1 to 16384, against the pinned configuration (matmul.CONFIGS): each candidate tiling's
output compared bitwise, its time, and cuBLAS's time (F.linear). Writes bi_tile_probe.json: per shape the
pinned ratio (cuBLAS / pinned) and the best bit-identical candidate's ratio; and every candidate that
differed in any bit (the tilings the launcher must never mix).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import cold_copies, graph_ms, wall_ms  # noqa: E402
from lockstep_kernels.gpu.matmul import CONFIGS, INTERPRET, bi_matmul  # noqa: E402
from lockstep_kernels.gpu.matmul_tma import bi_matmul_tma  # noqa: E402

# 128: the engine's decode batch at 128 running requests (a row covers the Ms up to the next probed one, so
# without it decode at 128 took the tiling measured fastest at 256).
M_SIZES = (1, 16, 64, 128, 256, 2048, 16384)
TMA_MIN_M = 64  # the TMA kernel is timed from here up (2026-12-06: 0.42-0.81x of cuBLAS at M <= 256)
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). BLOCK_K 64 is the pinned one; the few with 32 or
# 128 ask whether a tl.dot over a longer chunk is the same chain of k16 MMAs into the accumulator.
# Narrow tiles (BLOCK_N 32) put more programs on the SMs at decode sizes, where N / 64 programs leave most
# of them idle (the 2026-12-05 H100 probe's best tilings at M <= 64 were its narrowest, 16 x 64).
# BLOCK_N 16 (2026-12-07) goes further: N / 16 programs, and with BLOCK_M 64-128 a decode batch's rows in
# one or two row blocks, so each weight tile is read from memory once or twice.
TILES = [(16, 32, 4), (16, 32, 2), (32, 32, 4), (64, 32, 4), (16, 64, 4), (16, 64, 2), (16, 128, 4), (32, 64, 4),
         (32, 128, 4), (64, 64, 4), (64, 128, 4), (64, 256, 8), (128, 64, 4), (128, 128, 8), (128, 256, 8),
         (16, 16, 4), (64, 16, 4), (128, 16, 4), (128, 32, 4)]
CANDIDATES = [(bm, bn, 64, w, s) for bm, bn, w in TILES for s in (3, 4) if not (bm * bn >= 128 * 256 and s == 4)] + [
    (128, 128, 128, 8, 3), (128, 256, 32, 8, 4), (64, 128, 128, 4, 3), (16, 64, 128, 4, 3),
    (16, 16, 128, 4, 4), (64, 16, 128, 4, 4), (128, 16, 128, 4, 4), (16, 32, 128, 4, 3), (64, 32, 128, 4, 3),
    (128, 32, 128, 4, 3)]


# The persistent TMA kernel (lockstep_kernels/gpu/matmul_tma.py) at the large-M tilings: same bits as the
# pinned kernel, and faster than it? Timed under "tma:<cfg_key>"; --propose weighs them with the others.
TMA_CANDIDATES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4),
                  (128, 128, 128, 8, 3)]


def shapes(preset_names: list[str]) -> list[tuple[str, int, int]]:
    from pipeline.models.config import REAL_SIZES, QWEN_VOCAB

    out = {}
    for name in preset_names:
        s = REAL_SIZES[name]
        h, hd, nh, nkv, inter = s["hidden_size"], s["head_dim"], s["num_attention_heads"], s["num_key_value_heads"], \
            s["intermediate_size"]
        for what, n, k in [("q", nh * hd, h), ("kv", nkv * hd, h), ("qkv", (nh + 2 * nkv) * hd, h), ("o", h, nh * hd),
                           ("gate", inter, h), ("gate_up", 2 * inter, h), ("down", h, inter), ("lm_head", QWEN_VOCAB, h)]:
            out.setdefault((n, k), f"{name} {what}")
        if s.get("moe_intermediate_size"):  # the experts' projections: the trainer runs them through bi_matmul
            mi = s["moe_intermediate_size"]  # per expert, the engine through the grouped kernel's tiles
            out.setdefault((mi, h), f"{name} expert gate/up")
            out.setdefault((h, mi), f"{name} expert down")
    return [(label, n, k) for (n, k), label in out.items()]


def cfg_key(bm: int, bn: int, bk: int, warps: int, stages: int) -> str:
    return f"{bm}x{bn}x{bk}/w{warps}/s{stages}"


def cfg_of(key: str) -> tuple:
    """cfg_key's inverse: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), with "tma" appended for the
    TMA kernel's keys ("tma:<cfg_key>"): a tilings.py row's tiling and kernel."""
    kernel, _, key = key.rpartition(":")
    tile, warps, stages = key.split("/")
    bm, bn, bk = tile.split("x")
    return (int(bm), int(bn), int(bk), int(warps[1:]), int(stages[1:])) + ((kernel,) if kernel else ())


def timed(row: dict) -> dict[str, float]:
    """A probe row's times (ms) of every candidate that kept the pinned bits there: matmul.py's kernel's
    under cfg_key, the TMA kernel's under "tma:<cfg_key>"."""
    return {**row["times_ms"], **(row.get("tma_ms") or {})}


def eligible(probe: dict) -> set[str]:
    """The candidates (either kernel) that gave the pinned bits at every shape and M of the probe and
    launched there."""
    differ = {("tma:" if d.get("kernel") == "tma" else "") + cfg_key(*d["cfg"]) for d in probe["differing"]}
    return set.union(set(), *(set(timed(r)) for r in probe["rows"])) - differ


def merged(probes: list[dict]) -> dict:
    """One probe from several (a run cut off after some shapes, then the rest; a later run at a few M
    only, e.g. decode sizes): a later probe's row replaces an earlier one's at the same weight shape and
    M, and the earlier rows at other M stay; bit differences seen anywhere count everywhere."""
    rows: dict[tuple[int, int, int], dict] = {}
    for probe in probes:
        rows.update({(r["n"], r["k"], r["m"]): r for r in probe["rows"]})
    return {"gpu": " + ".join(sorted({p["gpu"] for p in probes})), "pinned": probes[-1]["pinned"],
            "rows": list(rows.values()), "differing": [d for p in probes for d in p["differing"]]}


def collapse(rows: list[tuple], pinned: dict) -> list[tuple]:
    """Table rows (largest M, *tiling) ascending in M: a row whose tiling the next row repeats is covered
    by it (first row whose largest M an M is not past wins), and trailing rows of the pinned tiling say
    what M past the table gets anyway."""
    out = []
    for r in rows:
        if out and out[-1][1:] == r[1:]:
            out[-1] = r
        else:
            out.append(r)
    default = (pinned["BLOCK_M"], pinned["BLOCK_N"], pinned["BLOCK_K"], pinned["num_warps"], pinned["num_stages"])
    while out and out[-1][1:] == default:
        out.pop()
    return out


def propose_tilings(probe: dict) -> list[tuple[int, int, int, int, int, int]]:
    """tilings.TILINGS rows for this GPU from a probe's results (every weight shape): per measured M
    (ascending), among the candidates that gave the pinned bits at every shape and M of the probe and
    ran at every shape of that M, the one with the best geometric-mean speed-up over cuBLAS; an M takes
    the choice of the smallest measured M at or above it, and past the largest one the pinned tiling.
    Rows: (largest M, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, "tma"])."""
    import math

    ok = eligible(probe)
    out = []
    for m in sorted({r["m"] for r in probe["rows"]}):
        rows = [r for r in probe["rows"] if r["m"] == m]
        scores = {key: sum(math.log(r["cublas_ms"] / timed(r)[key]) for r in rows)
                  for key in set.intersection(*(set(timed(r)) for r in rows)) & ok}
        if scores:
            out.append((m, *cfg_of(max(scores, key=scores.get))))
    return collapse(out, probe["pinned"])


def propose_shape_tilings(probe: dict) -> dict[tuple[int, int], list[tuple[int, int, int, int, int, int]]]:
    """tilings.SHAPE_TILINGS rows per weight shape (N, K): per measured M, the fastest eligible candidate
    at that shape (`eligible`: the same bits everywhere the probe looked), collapsed as TILINGS' rows."""
    ok = eligible(probe)
    out = {}
    for n, k in sorted({(r["n"], r["k"]) for r in probe["rows"]}):
        rows = []
        for r in sorted((r for r in probe["rows"] if (r["n"], r["k"]) == (n, k)), key=lambda r: r["m"]):
            times = {key: t for key, t in timed(r).items() if key in ok}
            if times:
                rows.append((r["m"], *cfg_of(min(times, key=times.get))))
        if rows := collapse(rows, probe["pinned"]):
            out[(n, k)] = rows
    return out


def save(out_dir: str, pinned: dict, rows: list, differing: list) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bi_tile_probe.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (interpreter)", "pinned": pinned, "candidates": CANDIDATES, "rows": rows,
                   "differing": differing}, f, indent=1)


def keeps_bits(run, ref: torch.Tensor, entry: dict, differing: list) -> bool:
    """Whether run() launches and gives ref's bits; what it did instead goes to `differing` as entry +
    the error or the fraction of elements whose bits differ."""
    try:
        out = run()
    except Exception as e:  # out of shared memory, an older Triton, ...: not a candidate here
        differing.append(dict(entry, error=f"{type(e).__name__}: {str(e)[:120]}"))
        return False
    if torch.equal(out.view(torch.int16), ref.view(torch.int16)):
        return True
    differing.append(dict(entry, frac_bits_differ=(out.view(torch.int16) != ref.view(torch.int16)).sum().item()
                          / out.numel()))
    return False


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
    p.add_argument("--presets", default="qwen3-1.7b,qwen3-4b,qwen3-moe-small")
    p.add_argument("--m", default=",".join(map(str, M_SIZES)))
    p.add_argument("--propose", metavar="PROBE_JSON", nargs="+", help="print the tilings.py tables a probe's results give"
                   " (several: a later one's shapes replace an earlier one's), and exit")
    p.add_argument("--tiny", action="store_true", help="CPU interpreter (TRITON_INTERPRET=1): one small shape, a few"
                   " candidates; checks the script runs (the interpreter's bits are not the GPU's)")
    a = p.parse_args()
    if a.tiny and not INTERPRET:
        p.error("--tiny runs on the CPU interpreter: set TRITON_INTERPRET=1")
    if a.propose:
        probes = []
        for path in a.propose:
            with open(path) as f:
                probes.append(json.load(f))
        probe = merged(probes)
        print(f"# {probe['gpu']}: rows (largest M, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, kernel])")
        print("# for lockstep_kernels/gpu/tilings.py TILINGS (every shape):")
        print(propose_tilings(probe))
        print("# for SHAPE_TILINGS ((N, K): rows):")
        print("{")
        for shape, rows in propose_shape_tilings(probe).items():
            print(f"    {shape}: {rows},")
        print("}")
        return 0
    dt, dev = torch.bfloat16, "cpu" if a.tiny else "cuda"
    pinned = CONFIGS[dt]
    # fn(w) timed over cold copies of the weight in one CUDA graph: device time, as the engine's decode
    # graphs pay it (common.graph_ms; eager per-call times carried the launcher's host cost at small M)
    timeit = (lambda fn, ws: wall_ms(lambda: fn(ws[0]))) if a.tiny else (lambda fn, ws: graph_ms(lambda i: fn(ws[i]), len(ws)))
    candidates, tma_candidates = (CANDIDATES[:2], TMA_CANDIDATES[:1]) if a.tiny else (CANDIDATES, TMA_CANDIDATES)
    m_sizes = (1, 17, 256) if a.tiny else tuple(map(int, a.m.split(",")))
    rows, differing = [], []
    torch.manual_seed(0)
    for label, n, k in [("tiny", 48, 80)] if a.tiny else shapes(a.presets.split(",")):
        w = torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5
        ws = [w] if a.tiny else cold_copies(w)
        for m in m_sizes:
            if m * n > 2**32:
                continue
            x = torch.randn(m, k, device=dev, dtype=dt)
            ref = bi_matmul(x, w.t(), cfg=pinned)
            t_cublas = timeit(lambda wi: F.linear(x, wi), ws)
            t_pinned = timeit(lambda wi: bi_matmul(x, wi.t(), cfg=pinned), ws)
            times, tma = {}, {}  # cfg_key -> ms, for the candidates that kept the pinned bits
            kernels = [(candidates, lambda cfg, wi=w: bi_matmul(x, wi.t(), cfg=cfg), {}, times, ""),
                       (tma_candidates if m >= TMA_MIN_M else (), lambda cfg, wi=w: bi_matmul_tma(x, wi, cfg=cfg),
                        {"kernel": "tma"}, tma, "tma:")]
            for cands, kernel, tag, keyed, prefix in kernels:
                for bm, bn, bk, warps, stages in cands:
                    cfg = dict(pinned, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                    entry = {**tag, "shape": label, "m": m, "n": n, "k": k, "cfg": [bm, bn, bk, warps, stages]}
                    if keeps_bits(lambda: kernel(cfg), ref, entry, differing):
                        keyed[prefix + cfg_key(bm, bn, bk, warps, stages)] = timeit(lambda wi: kernel(cfg, wi), ws)
            best = min(times, key=times.get) if times else None
            row = {"shape": label, "m": m, "n": n, "k": k, "cublas_ms": t_cublas, "pinned_ms": t_pinned,
                   "pinned_ratio": t_cublas / t_pinned,
                   "best_cfg": best and list(cfg_of(best)), "best_ms": best and times[best],
                   "best_ratio": best and t_cublas / times[best], "times_ms": times,
                   "tma_ms": tma, "tma_best_ratio": tma and t_cublas / min(tma.values())}
            rows.append(row)
            print(f"{label:<22} m={m:<6} n={n:<6} k={k:<5} cublas {t_cublas:8.4f} ms  pinned {row['pinned_ratio']:.2f}x"
                  f"  best-equal {row['best_ratio'] or 0:.2f}x {row['best_cfg']}"
                  + (f"  tma {row['tma_best_ratio']:.2f}x" if tma else ""), flush=True)
            del x, ref
        del w, ws
        if not a.tiny:
            torch.cuda.empty_cache()
        save(a.out, pinned, rows, differing)  # after every shape: a cut-off call keeps what ran
    for kernel in ("pinned", "tma"):
        mine = [d for d in differing if d.get("kernel", "pinned") == kernel]
        n_bits = sum(1 for d in mine if "frac_bits_differ" in d)
        print(f"{kernel} kernel: {len(rows)} shapes; candidates differing in bits: {n_bits}; "
              f"failed to launch: {len(mine) - n_bits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
