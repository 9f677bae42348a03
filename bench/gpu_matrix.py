"""Every mode at every real size on one GPU: the real job (`lockstep run`: engine process, trainer
process, HDF5 buffer, weight sync) for a few steps per cell, over sizes x modes.

    python bench/gpu_matrix.py --part 1                 # 0.5b and 1.7b rows (under 10 minutes on an H200)
    python bench/gpu_matrix.py --part 2                 # 4b and moe-small rows
    python bench/gpu_matrix.py --sizes moe-small --modes sync_flattened,sync_per_tensor   # MoE weight sync A/B
    python bench/gpu_matrix.py --sizes 4b --modes colocated,true_on_policy   # any subset
    python bench/gpu_matrix.py --report                 # the markdown table of the JSON so far
    python bench/gpu_matrix.py --tiny                   # CPU: the same cells on tiny presets (checks the script)

Checkpoints are written by transformers' own classes (Qwen3ForCausalLM / Qwen3MoeForCausalLM from the
preset's config, transformers' random init, sharded safetensors) with Lockstep's small tokenizer: what a
user brings, not what Lockstep writes. Per cell the JSON (bench/results/h200/matrix.json, merged by
cell) holds: status (ok / failed with the error line / refused up front with Lockstep's reason),
start-up (command to first step, with each component's phases), the steady step split (steps after the
first), response tokens/s per GPU, peak GPU memory of the trainer and the engine (caching allocator,
GiB), and the largest trainer-engine logprob difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from pipeline.observability.metrics import read_metrics  # noqa: E402
from pipeline.observability.report import step_split  # noqa: E402
from pipeline.observability.startup import read_startup, time_to_first_step  # noqa: E402
from pipeline.run import RunDir  # noqa: E402
from pipeline.models.hf_config import write_hf_config  # noqa: E402

SIZES = {"0.5b": "qwen3-0.5b", "1.7b": "qwen3-1.7b", "4b": "qwen3-4b", "moe-small": "qwen3-moe-small",
         "ds-moe-small": "deepseek-v3-small"}
TINY_SIZES = {"tiny": "tiny-dense", "tiny-moe": "tiny-moe", "tiny-ds-moe": "deepseek-v3-tiny"}
PARTS = {1: ["0.5b", "1.7b"], 2: ["4b", "moe-small"], 3: ["ds-moe-small"]}

SYNC_CELL = ["weights.type=tensor", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=2",
             "train.global_batch_size=8", "rollout.rollout_max_response_len=16"]
# mode -> the overrides a user would set for it
MODES = {
    "default": [],
    "true_on_policy": ["determinism.true_on_policy=true"],
    "colocated": ["engine.colocated=true"],
    "one_step_off": ["rollout.mode=one_step_off"],
    "fully_async": ["rollout.mode=fully_async"],
    "fp8_sync": ["weights.quantization=fp8", "engine.quantization=fp8", "algo.off_policy_correction=tis"],
    "megatron": ["train.backend=megatron"],
    "r3": ["determinism.routing_replay=true"],
    # what a MoE user runs for bit-exact training: true on-policy with the engine's routing replayed
    "true_on_policy_r3": ["determinism.true_on_policy=true", "determinism.routing_replay=true"],
    # Colocated weight sync of a MoE's ~3,500 tensors (12.7 s per sync per tensor on 2026-12-04): short
    # rollouts so the cell is about the sync, one handle per bucket (the default) vs one per tensor.
    "sync_flattened": [*SYNC_CELL, "weights.tensor_format=flattened"],
    "sync_per_tensor": [*SYNC_CELL, "weights.tensor_format=per_tensor"],
}
MOE_ONLY = {"r3", "true_on_policy_r3", "sync_flattened", "sync_per_tensor"}

GPU_CONFIG = "configs/bench-0.5b.yaml"  # GRPO, no entropy bonus, no KL: what a real-size recipe runs
TINY_CONFIG = "configs/tiny.yaml"
# The run every cell shares: one GPU, engine and trainer on it, weights through CUDA IPC handles;
# 16 prompts x 8 samples x 256 tokens per step (random models rarely stop: ~32k response tokens), packed
# into micro-batches of up to 16384 tokens (16384 x 151936 logits: past 2^31 elements).
GPU_BASE = ["model.dtype=bfloat16", "train.device=cuda", "engine.device=cuda", "weights.type=tensor",
            "rollout.rollout_batch_size=16", "rollout.n_samples_per_prompt=8", "rollout.rollout_max_response_len=256",
            "train.global_batch_size=128", "train.max_tokens_per_gpu=16384", "engine.max_running_requests=128",
            "train.lr=1e-6", "checkpoint.export_hf=false", "checkpoint.save_final=false", "logging.plot=false"]
# What a user of a model this size sets anyway (the memory check names it when it is missing): the MoE
# fits one GPU beside its engine only colocated (sync modes; the async ones are refused up front), so
# its "colocated" cell is its default one and is not run twice.
SIZE_EXTRA = {"4b": ["train.recompute_activations=true"], "moe-small": ["train.recompute_activations=true"],
              "ds-moe-small": ["train.recompute_activations=true"]}
SIZE_EXTRA_SYNC = {"moe-small": ["engine.colocated=true"], "ds-moe-small": ["engine.colocated=true"]}
ASYNC_MODES = {"one_step_off", "fully_async"}
SKIP = {("moe-small", "colocated"), ("ds-moe-small", "colocated")}
TINY_BASE = ["rollout.rollout_batch_size=8", "train.global_batch_size=64", "checkpoint.export_hf=false",
             "checkpoint.save_final=false", "logging.plot=false"]


def write_checkpoint(out_dir: str, preset: str, device: str) -> float:
    """A random checkpoint of `preset`'s shape written by transformers itself, with Lockstep's tokenizer.
    Returns seconds taken (0 when it already exists)."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return 0.0
    import torch
    import transformers

    from pipeline.models.config import model_preset
    from pipeline.models.tokenizer import build_tiny_tokenizer

    t0 = time.time()
    tmp = out_dir + ".partial"
    tok = build_tiny_tokenizer(tmp)
    args = model_preset(preset, tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    hf = {k: v for k, v in write_hf_config(args).items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    moe = args.is_moe
    if args.is_mla:  # DeepSeek-V3
        config, cls = transformers.DeepseekV3Config(**hf), transformers.DeepseekV3ForCausalLM
    else:
        config = (transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config)(**hf)
        cls = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = cls._from_config(config, dtype=dtype)
    model.save_pretrained(tmp, max_shard_size="4GB")
    del model
    os.replace(tmp, out_dir)
    return time.time() - t0


def cell_overrides(size: str, mode: str, tiny: bool) -> list[str]:
    if tiny:
        return [*TINY_BASE, *MODES[mode]]
    extra = SIZE_EXTRA.get(size, []) + ([] if mode in ASYNC_MODES else SIZE_EXTRA_SYNC.get(size, []))
    return [*GPU_BASE, *extra, *MODES[mode]]


def run_cell(size: str, mode: str, model_dir: str, work: str, steps: int, tiny: bool, timeout_s: float,
             extra: list[str] = (), gpu_gib: float | None = None) -> dict:
    run_dir = os.path.join(work, f"{size}-{mode}")
    overrides = [f"run_dir={run_dir}", f"model.path={model_dir}", f"num_rollout={steps}", *cell_overrides(size, mode, tiny),
                 *extra]
    config = TINY_CONFIG if tiny else GPU_CONFIG
    cmd = [sys.executable, "-m", "pipeline.cli", "run", config, *overrides, "--no-progress"]
    cell = {"size": size, "mode": mode, "command": f"lockstep run {config} " + " ".join(overrides[1:])}
    if extra:  # --set: not the matrix's own settings; say so in the cell (and its table row)
        cell["set"] = list(extra)
    t0 = time.time()
    try:
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        rc, err = res.returncode, res.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = None, (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        err += f"\nlockstep: error: the cell ran past its {timeout_s:.0f}s limit"
    cell["wall_s"] = round(time.time() - t0, 1)
    records = read_metrics(run_dir) if os.path.isdir(run_dir) else []
    error = next((line for line in reversed(err.splitlines()) if line.startswith("lockstep: error:")), None)
    if rc == 0:
        cell["status"] = "ok"
    elif rc == 2 and not records:
        cell["status"], cell["error"] = "refused", (error or err.strip().splitlines()[-1])[len("lockstep: error: "):]
    else:
        cell["status"], cell["error"] = "failed", error or (err.strip().splitlines() or ["(no output)"])[-1]
        cell["log_tail"] = _log_tails(run_dir)
    if records:
        cell.update(_measurements(records, run_dir))
    if gpu_gib:
        cell.update(_estimate(config, overrides, gpu_gib))
    return cell


def _estimate(config: str, overrides: list[str], gib: float) -> dict:
    """Lockstep's pre-flight memory estimate of the cell (GiB) on a GPU of `gib`, beside what was measured."""
    from pipeline.config import load_config
    from pipeline.config import memory

    cfg = load_config(os.path.join(REPO, config), overrides)
    est = memory.estimate(cfg, memory.local_placement(cfg, gpu_visible=True), gib)
    return {"estimate_total_gib": est.total / memory.GIB, "estimate_trainer_gib": est.trainer.peak / memory.GIB,
            "estimate_engine_gib": est.engine.peak / memory.GIB, "estimate": est.line()}


def gpu_facts() -> tuple[str, float]:
    """The GPU's name and memory (GiB)."""
    import torch

    return torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory / 2**30


def in_child(fn, *args):
    """fn(*args) in a fresh (spawned) process. The matrix process itself never touches the GPU: memory it
    took (transformers' random model, freed but kept by the caching allocator; a CUDA context) would sit
    beside every cell's engine and trainer. On 2026-12-07 a 7.5 GiB checkpoint writer's blocks did,
    and the 4B default cell ran out of memory that its engine and trainer alone would have fitted."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _measurements(records: list[dict], run_dir: str) -> dict:
    split = step_split(records, warmup=1)
    startup = read_startup(run_dir)
    peak = lambda key: max((r.get(key) or 0.0 for r in records), default=0.0)  # noqa: E731
    return {
        "steps": len(records),
        "startup_s": time_to_first_step(startup),
        "startup_phases": {name: r["phases"] for name, r in startup.items()},
        "step_s": split["step_s"], "rollout_s": split["rollout_s"], "train_s": split["train_s"],
        "sync_s": split["weight_sync_s"], "response_tokens_per_step": split["response_tokens"],
        "tokens_per_s_per_gpu": split["tokens_per_s"],
        "trainer_peak_gib": peak("perf/trainer_peak_memory_gib"), "engine_peak_gib": peak("perf/engine_peak_memory_gib"),
        "trainer_peak_allocated_gib": peak("perf/trainer_peak_allocated_gib"),
        "max_logprob_diff": max(r.get("train/rollout_logprob_max_abs_diff") or 0.0 for r in records),
        "mean_logprob_diff": sum(r.get("train/rollout_logprob_abs_diff") or 0.0 for r in records) / len(records),
        # MoE: the routing the trainer trained with vs the engine's (0 under R3), and its own live routing
        "max_routing_mismatch": max((r["train/routing_mismatch_frac"] for r in records
                                     if "train/routing_mismatch_frac" in r), default=None),
        "max_routing_live_mismatch": max((r["train/routing_live_mismatch_frac"] for r in records
                                          if "train/routing_live_mismatch_frac" in r), default=None),
    }


def _log_tails(run_dir: str, lines: int = 12) -> dict:
    out = {}
    for path in RunDir(run_dir).log_files():
        with open(path, errors="replace") as f:
            out[os.path.basename(path)] = "".join(f.readlines()[-lines:])
    return out


def merge(path: str, cells: list[dict], meta: dict) -> dict:
    """Cells replace earlier ones of the same (size, mode); the file keeps the rest."""
    data = {"cells": []}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    keep = [c for c in data["cells"] if (c["size"], c["mode"]) not in {(n["size"], n["mode"]) for n in cells}]
    data["cells"] = sorted(keep + cells, key=lambda c: (list(SIZES).index(c["size"]) if c["size"] in SIZES else 9,
                                                       list(MODES).index(c["mode"])))
    data.setdefault("meta", {}).update(meta)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return data


def table(data: dict) -> str:
    head = ("| size | mode | status | start-up s | step s | rollout / train / sync s | tok/s/GPU | "
            "trainer / engine GiB | max logprob diff |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in data["cells"]:
        if c["status"] != "ok":
            reason = c.get("error", "")
            rows.append(f"| {c['size']} | {c['mode']}{_set(c)} | {c['status']}: {reason[:160]} | | | | | | |")
            continue
        rows.append(f"| {c['size']} | {c['mode']}{_set(c)} | ok | {_f(c.get('startup_s'), 1)} | {_f(c['step_s'], 2)} | "
                    f"{_f(c['rollout_s'], 2)} / {_f(c['train_s'], 2)} / {_f(c['sync_s'], 3)} | "
                    f"{c['tokens_per_s_per_gpu']:.0f} | {_f(c['trainer_peak_gib'], 1)} / {_f(c['engine_peak_gib'], 1)} | "
                    f"{c['max_logprob_diff']:.3g} |")
    return "\n".join(rows)


def _set(cell: dict) -> str:
    return f" ({', '.join(cell['set'])})" if cell.get("set") else ""


def _f(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", type=int, choices=sorted(PARTS), help="a predefined slice of the sizes")
    p.add_argument("--sizes", help="comma-separated sizes (default: all, or the part's)")
    p.add_argument("--modes", help="comma-separated modes (default: all)")
    p.add_argument("--steps", type=int, default=3, help="steps per cell; the first is a warm-up (default 3)")
    p.add_argument("--tiny", action="store_true", help="CPU: tiny presets instead of real sizes")
    p.add_argument("--out", default=None, help="JSON to merge into (default bench/results/h200/matrix.json)")
    p.add_argument("--work", default=None, help="checkpoints and run dirs (default: a fresh temporary folder)")
    p.add_argument("--cell-timeout", type=float, default=300.0, help="seconds one cell may take")
    p.add_argument("--report", action="store_true", help="print the table of --out and exit")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override added to every cell of this call (repeatable; kept in each cell as `set`; its"
                        " cells replace the same (size, mode) cells of --out: give another --out for an A/B)")
    a = p.parse_args()
    out = a.out or os.path.join(REPO, "bench", "results", "cpu" if a.tiny else "h200", "matrix.json")
    if a.report:
        with open(out) as f:
            print(table(json.load(f)))
        return
    sizes_known = TINY_SIZES if a.tiny else SIZES
    sizes = a.sizes.split(",") if a.sizes else (PARTS[a.part] if a.part else list(sizes_known))
    modes = a.modes.split(",") if a.modes else list(MODES)
    bad = [s for s in sizes if s not in sizes_known] + [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown size or mode {bad}: sizes {list(sizes_known)}, modes {list(MODES)}")
    if a.set:  # a bad key or value fails here, in one line, not as a traceback after the first cell
        from pipeline.config import load_config
        from pipeline.errors import ConfigError

        try:
            load_config(os.path.join(REPO, TINY_CONFIG if a.tiny else GPU_CONFIG), a.set)
        except ConfigError as e:
            p.error(f"--set: {e}")
    device = "cpu" if a.tiny else "cuda"
    work = a.work or tempfile.mkdtemp(prefix="lockstep-matrix-")
    name, gpu_gib = ("cpu", None) if a.tiny else in_child(gpu_facts)
    meta = {"device": name, "steps_per_cell": a.steps,
            "base_overrides": TINY_BASE if a.tiny else GPU_BASE, "size_extra": SIZE_EXTRA,
            "size_extra_sync_modes": SIZE_EXTRA_SYNC}
    cells = []
    for size in sizes:
        preset = sizes_known[size]
        model_dir = os.path.join(work, "ckpt", size)
        wrote = in_child(write_checkpoint, model_dir, preset, device)
        print(f"== {size}: checkpoint {model_dir} ({wrote:.1f}s to write with transformers)", flush=True)
        for mode in modes:
            if (mode in MOE_ONLY and "moe" not in size) or (size, mode) in SKIP:
                continue
            cell = run_cell(size, mode, model_dir, work, a.steps, a.tiny, a.cell_timeout, a.set, gpu_gib)
            cells.append(cell)
            merge(out, [cell], meta)  # written after every cell: a cut-off call keeps what ran
            line = {k: cell.get(k) for k in ("status", "wall_s", "startup_s", "step_s", "sync_s", "tokens_per_s_per_gpu",
                                             "trainer_peak_gib", "engine_peak_gib", "max_logprob_diff", "error")}
            print(f"{size:>9} {mode:<15} " + json.dumps({k: v for k, v in line.items() if v is not None}), flush=True)
    print(table(merge(out, cells, meta)))


if __name__ == "__main__":
    main()
