"""The trainer: ask for rollouts, train on them, push weights, log, checkpoint — one step at a time.

Run one process per rank (torchrun-style env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Rank 0
also drives the control files and the weight broadcast to the engines.
"""

from __future__ import annotations

import datetime
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from pipeline import faults
from pipeline.algo.losses import grpo_loss, off_policy_weights, reduction_scale, value_loss
from pipeline.buffer.reader import BufferReader, select_fresh
from pipeline.buffer.schema import TRAINABLE, RolloutBatch
from pipeline.buffer.writer import remove_step
from pipeline.config import load_resolved
from pipeline.config.schema import RunConfig
from pipeline.errors import NonFiniteError
from pipeline.observability.sinks import MetricSinks, open_sinks
from pipeline.observability.startup import StartupClock
from pipeline.rollout.client import EngineClient, EngineError
from pipeline.rollout.protocol import MemoryAction, MemoryTag
from pipeline.rollout.tito import verify_batch
from pipeline.run import RunDir, bind_address
from pipeline.trainer import checkpoint
from pipeline.trainer.batching import MicroBatch, balance_across_ranks, build_micro_batch, pack_micro_batches
from pipeline.trainer.fsdp import FSDPBackend, int4_scale_dtype
from pipeline.trainer.targets import Scores, take, token_advantages
from pipeline.weights.base import WeightTransport, make_transport
from pipeline.models.qat import int4_values, w4a16_state
from pipeline.weights.quant import fp8_stream

log = logging.getLogger("lockstep.trainer")


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def all_reduce(values: list[float], device, op=dist.ReduceOp.SUM, group=None) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def make_backend(cfg: RunConfig, model_dir: str, device: torch.device):
    if cfg.train.backend == "megatron":
        from pipeline.trainer.megatron.backend import MegatronBackend

        return MegatronBackend(cfg, model_dir, device)
    return FSDPBackend(cfg, model_dir, device)


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: str, clock: StartupClock | None = None):
        self.cfg, self.layout = cfg, RunDir(run_dir)
        self.clock = clock or StartupClock()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = pick_device(cfg.train.device, int(os.environ.get("LOCAL_RANK", 0)))
        with self.clock.phase("model"):  # load, shard, optimizer (and reference model / critic)
            self.backend = make_backend(cfg, self.layout.model_dir(cfg), self.device)
        # Ranks of one tensor-parallel group (megatron) read the same data; sums of data run over DP.
        self.dp_rank, self.dp_size, self.dp_group = self.backend.dp_rank, self.backend.dp_size, self.backend.dp_group
        self.reader = BufferReader(self.layout.buffer, verify=cfg.buffer.verify_checksums,
                                   on_corrupt=cfg.buffer.on_corrupt)
        self.sender: WeightTransport | None = None
        self.metrics: MetricSinks | None = None
        self.nonfinite_in_row = 0
        self.step = 0

    # ---- the loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.cfg
        with self.clock.phase("resume"):
            start = self.resume()
        if self.rank == 0:
            self.metrics = open_sinks(cfg, self.layout.root, start_step=start)
            with self.clock.phase("wait_engines"):
                self.connect_engines()
        if start > 0 or cfg.train.int4_qat:
            # engines loaded version 0 from disk (and, for INT4 QAT, not yet on the INT4 grid)
            with self.clock.phase("first_sync"):
                self.sync_weights(version=start)
        if self.rank == 0:
            self.layout.publish_version(start)
        self.clock.publish(self.layout.startup_file(f"trainer_{self.rank}"))
        for step in range(start, cfg.num_rollout):
            t0 = time.monotonic()
            self.step = step
            batch, rollout_info = self.get_rollout(step, version=step)
            self.engine_memory(MemoryAction.RELEASE)
            t1 = time.monotonic()
            train_metrics = self.train_on(batch)
            if cfg.engine.colocated and self.device.type == "cuda":
                # The engines wake beside us: the allocator's cached activation blocks go back to the
                # device, or the GPU would hold the training peak and the engines at once.
                torch.cuda.empty_cache()
            t2 = time.monotonic()
            self.engine_memory(MemoryAction.RESUME, [MemoryTag.WEIGHTS])
            sync = self.sync_weights(version=step + 1)
            self.engine_memory(MemoryAction.RESUME, [MemoryTag.KV_CACHE])
            if self.rank == 0:
                self.layout.publish_version(step + 1)
            t3 = time.monotonic()
            perf = {"perf/step_time_s": t3 - t0, "perf/rollout_time_s": t1 - t0, "perf/train_time_s": t2 - t1,
                    "perf/weight_sync_time_s": t3 - t2}
            self.log_step(step, rollout_info, train_metrics, perf, sync)
            if not cfg.buffer.keep_consumed and self.rank == 0 and step > 0:
                # The newest committed step holds the rollout side's state (prompt cursor, unfinished
                # groups): collect the one before it.
                remove_step(self.layout.buffer, step - 1)
            if self.should_save(step + 1):
                self.save(step + 1)
            if step + 1 < cfg.num_rollout and self.preemption_requested():
                if not self.should_save(step + 1):
                    self.save(step + 1)
                if self.rank == 0:
                    self.metrics.close()
                    self.layout.publish_checkpoint_done(step + 1)
                log.info("checkpointed at step %d on request; exiting for requeue", step + 1)
                return
        self.finish()

    def preemption_requested(self) -> bool:
        """Rank 0 looks for control/CHECKPOINT (the Slurm driver writes it on USR2); all ranks agree."""
        flag = 1.0 if self.rank == 0 and self.layout.checkpoint_requested() else 0.0
        (flag,) = all_reduce([flag], self.device, op=dist.ReduceOp.MAX)
        return flag > 0

    # ---- pieces --------------------------------------------------------------------------------------
    def resume(self) -> int:
        checkpoint.clean_partial(self.layout.root)
        latest = checkpoint.latest_checkpoint(self.layout.root)
        if latest is None:
            return 0
        b = self.backend
        record = checkpoint.load(self.layout.root, latest, b.model, b.optimizer, b.scheduler, critic=self.critic_pair())
        log.info("resumed from checkpoint step %d", latest)
        return int(record["step"])

    def connect_engines(self) -> None:
        """Rank 0: the weight transport to every engine (a group, or colocated handles), and a watcher
        that catches up a restarted engine."""
        rundir, n, key = self.layout, self.cfg.engine.num_engines, self.layout.token()
        urls = rundir.engine_urls(n, timeout_s=self.cfg.engine.startup_timeout_s)
        clients = [EngineClient(u, timeout_s=self.cfg.weights.timeout_s, api_key=key) for u in urls]
        host = os.environ.get("LOCKSTEP_WEIGHTS_HOST") or bind_address()
        self.sender = make_transport(self.cfg.weights, clients, self.device, host,
                                     publish_path=rundir.weights_file,
                                     urls=lambda: rundir.current_engine_urls(n), api_key=key)
        self.sender.connect(clients)
        if self.cfg.weights.keep_host_copy:
            self.sender.watch()

    def engine_memory(self, action: MemoryAction, tags: list[MemoryTag] | None = None) -> None:
        """Colocated engines (engine.colocated): rank 0 has them give their device memory to the trainer
        once the step's rollouts are in, and take it back for the weight update (weights first, so the
        update has somewhere to land; then the KV cache)."""
        if not self.cfg.engine.colocated or self.rank != 0:
            return
        for c in self.sender.live_clients():
            c.memory(action, tags)

    def get_rollout(self, step: int, version: int) -> tuple[RolloutBatch, dict]:
        """Step `step`'s committed rollouts, reduced to what trains now: finished samples of kept groups,
        not older than the staleness bound (fully async)."""
        commit = self.reader.wait_for_step(step, timeout_s=self.cfg.rollout.request_timeout_s * 50)
        batch = self.reader.read_step(step)
        info = commit.setdefault("rollout", {})
        info["train/tito_mismatch"] = verify_batch(batch)
        trainable = np.flatnonzero(np.isin(batch.status, TRAINABLE))
        batch = batch.select(trainable) if len(trainable) < len(batch) else batch
        if self.cfg.rollout.mode == "fully_async":
            batch, stale = select_fresh(batch, version, self.cfg.staleness)
            info["train/stale_samples_dropped"] = stale
        if len(batch) == 0:
            raise RuntimeError(f"rollout step {step} has no trainable samples (all filtered, aborted or stale)")
        return batch, commit

    def train_on(self, batch: RolloutBatch) -> dict:
        """One rollout step of training: score, compute advantages, then one optimizer step per minibatch."""
        cfg, b = self.cfg, self.backend
        sums: dict[str, float] = {}
        maxes = {"train/rollout_logprob_max_abs_diff": 0.0}
        grad_norms, skipped = [], 0
        plans = self.plan_minibatches(batch)
        scores = self.score_pass(batch, plans, sums) if self.needs_score_pass(len(plans)) else None
        local = sorted({i for plan in plans for mb, w in plan if w for i in mb})
        adv_R, returns_R = token_advantages(batch, local, scores, cfg.algo, self.global_moments)
        for plan in plans:
            counts = self.global_counts(batch, plan)
            for mb_idx, weight in plan:
                mb = build_micro_batch(batch, mb_idx, adv_R, self.device, weight=weight,
                                       with_routing=b.args.is_moe)
                targets = {k: self.tensor(take(v, batch, mb_idx)) for k, v in (
                    ("old", scores.old_logp_R if scores else None), ("ref", scores.ref_logp_R if scores else None),
                    ("old_values", scores.values_R if scores else None), ("returns", returns_R))}
                self.train_micro_batch(mb, targets, counts, sums, maxes)
            norm, stepped = b.optimizer_step()
            grad_norms.append(norm)
            skipped += not stepped
            self.note_nonfinite(stepped, norm)
        return self.reduce_metrics(sums, maxes, grad_norms, skipped)

    def note_nonfinite(self, stepped: bool, norm: float) -> None:
        """A non-finite gradient skips its optimizer step (the weights stay as they were); too many in a
        row stop the run, since the model or the data is broken."""
        if stepped:
            self.nonfinite_in_row = 0
            return
        self.nonfinite_in_row += 1
        limit = self.cfg.train.max_consecutive_nonfinite
        log.warning("non-finite gradient norm (%s): optimizer step skipped (%d in a row)", norm, self.nonfinite_in_row)
        if limit and self.nonfinite_in_row >= limit:
            raise NonFiniteError(
                f"{self.nonfinite_in_row} optimizer steps in a row had a non-finite loss or gradient "
                f"(train.max_consecutive_nonfinite={limit}); stopping. The last checkpoint is intact: lower train.lr "
                "or fix the data, then run again to resume from it")

    def plan_minibatches(self, batch: RolloutBatch) -> list[list[tuple[list[int], float]]]:
        lengths = (batch.sample_offsets[1:] - batch.sample_offsets[:-1]).tolist()
        return [self.plan_micro_batches([lengths[i] for i in mini], mini)
                for mini in np.array_split(np.arange(len(batch)), self.cfg.optimizer_steps_per_rollout)]

    def plan_micro_batches(self, lengths: list[int], indices: np.ndarray, budget: int | None = None
                           ) -> list[tuple[list[int], float]]:
        """This rank's micro-batches as (sample indices, weight). Ranks agree on the count: a rank with
        fewer runs extra weight-0 micro-batches, so FSDP's collectives pair up."""
        mine = balance_across_ranks(lengths, self.dp_size)[self.dp_rank]
        bins = pack_micro_batches([lengths[i] for i in mine], budget or self.cfg.train.max_tokens_per_gpu)
        plan = [([int(indices[mine[i]]) for i in bin_], 1.0) for bin_ in bins]
        (n,) = all_reduce([len(plan)], self.device, op=dist.ReduceOp.MAX)
        return plan + [([int(indices[0])], 0.0)] * (int(n) - len(plan))

    def needs_score_pass(self, num_minibatches: int) -> bool:
        """Scores before any update are needed for several updates per rollout (PPO's old logprobs),
        for per-token KL rewards, and for a critic's values."""
        a = self.cfg.algo
        return num_minibatches > 1 or a.advantage_estimator == "ppo" or (a.token_level and a.kl_coef > 0)

    def tensor(self, arr):
        return None if arr is None else torch.from_numpy(np.ascontiguousarray(arr)).to(self.device)

    def global_moments(self, *values: float) -> tuple[float, ...]:
        return tuple(all_reduce(list(values), self.device, group=self.dp_group))

    def global_counts(self, batch: RolloutBatch, plan) -> dict:
        tokens = sum(w * float(batch.loss_mask[batch.response_slice(i)].sum()) for mb, w in plan for i in mb)
        samples = sum(w * len(mb) for mb, w in plan)
        longest = max((int(batch.response_len[i]) for mb, w in plan if w for i in mb), default=0)
        tokens, samples = all_reduce([tokens, samples], self.device, group=self.dp_group)
        (longest,) = all_reduce([longest], self.device, op=dist.ReduceOp.MAX)
        return {"tokens": tokens, "samples": samples, "max_len": int(max(longest, self.cfg.rollout.rollout_max_response_len
                                                                          if self.cfg.algo.loss_reduction == "seq_mean_token_sum" else longest))}

    @torch.no_grad()
    def score_pass(self, batch: RolloutBatch, plans, sums: dict) -> Scores:
        """Forward-only pass before any update: old logprobs (and reference logprobs, critic values) of
        every response token, laid out like batch.logprobs. Routing mismatch against the engine is
        measured here, before the policy moves."""
        b, r3 = self.backend, self.cfg.determinism.routing_replay
        t = self.cfg.train
        budget = t.max_tokens_per_gpu_forward or 2 * t.max_tokens_per_gpu
        lengths = (batch.sample_offsets[1:] - batch.sample_offsets[:-1]).tolist()
        # The same samples per rank as training (each rank scores what it trains), packed bigger.
        plans = [self.plan_micro_batches([lengths[i] for i in mini], mini, budget)
                 for mini in np.array_split(np.arange(len(batch)), self.cfg.optimizer_steps_per_rollout)]
        old = np.zeros_like(batch.logprobs)
        ref = np.zeros_like(batch.logprobs) if b.ref_model is not None else None
        values = np.zeros_like(batch.logprobs) if b.critic is not None else None
        zeros = np.zeros(len(batch.logprobs), dtype=np.float32)
        for plan in plans:
            for mb_idx, weight in plan:
                mb = build_micro_batch(batch, mb_idx, zeros, self.device, weight=weight, with_routing=b.args.is_moe)
                logp, _, routing = b.logprobs(mb, replay=r3)
                self.add_routing_counts(routing, weight, sums)
                if not weight:
                    continue
                where = np.concatenate([np.arange(batch.response_offsets[i], batch.response_offsets[i + 1]) for i in mb_idx])
                old[where] = logp.float().cpu().numpy()
                if ref is not None:
                    ref[where] = b.ref_logprobs(mb, replay=r3).float().cpu().numpy()
                if values is not None:
                    values[where] = b.values(mb).float().cpu().numpy()
        return Scores(old, ref, values)

    def train_micro_batch(self, mb: MicroBatch, targets: dict, counts: dict, sums: dict, maxes: dict) -> None:
        """Forward, loss, backward of one micro-batch (policy, and the critic under PPO)."""
        cfg, b, a = self.cfg, self.backend, self.cfg.algo
        want_mtp = bool(b.args.mtp_num_hidden_layers) and cfg.train.mtp_loss_scaling_factor > 0
        logp_M, ent_M, routing, *mtp = b.logprobs(mb, replay=cfg.determinism.routing_replay,
                                                  want_entropy=a.entropy_coef > 0, want_mtp=want_mtp)
        old_M = targets["old"]
        if old_M is None:  # one update per rollout: this forward is the pre-update one
            old_M = logp_M.detach()
            self.add_routing_counts(routing, mb.weight, sums)
        behaviour_M = mb.rollout_logp_M if a.use_rollout_logprobs else old_M
        ref_M = targets["ref"]
        if ref_M is None and b.ref_model is not None and a.kl_loss_coef > 0:
            ref_M = b.ref_logprobs(mb, replay=cfg.determinism.routing_replay)
        mask_M = mb.mask_M
        is_w, is_metrics = None, {}
        if cfg.off_policy_correction != "none":
            is_w, mask_M, is_metrics = off_policy_weights(old_M, mb.rollout_logp_M, mb.mask_M, kind=cfg.off_policy_correction,
                                                          cap=a.tis_clip, low=a.icepop_low, high=a.icepop_high)
        scale_M = reduction_scale(mask_M, mb.sample_of_M, mb.len_of_sample, a.loss_reduction, counts["tokens"],
                                  counts["samples"], counts["max_len"]) * mb.weight
        loss, m = grpo_loss(logp_M, behaviour_M, mb.adv_M, mask_M, eps_clip=a.eps_clip, eps_clip_high=a.eps_clip_high,
                            scale_M=scale_M, ref_logp_M=ref_M, kl_coef=a.kl_loss_coef, kl_type=a.kl_loss_type,
                            entropy_M=ent_M, entropy_coef=a.entropy_coef, eps_clip_c=a.eps_clip_c,
                            ratio_type="sequence" if a.advantage_estimator == "gspo" else "token",
                            sample_of_M=mb.sample_of_M, num_samples=mb.num_samples, is_weight_M=is_w)
        if b.critic is not None:
            v_loss, vm = value_loss(b.values(mb), targets["old_values"], targets["returns"], scale_M, a.eps_clip_value)
            loss = loss + a.value_loss_coef * v_loss
            m.update(vm)
        if mtp:
            # The draft head learns the next-next token of the same sequences; its share is scaled like
            # the policy loss (per token of the global batch), and its inputs are detached.
            s = mtp[0]
            nll_sum = -(s.logp_M * s.mask_M).sum()
            loss = loss + cfg.train.mtp_loss_scaling_factor * (nll_sum / max(counts["tokens"], 1.0)) * mb.weight
            m.update(mtp_nll_sum=nll_sum.detach(), mtp_hit_sum=(s.hit_M * s.mask_M).sum(), mtp_tokens_sum=s.mask_M.sum())
        if faults.in_range("nan_grad_steps", self.step):
            loss = loss * float("nan")  # fault injection
        (loss * b.loss_scale).backward()  # FSDP averages gradients over ranks: loss_scale undoes that
        diff_M = (old_M - mb.rollout_logp_M).abs() * mb.mask_M * mb.weight
        m = {k: float(v) * mb.weight for k, v in {**m, **is_metrics}.items() if k.endswith("_sum")}
        m.update(loss_sum=float(loss.detach()), logprob_abs_diff_sum=float(diff_M.sum()),
                 tokens_sum=float(mb.mask_M.sum()) * mb.weight, samples_sum=float(mb.num_samples) * mb.weight)
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v
        if mb.weight and diff_M.numel():
            maxes["train/rollout_logprob_max_abs_diff"] = max(maxes["train/rollout_logprob_max_abs_diff"],
                                                              float(diff_M.max()))

    def add_routing_counts(self, routing, weight: float, sums: dict) -> None:
        if routing is None or not routing.compared:
            return
        differs, compared = routing.mismatch_counts(len(self.backend.args.moe_layers))
        sums["routing_live_mismatch_sum"] = sums.get("routing_live_mismatch_sum", 0.0) + differs * weight
        sums["routing_compared_sum"] = sums.get("routing_compared_sum", 0.0) + compared * weight

    def reduce_metrics(self, sums: dict, maxes: dict, grad_norms: list[float], skipped: int) -> dict:
        keys = sorted(sums)
        totals = dict(zip(keys, all_reduce([sums[k] for k in keys], self.device, group=self.dp_group)))
        mx = dict(zip(maxes, all_reduce(list(maxes.values()), self.device, op=dist.ReduceOp.MAX)))
        n = max(totals.get("tokens_sum", 0.0), 1.0)
        out = {
            "train/loss": totals["loss_sum"] / max(len(grad_norms), 1),  # ranks' shares add up to the objective
            "train/pg_loss": totals.get("pg_loss_sum", 0.0) / n,
            "train/clipfrac": totals.get("clipfrac_sum", 0.0) / n,
            "train/approx_kl": totals.get("approx_kl_sum", 0.0) / n,
            "train/rollout_logprob_abs_diff": totals.get("logprob_abs_diff_sum", 0.0) / n,
            "train/grad_norm": float(np.mean(grad_norms)),
            "train/lr": self.backend.lr,
            "train/tokens": totals.get("tokens_sum", 0.0),
            "train/skipped_steps": skipped,
        }
        if totals.get("routing_compared_sum"):
            live = totals["routing_live_mismatch_sum"] / totals["routing_compared_sum"]
            out["train/routing_live_mismatch_frac"] = live  # trainer's own routing vs the engine's
            out["train/routing_mismatch_frac"] = 0.0 if self.cfg.determinism.routing_replay else live  # as trained
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
        out.update(mx)
        if self.cfg.determinism.true_on_policy and out["train/rollout_logprob_max_abs_diff"] != 0.0:
            raise RuntimeError(
                "true on-policy violated: trainer and engine logprobs differ by up to "
                f"{out['train/rollout_logprob_max_abs_diff']:.3g} (are engines running with --true-on-policy?)")
        return out

    def sync_weights(self, version: int) -> dict:
        """Collective: all ranks gather full tensors; rank 0 sends them to the engines."""
        dtype = getattr(torch, self.cfg.model.dtype)
        state = self.backend.full_state(dtype)
        if self.rank == 0 and self.cfg.train.int4_qat:  # engines serve the INT4 values the trainer used
            state = int4_values(state, self.cfg.train.int4_group_size, int4_scale_dtype(self.cfg))
        if self.rank == 0 and self.cfg.engine.type == "sglang" and self.backend.args.mtp_num_hidden_layers:
            # SGLang's target model skips mtp.* names; its draft worker keeps the checkpoint's head
            state = ((k, v) for k, v in state if not k.startswith("mtp."))
        if self.rank == 0 and self.cfg.weights.quantization == "fp8":
            state = fp8_stream(state)
        if self.rank == 0:
            # Outside sync mode the engines are generating: pause them around the update.
            return self.sender.send(state, version, pause=self.cfg.rollout.mode != "sync")
        for _ in state:
            pass
        return {}

    def log_step(self, step: int, commit: dict, train: dict, perf: dict, sync: dict) -> None:
        if self.rank != 0:
            return
        rollout = commit.get("rollout", {})
        record = {"step": step, "weights/version": step + 1, **rollout, **train, **perf}
        record.update(self.memory_metrics())
        if sync:
            record["weights/bytes"] = sync["bytes"]
            record["weights/buckets"] = sync["buckets"]
            record["weights/gbps"] = sync["bytes"] / max(sync["seconds"], 1e-9) / 1e9
            record["weights/engine_pause_s"] = sync.get("pause_s", 0.0)
        self.metrics.write(record)

    def memory_metrics(self) -> dict:
        """Peak GPU memory (GiB reserved by the caching allocator) of this trainer rank and of the
        built-in engines, whose /server_info reports theirs."""
        if self.device.type != "cuda":
            return {}
        out = {"perf/trainer_peak_memory_gib": torch.cuda.max_memory_reserved(self.device) / 2**30,
               "perf/trainer_peak_allocated_gib": torch.cuda.max_memory_allocated(self.device) / 2**30}
        if self.cfg.engine.type == "local" and self.sender is not None:
            try:
                peaks = [c.request("GET", "/server_info").get("peak_memory_reserved_gib") for c in self.sender.clients]
            except EngineError:  # an engine is being restarted: no reading this step
                peaks = []
            if peaks and None not in peaks:
                out["perf/engine_peak_memory_gib"] = max(peaks)
        return out

    def should_save(self, done_steps: int) -> bool:
        k = self.cfg.checkpoint.save_interval
        return (self.cfg.checkpoint.save_final and done_steps == self.cfg.num_rollout) or (k > 0 and done_steps % k == 0)

    def save(self, done_steps: int) -> None:
        b = self.backend
        checkpoint.save(self.layout.root, done_steps, b.model, b.optimizer, b.scheduler,
                        {"weight_version": done_steps}, self.cfg.checkpoint.keep_last, critic=self.critic_pair())

    def critic_pair(self) -> tuple | None:
        """PPO's critic and its optimizer, checkpointed with the policy (a resumed run continues its values)."""
        b = self.backend
        return (b.critic, b.critic_optimizer) if b.critic is not None else None

    def finish(self) -> None:
        if self.cfg.checkpoint.export_hf:
            self.export_hf()
        if self.rank == 0:
            self.metrics.close()
            self.layout.request_stop()
            if self.sender:
                self.sender.close()

    def export_hf(self) -> None:
        from pipeline.models.hf_io import save_model

        state = dict(self.backend.full_state(getattr(torch, self.cfg.model.dtype)))
        if self.rank == 0:
            qcfg = None
            if self.cfg.train.int4_qat:  # packed W4A16, the checkpoint an INT4 rollout engine serves
                state, qcfg = w4a16_state(state, self.cfg.train.int4_group_size, int4_scale_dtype(self.cfg))
            save_model(state, self.backend.args, self.layout.hf_export, tokenizer_dir=self.layout.model_dir(self.cfg),
                       quantization_config=qcfg)


def main(run_dir: str) -> None:
    clock = StartupClock()
    cfg = load_resolved(run_dir)
    torch.set_num_threads(cfg.train.num_threads)
    import lockstep_kernels as kernels

    kernels.set_backend(cfg.determinism.kernel_backend)
    kernels.set_batch_invariant(cfg.determinism.true_on_policy)
    backend = "nccl" if (cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())) else "gloo"
    with clock.phase("process_group"):
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.train.dist_timeout_s))
    try:
        Trainer(cfg, run_dir, clock).run()
    finally:
        dist.destroy_process_group()
