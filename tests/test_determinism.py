"""Determinism: batch-invariant kernels, bitwise true on-policy, R3, reproducible and resumable runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import lockstep_kernels as kernels
from lockstep_kernels import torch_ref
from pipeline.models.hf_io import read_state_dict
from pipeline.observability.metrics import read_metrics
from pipeline.run import RunDir

from conftest import PPO_SMALL, REPO, wait_until
from test_e2e import lockstep

SHAPES = [(1, 7, 5), (3, 64, 60), (37, 96, 130), (129, 33, 17)]  # (M, K, N), odd on purpose


def rows_invariant(op, x):
    """op(x[:m]) == op(x)[:m] bitwise for several m, and a row's result does not depend on its neighbours."""
    full = op(x)
    for m in (1, 2, 3, 5, 16, 17, x.shape[0]):
        if m <= x.shape[0] and not torch.equal(op(x[:m]), full[:m]):
            return False
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))
    return torch.equal(op(x[perm]), full[perm])


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_batch_invariant_and_accurate(m, k, n, dtype):
    g = torch.Generator().manual_seed(m)
    x, w, b = (torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype),
               torch.randn(n, generator=g).to(dtype))
    assert rows_invariant(lambda t: torch_ref.linear(t, w, b), x)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(torch_ref.linear(x, w, b).float(), F.linear(x, w, b).float(), rtol=tol, atol=tol * k ** 0.5)


def test_default_cpu_linear_is_not_batch_invariant():
    """Why the kernels exist: torch's CPU GEMV path (1-3 rows) reduces in another order."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 192, generator=g), torch.randn(64, 192, generator=g)
    assert not torch.equal(F.linear(x[:1], w), F.linear(x, w)[:1])


@pytest.mark.parametrize("n", [1, 16, 60, 1000])
def test_row_ops_batch_invariant(n):
    x = torch.randn(41, n, generator=torch.Generator().manual_seed(n)) * 3
    w = torch.randn(n)
    assert rows_invariant(lambda t: torch_ref.rms_norm(t, w, 1e-6), x)
    assert rows_invariant(torch_ref.log_softmax, x)
    assert rows_invariant(torch_ref.silu, x)
    torch.testing.assert_close(torch_ref.log_softmax(x), torch.log_softmax(x, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch_ref.silu(x), F.silu(x), rtol=1e-6, atol=1e-6)


def ref_attention(q, k, v, qpos):
    t = k.shape[2]
    mask = torch.arange(t)[None, None, :] <= qpos[:, :, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("t", [1, 5, 16, 17, 40])
def test_attention_decode_equals_prefill_bitwise(t):
    """Query at position p: computed in a full causal prefill of length T, or as one decode query over a
    cache of exactly p+1 keys (or a longer, partly filled cache), gives the same bits."""
    g = torch.Generator().manual_seed(t)
    b, h, kv, d = 3, 4, 2, 16
    q = torch.randn(b, h, t, d, generator=g)
    k = torch.randn(b, kv, t, d, generator=g)
    v = torch.randn(b, kv, t, d, generator=g)
    qpos = torch.arange(t)[None, :].expand(b, t)
    prefill = torch_ref.attention(q, k, v, qpos)
    torch.testing.assert_close(prefill, ref_attention(q, k, v, qpos), rtol=1e-5, atol=1e-5)
    for p in range(t):
        decode = torch_ref.attention(q[:, :, p: p + 1], k[:, :, : p + 1], v[:, :, : p + 1], torch.full((b, 1), p))
        assert torch.equal(decode, prefill[:, :, p: p + 1]), p
        longer = torch.cat([k, torch.randn(b, kv, 9, d, generator=g)], 2)  # garbage beyond the position
        decode2 = torch_ref.attention(q[:, :, p: p + 1], longer, torch.cat([v, longer[:, :, t:]], 2), torch.full((b, 1), p))
        assert torch.equal(decode2, prefill[:, :, p: p + 1]), p
    # One sequence alone equals the same sequence inside a batch.
    assert torch.equal(torch_ref.attention(q[1:2], k[1:2], v[1:2], qpos[1:2]), prefill[1:2])


def test_mode_switch_restores_state():
    assert not kernels.is_batch_invariant()
    with kernels.batch_invariant_mode():
        assert kernels.is_batch_invariant()
        with kernels.batch_invariant_mode(False):
            assert not kernels.is_batch_invariant()
        assert kernels.is_batch_invariant()
    assert not kernels.is_batch_invariant()
    with pytest.raises(RuntimeError):
        with kernels.batch_invariant_mode():
            raise RuntimeError("boom")
    assert not kernels.is_batch_invariant()


def test_mode_switch_thread_override_and_process_default():
    """set_batch_invariant is every thread's default; batch_invariant_mode() overrides it for its own
    thread only, and the default set inside a block shows once the block ends."""
    import threading

    seen = {}

    def other(key):
        seen[key] = kernels.is_batch_invariant()

    try:
        with kernels.batch_invariant_mode():
            t = threading.Thread(target=other, args=("during_block",))
            t.start()
            t.join()
            kernels.set_batch_invariant(True)
            with kernels.batch_invariant_mode(False):
                assert not kernels.is_batch_invariant()  # the override beats the default
        assert seen["during_block"] is False  # another thread sees the default, not this thread's block
        assert kernels.is_batch_invariant()  # the default set inside the block
        t = threading.Thread(target=other, args=("default_on",))
        t.start()
        t.join()
        assert seen["default_on"] is True
    finally:
        kernels.set_batch_invariant(False)
    assert not kernels.is_batch_invariant()
    assert not hasattr(kernels, "enable_batch_invariant_mode")  # one switch: no third name


def test_kernel_library_imports_nothing_from_pipeline():
    code = ("import sys, lockstep_kernels, lockstep_kernels.fp8, lockstep_kernels.int4, lockstep_kernels.torch_ref; "
            "print(sorted(m for m in sys.modules if m == 'pipeline' or m.startswith('pipeline.')))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]", res.stdout


def test_kernel_library_has_no_import_cycle():
    """Every import between lockstep_kernels modules, at module level or inside a function, forms no
    cycle (lockstep_kernels/fp8.py and gpu/fp8.py once imported each other), and none names pipeline."""
    import ast
    import pathlib

    root = pathlib.Path(REPO)
    modules = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (root / "lockstep_kernels").rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                found = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names]
            else:
                continue
            assert not any(f == "pipeline" or f.startswith("pipeline.") for f in found), (name, found)
            targets |= {f for f in found if f in modules and f != name}
        edges[name] = targets

    def cycle_from(start, node, path):
        for nxt in edges[node]:
            if nxt == start:
                return path + [nxt]
            if nxt not in path:
                found = cycle_from(start, nxt, path + [nxt])
                if found:
                    return found
        return None

    for name in modules:
        cyc = cycle_from(name, name, [name])
        assert cyc is None, " -> ".join(cyc)


# ---- whole pipeline --------------------------------------------------------------------------------

STEPS = ["num_rollout=3", "rollout_batch_size=8", "global_batch_size=64", "eval.interval=0", "checkpoint.export_hf=false",
         "logging.plot=false", "--no-progress"]


def run_metrics(tmp_path, name, *overrides, faults: str = ""):
    env = dict(os.environ, LOCKSTEP_FAULTS=faults) if faults else None
    res = lockstep("run", "configs/tiny.yaml", f"run_dir={tmp_path}/{name}", *STEPS, *overrides, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return read_metrics(f"{tmp_path}/{name}")


@pytest.mark.slow
@pytest.mark.parametrize("init", ["tiny-dense", "tiny-moe"])
def test_true_on_policy_is_bitwise(tmp_path, init):
    on = run_metrics(tmp_path, "on", f"model.init={init}", "determinism.true_on_policy=true",
                     "engine.max_running_requests=3")
    assert all(r["train/rollout_logprob_max_abs_diff"] == 0.0 and r["train/rollout_logprob_abs_diff"] == 0.0
               for r in on)
    off = run_metrics(tmp_path, "off", f"model.init={init}", "engine.max_running_requests=3")
    assert max(r["train/rollout_logprob_max_abs_diff"] for r in off) > 0.0


@pytest.mark.slow
def test_bf16_moe_routing_mismatch_and_r3(tmp_path):
    # The engine's router sees slightly different logits than the trainer's, as a GPU engine's does at
    # any batch size (its kernels reduce in other orders). On a CPU the bf16 kernels of decode and
    # training may agree bit for bit, so the difference is injected (engine_router_jitter).
    common = ["model.init=tiny-moe", "model.dtype=bfloat16", "engine.max_running_requests=3",
              "rollout_max_response_len=6"]
    jitter = "engine_router_jitter=0.01"
    no_r3 = run_metrics(tmp_path, "plain", *common, faults=jitter)
    assert sum(r["train/routing_mismatch_frac"] for r in no_r3) > 0  # live routing differs for some tokens
    r3 = run_metrics(tmp_path, "r3", *common, "determinism.routing_replay=true", faults=jitter)
    assert all(r["train/routing_mismatch_frac"] == 0.0 for r in r3)
    assert sum(r["train/routing_live_mismatch_frac"] for r in r3) > 0  # measured, then replaced by the trace
    both = run_metrics(tmp_path, "both", *common, "determinism.routing_replay=true", "determinism.true_on_policy=true")
    assert all(r["train/rollout_logprob_max_abs_diff"] == 0.0 and r["train/routing_live_mismatch_frac"] == 0.0
               for r in both)


def test_r3_replays_in_activation_recompute(moe_dir):
    """With recompute, the backward's second forward routes by the same trace: same gradients as without."""
    from pipeline.models.attention import PackedCausal
    from pipeline.models.hf_io import load_model
    from pipeline.models.decoder_layer import MoeRouting
    from torch.distributed._composable import checkpoint

    ids = torch.randint(0, 50, (20,), generator=torch.Generator().manual_seed(0))
    ctx = PackedCausal.from_lengths([20])
    grads = []
    args, _ = load_model(moe_dir)
    trace = torch.randint(0, args.num_experts, (20, len(args.moe_layers), 1),
                          generator=torch.Generator().manual_seed(1)).repeat(1, 1, 2)
    trace[:, :, 1] = (trace[:, :, 0] + 1) % args.num_experts  # two distinct experts, unlike the live choice
    for recompute in (False, True):
        _, m = load_model(moe_dir)
        if recompute:
            for layer in m.model.layers:
                checkpoint(layer)
        routing = MoeRouting(trace_NLk=trace, replay=True)
        m(ids, ctx.positions, ctx, routing, logits_at_M=torch.arange(20)).logsumexp(-1).sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        assert sum(routing.mismatch_counts(len(args.moe_layers))) > 0  # the trace really overrode live routing
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


@pytest.mark.slow
def test_two_runs_same_weights_and_kill_resume(ppo_small_run, tmp_path):
    """Same command, same weights; a run SIGKILLed after a checkpoint and rerun ends bit-identical too.
    PPO, so the critic (its values shape every advantage) must come back from the checkpoint as well.
    The first run is the shared ppo_small_run (the same command)."""
    res = lockstep("run", *PPO_SMALL, f"run_dir={tmp_path}/b")
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = read_state_dict(RunDir(ppo_small_run).hf_export), read_state_dict(RunDir(tmp_path / "b").hf_export)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Kill the whole job with SIGKILL after its step-2 checkpoint, then rerun the same command (2 steps more).
    p = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", *PPO_SMALL, f"run_dir={tmp_path}/c"], cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert wait_until(lambda: os.path.exists(os.path.join(RunDir(tmp_path / "c").checkpoints, "step_000002", "trainer_state.json")), 180)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not os.path.exists(RunDir(tmp_path / "c").hf_export)
    res = lockstep("run", *PPO_SMALL, f"run_dir={tmp_path}/c")
    assert res.returncode == 0, res.stderr[-3000:]
    c = read_state_dict(RunDir(tmp_path / "c").hf_export)
    assert all(torch.equal(a[k], c[k]) for k in a)
    assert [r["step"] for r in read_metrics(f"{tmp_path}/c")] == list(range(4))
