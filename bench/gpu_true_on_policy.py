"""True on-policy on a GPU: engine decode (KV cache, continuous batching) vs trainer forward (packed).

    python bench/gpu_true_on_policy.py     -> table + results/true_on_policy.json

For a dense and a MoE Qwen3-style model in bf16: 96 requests of mixed prompt lengths decode 48
tokens each through the built-in engine (64 KV slots, so the batch composition keeps changing),
then the trainer's forward scores the same tokens in packed micro-batches of a different size. Max
|engine logprob - trainer logprob| and the MoE routing mismatch are reported for the default kernels
and for batch-invariant mode (expected: exactly 0), with engine decode throughput in both modes.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from common import device_info, qwen3_0p5b, write

import lockstep_kernels as kernels
from pipeline.models.attention import PackedCausal
from pipeline.models.logprobs import token_logprobs
from pipeline.models.decoder_layer import MoeRouting
from pipeline.models.layers import unstack_experts
from pipeline.models.qwen3 import Qwen3ForCausalLM
from pipeline.rollout.engine.core import Engine, Request, SamplingParams


def run(model, bi: bool, n_req=96, new=48):
    dev = torch.device("cuda")
    with kernels.batch_invariant_mode(bi):
        eng = Engine(model, max_running=64, context_length=512, eos_token_ids=[0], device=dev, dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(0)
        reqs = [Request(torch.randint(1, model.args.vocab_size, (int(torch.randint(8, 200, (1,), generator=g)),),
                                      generator=g).tolist(),
                        SamplingParams(max_new_tokens=new, ignore_eos=True, sampling_seed=i), return_routed_experts=True)
                for i in range(n_req)]
        for r in reqs:
            eng.submit(r)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while eng.waiting or eng.running:
            eng.step()
        torch.cuda.synchronize()
        gen_s = time.perf_counter() - t0
        diffs, mism, comp = [], 0.0, 0.0
        unstack_experts(model)  # the trainer computes experts by the per-expert loop (the engine stacked them)
        for chunk in (reqs[i: i + 7] for i in range(0, n_req, 7)):  # trainer packs 7 sequences per micro-batch
            seqs = [r.input_ids + r.output_ids for r in chunk]
            ctx = PackedCausal.from_lengths([len(s) for s in seqs], device=dev)
            starts = torch.cumsum(torch.tensor([0] + [len(s) for s in seqs[:-1]]), 0)
            pos = torch.cat([st + torch.arange(len(r.input_ids) - 1, len(s) - 1) for st, r, s in zip(starts, chunk, seqs)]).to(dev)
            tgt = torch.tensor([t for r in chunk for t in r.output_ids], device=dev)
            routing = None
            if model.args.is_moe:
                trace = torch.cat([torch.cat(r.routed) for r in chunk]).to(dev)
                # the engine never routes a sequence's last token; mark those rows unknown
                rows, off = [], 0
                for r, s in zip(chunk, seqs):
                    rows.append(torch.cat([trace[off: off + len(s) - 1], torch.full_like(trace[:1], -1)]))
                    off += len(s) - 1
                routing = MoeRouting(trace_NLk=torch.cat(rows), replay=False)
            with torch.no_grad():
                logits = model(torch.tensor([t for s in seqs for t in s], device=dev), ctx.positions, ctx, routing,
                               logits_at_M=pos)
                lp = token_logprobs(logits, tgt, 1.0)
            eng_lp = torch.tensor([x for r in chunk for x in r.output_logprobs], device=dev)
            diffs.append(float((lp - eng_lp).abs().max()))
            if routing is not None:
                m, c = routing.mismatch_counts(len(model.args.moe_layers))
                mism, comp = mism + m, comp + c
    return {"max_abs_diff": max(diffs), "routing_mismatch_frac": (mism / comp) if comp else None,
            "decode_tokens_per_s": n_req * new / gen_s}


def main() -> None:
    rows = []
    for name, args in [("dense", dataclasses.replace(qwen3_0p5b(layers=8))),
                       ("moe", dataclasses.replace(qwen3_0p5b(layers=8, moe=True)))]:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(args)
        model.init_weights(0)
        model = model.to("cuda", torch.bfloat16)
        for bi in (False, True):
            r = run(model, bi)
            rows.append({"model": name, "batch_invariant": bi, **r})
            print(f"{name:<6} {'batch-invariant' if bi else 'default':<16} max|diff| {r['max_abs_diff']:.3g}"
                  f"  routing mismatch {r['routing_mismatch_frac']}  decode {r['decode_tokens_per_s']:.0f} tok/s", flush=True)
    write("true_on_policy", {"device": device_info(), "rows": rows})


if __name__ == "__main__":
    main()
