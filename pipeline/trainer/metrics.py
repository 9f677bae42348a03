"""One training step's metrics: sums on this rank, reduced across ranks into the train/* names.

Every per-token quantity is kept as a sum (keys ending in `_sum`, micro-batch weight applied) and
divided by the step's token count only after the sums of all data-parallel ranks are in, so the
result does not depend on how samples were split over ranks and micro-batches.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from pipeline.trainer.batching import MicroBatch

MAX_DIFF = "train/rollout_logprob_max_abs_diff"


def all_reduce(values: list[float], device, op=dist.ReduceOp.SUM, group=None) -> list[float]:
    """`values` reduced over `group`'s ranks (None: all), in float64."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


class StepMetrics:
    """This rank's sums and maxima of one training step, and its optimizer steps' gradient norms."""

    def __init__(self, num_moe_layers: int = 0):
        self.num_moe_layers = num_moe_layers
        self.sums: dict[str, float] = {}
        self.maxes = {MAX_DIFF: 0.0}
        self.grad_norms: list[float] = []
        self.skipped = 0

    def add(self, sums: dict[str, float]) -> None:
        for k, v in sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v

    def add_routing(self, routing, weight: float) -> None:
        """How often the trainer's live MoE routing differs from the engine's trace (R3 or not)."""
        if routing is None or not routing.compared:
            return
        differs, compared = routing.mismatch_counts(self.num_moe_layers)
        self.add({"routing_live_mismatch_sum": differs * weight, "routing_compared_sum": compared * weight})

    def add_micro_batch(self, mb: MicroBatch, loss: torch.Tensor, old_M: torch.Tensor | None, terms: dict) -> None:
        """A trained micro-batch: its loss, the `_sum` metrics of its loss terms, and how far the
        trainer's pre-update logprobs are from the engine's."""
        m = {k: float(v) * mb.weight for k, v in terms.items() if k.endswith("_sum")}
        m.update(loss_sum=float(loss.detach()), tokens_sum=float(mb.mask_M.sum()) * mb.weight,
                 samples_sum=float(mb.num_samples) * mb.weight)
        if old_M is not None:  # None: the supervised loss, no engine logprobs to compare with
            diff_M = (old_M - mb.rollout_logp_M).abs() * mb.mask_M * mb.weight
            m["logprob_abs_diff_sum"] = float(diff_M.sum())
            if mb.weight and diff_M.numel():
                self.maxes[MAX_DIFF] = max(self.maxes[MAX_DIFF], float(diff_M.max()))
        self.add(m)

    def add_update(self, grad_norm: float, stepped: bool) -> None:
        self.grad_norms.append(grad_norm)
        self.skipped += not stepped

    def reduce(self, device, dp_group, lr: float, routing_replay: bool) -> dict[str, float]:
        """Collective: the step's train/* metrics (sums over the data-parallel ranks, maxima over all)."""
        keys = sorted(self.sums)
        totals = dict(zip(keys, all_reduce([self.sums[k] for k in keys], device, group=dp_group)))
        mx = dict(zip(self.maxes, all_reduce(list(self.maxes.values()), device, op=dist.ReduceOp.MAX)))
        return train_metrics(totals, mx, self.grad_norms, self.skipped, lr, routing_replay)


def train_metrics(totals: dict[str, float], maxes: dict[str, float], grad_norms: list[float], skipped: int,
                  lr: float, routing_replay: bool) -> dict[str, float]:
    """The train/* names from the global sums: per-token means, and the rest as they are."""
    n = max(totals.get("tokens_sum", 0.0), 1.0)
    out = {"train/loss": totals["loss_sum"] / max(len(grad_norms), 1)}  # ranks' shares add up to the objective
    if "sft_nll_sum" in totals:  # the supervised loss: mean NLL per response token, no policy-gradient terms
        out["train/sft_loss"] = totals["sft_nll_sum"] / n
    else:
        out.update({
            "train/pg_loss": totals.get("pg_loss_sum", 0.0) / n,
            "train/clipfrac": totals.get("clipfrac_sum", 0.0) / n,
            "train/approx_kl": totals.get("approx_kl_sum", 0.0) / n,
            "train/rollout_logprob_abs_diff": totals.get("logprob_abs_diff_sum", 0.0) / n,
        })
    out.update({
        "train/grad_norm": float(np.mean(grad_norms)),
        "train/lr": lr,
        "train/tokens": totals.get("tokens_sum", 0.0),
        "train/skipped_steps": skipped,
    })
    if totals.get("routing_compared_sum"):
        live = totals["routing_live_mismatch_sum"] / totals["routing_compared_sum"]
        out["train/routing_live_mismatch_frac"] = live  # trainer's own routing vs the engine's
        out["train/routing_mismatch_frac"] = 0.0 if routing_replay else live  # as trained
    for key in ("kl_loss", "dual_clipfrac", "value_loss"):
        if f"{key}_sum" in totals:
            out[f"train/{key}"] = totals[f"{key}_sum"] / n
    if "is_weight_sum" in totals:
        w, w2 = totals["is_weight_sum"], totals["is_weight_sq_sum"]
        out["train/is_ess"] = w * w / max(n * w2, 1e-12)  # effective sample size fraction
        out["train/is_masked_frac"] = totals["is_masked_sum"] / n
        out["train/is_truncated_frac"] = totals["is_truncated_sum"] / n
    if "entropy_sum" in totals:
        out["train/entropy"] = totals["entropy_sum"] / n
    if totals.get("mtp_tokens_sum"):  # the draft head: loss, and how often its top guess is right
        out["train/mtp_loss"] = totals["mtp_nll_sum"] / totals["mtp_tokens_sum"]
        out["train/mtp_acc"] = totals["mtp_hit_sum"] / totals["mtp_tokens_sum"]
    if "train/rollout_logprob_abs_diff" in out:
        out.update(maxes)
    return out


def memory_metrics(device: torch.device, engine_peaks: Callable[[], list] | None = None) -> dict[str, float]:
    """Peak GPU memory (GiB reserved by the caching allocator) of this trainer rank, and the largest of
    the engines' own peaks (`engine_peaks()`: each engine's, None where one does not say; [] when they
    cannot be asked now)."""
    if device.type != "cuda":
        return {}
    out = {"perf/trainer_peak_memory_gib": torch.cuda.max_memory_reserved(device) / 2**30,
           "perf/trainer_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    peaks = engine_peaks() if engine_peaks is not None else []
    if peaks and None not in peaks:
        out["perf/engine_peak_memory_gib"] = max(peaks)
    return out
