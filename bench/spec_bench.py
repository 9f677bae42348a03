"""Speculative decoding with the MTP draft head: acceptance, speed-up over plain decoding, exactness.

A random ~0.5B Qwen3-style model (bf16 on the GPU; initialised with a larger std than HF's so its
next-token distributions are peaked, as a trained LM's are, rather than flat) gets an MTP head,
which is distilled on the model's own greedy continuations of training prompts (the main model
frozen; the head alone learns, as in a run). A random model's continuations follow no pattern a head
could generalise, so acceptance is measured on two prompt sets: "seen" (prompts the head was
distilled on: a head that predicts the target well, the upper end) and "new" (held out: a head
that predicts nothing, the cost of drafting in vain). Plain decoding and speculative decoding (k
drafts per verify forward) generate the same number of tokens side by side:
  - greedy: tokens/s of each and the ratio, the acceptance rate and tokens per verify forward, and
    whether the tokens are identical (they must be up to bf16 near-ties without batch invariance);
  - temperature 1 (shared-noise acceptance): the same;
  - true on-policy mode (batch-invariant kernels): tokens and logprobs bit-identical (goal: True).

    python bench/spec_bench.py           # GPU
    python bench/spec_bench.py --tiny    # CPU-sized variant
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import lockstep_kernels as kernels  # noqa: E402
from bench.common import generate, qwen3_0p5b, write  # noqa: E402
from pipeline.models.attention import PackedCausal  # noqa: E402
from pipeline.models.config import model_preset  # noqa: E402
from pipeline.models.logprobs import token_logprobs  # noqa: E402
from pipeline.models.mtp import mtp_inputs  # noqa: E402
from pipeline.models.qwen3 import Qwen3ForCausalLM  # noqa: E402


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(n)]


def distill_head(model, seqs: list[list[int]], steps: int, device) -> list[float]:
    """Train model.mtp alone (Adam) on `seqs`; the main model's hidden states are computed once."""
    ctx = PackedCausal.from_lengths([len(s) for s in seqs], device)
    ids = torch.tensor([t for s in seqs for t in s], device=device)
    score = torch.cat([torch.arange(int(a), int(b) - 1, device=device)
                       for a, b in zip(ctx.cu_seqlens[:-1], ctx.cu_seqlens[1:])])
    nxt, at, valid = mtp_inputs(ids, ctx.cu_seqlens, score)
    with torch.no_grad():
        _, hidden = model(ids, ctx.positions, ctx, None, logits_at_M=score[:1], return_hidden=True)
    head = model.mtp
    params = list(head.parameters())
    master = [p.detach().float().clone().requires_grad_(True) for p in params]  # fp32 master copy
    opt = torch.optim.Adam(master, lr=2e-3)
    embed, lm = model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    losses = []
    for i in range(steps):
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
        for p in params:
            p.requires_grad_(True)
            p.grad = None
        logits, _ = head(hidden, nxt, ctx.positions, ctx, embed, lm, at)
        loss = -(token_logprobs(logits, ids[score + 1], 1.0) * valid).sum() / valid.sum()
        loss.backward()
        for p, m in zip(params, master):
            m.grad = p.grad.float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i % max(steps // 10, 1) == 0 or i == steps - 1:
            losses.append(round(float(loss.detach()), 4))
    with torch.no_grad():
        for p, m in zip(params, master):
            p.copy_(m)
            p.requires_grad_(False)
    return losses


def compare(model, prompts, new, k, temperature, device, dtype) -> dict:
    generate(model, prompts[:2], 4, device, dtype, temperature=temperature, k=k)  # warm-up
    plain, t_plain, _ = generate(model, prompts, new, device, dtype, temperature=temperature, k=0)
    spec, t_spec, e = generate(model, prompts, new, device, dtype, temperature=temperature, k=k)
    same = sum(a.output_ids == b.output_ids for a, b in zip(plain, spec))
    toks = len(prompts) * new
    return {"batch": len(prompts), "new_tokens": new, "k": k, "temperature": temperature,
            "plain_tok_s": toks / t_plain, "spec_tok_s": toks / t_spec, "speedup": t_plain / t_spec,
            "identical_sequences": f"{same}/{len(prompts)}", **e.spec.stats(),
            "verify_forwards": e.stats["spec_rounds"] // max(len(prompts), 1)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--k", type=int, nargs="*", default=[3])
    p.add_argument("--batches", type=int, nargs="*")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: bfloat16 on GPUs. A random model's near-ties flip between a 1-token and a"
                        " (k+1)-token forward in bf16, so plain and speculative tokens part early; fp32 (no TF32)"
                        " keeps them together, which is what acceptance is measured on")
    p.add_argument("--init-std", type=float, default=0.1, help="weight init std (HF's 0.02 gives flat logits)")
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if a.tiny:
        args, plen, new, batches, n_train, steps = model_preset("tiny-dense", 64, None, 0, None), 8, 24, [1, 8], 32, 150
    else:
        args, plen, new, batches, n_train, steps = qwen3_0p5b(), 64, 128, [1, 8, 32], 64, 300
    args = dataclasses.replace(args, mtp_num_hidden_layers=1, initializer_range=a.init_std)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(args)
    model.init_weights(0)
    model = model.to(dtype).eval().requires_grad_(False)
    batches = a.batches or batches
    vocab = min(args.vocab_size, 1000)
    out = {"device": str(device), "dtype": str(dtype), "params": sum(p.numel() for p in model.parameters()),
           "layers": args.num_hidden_layers}
    t0 = time.perf_counter()
    train_prompts = prompts_for(max(n_train, max(batches)), plen, vocab, 1)
    reqs, _, _ = generate(model, train_prompts, new, device, dtype, temperature=0.0, k=0)
    out["distill_losses"] = distill_head(model, [r.input_ids + r.output_ids for r in reqs], steps, device)
    out["distill_s"] = time.perf_counter() - t0
    rows = []
    for b in batches:
        for which, prompts in (("seen", train_prompts[:b]), ("new", prompts_for(b, plen, vocab, 100 + b))):
            for k, temp in [(k, 0.0) for k in a.k] + [(3, 1.0)]:
                rows.append({"prompts": which, **compare(model, prompts, new, k, temp, device, dtype)})
    out["rows"] = rows
    with kernels.batch_invariant_mode(True):
        small = prompts_for(4, plen, vocab, 7)
        plain, _, _ = generate(model, small, 32, device, dtype, temperature=1.0, k=0)
        spec, _, e = generate(model, small, 32, device, dtype, temperature=1.0, k=3)
    out["true_on_policy_bit_identical"] = all(x.output_ids == y.output_ids and x.output_logprobs == y.output_logprobs
                                              for x, y in zip(plain, spec))
    out["true_on_policy_accept_length"] = e.spec.stats()["avg_spec_accept_length"]
    for r in rows:
        print(f"{r['prompts']:4s} b={r['batch']:<3d} T={r['temperature']} k={r['k']}  plain {r['plain_tok_s']:8.0f} tok/s"
              f"  spec {r['spec_tok_s']:8.0f} tok/s  x{r['speedup']:.2f}  accept {r['spec_accept_rate']:.2f}"
              f"  len {r['avg_spec_accept_length']:.2f}  same {r['identical_sequences']}")
    print("distill loss", out["distill_losses"], f"{out['distill_s']:.1f}s")
    print("true on-policy bit-identical:", out["true_on_policy_bit_identical"])
    print("wrote", write("spec" + ("_tiny" if a.tiny else ""), out))


if __name__ == "__main__":
    main()
