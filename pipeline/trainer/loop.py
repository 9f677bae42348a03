"""The trainer: ask for rollouts, train on them, push weights, log, checkpoint — one step at a time.

Run one process per rank (torchrun-style env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Rank 0
also drives the control files and the weight broadcast to the engines. The training backend is a
TrainerBackend (base.py); planning (plan.py), the score pass (scoring.py), a micro-batch's loss
(objective.py), metrics (metrics.py) and the weight export (export.py) are their own modules.
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
from pipeline.trainer.factory import make_backend
from pipeline.trainer.batching import MicroBatch, build_micro_batch
from pipeline.trainer.export import engine_stream, save_hf
from pipeline.trainer.metrics import StepMetrics, all_reduce, memory_metrics
from pipeline.trainer.objective import Objective, micro_batch_loss
from pipeline.trainer.plan import GlobalCounts, Planner, local_samples
from pipeline.trainer.scoring import forward_budget, needs_score_pass, score_pass
from pipeline.trainer.targets import Targets, micro_batch_targets, token_advantages
from pipeline.weights.base import WeightTransport, make_transport

log = logging.getLogger("lockstep.trainer")


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: str, clock: StartupClock | None = None):
        self.cfg, self.layout = cfg, RunDir(run_dir)
        self.clock = clock or StartupClock()
        self.rank = dist.get_rank()
        self.device = pick_device(cfg.train.device, int(os.environ.get("LOCAL_RANK", 0)))
        with self.clock.phase("model"):  # load, shard, optimizer (and reference model / critic)
            self.backend = b = make_backend(cfg, self.layout.model_dir(cfg), self.device)
        self.planner = Planner.for_backend(cfg, b, self.device)
        self.objective = Objective.from_config(cfg, b.args)
        self.reader = BufferReader(self.layout.buffer, verify=cfg.buffer.verify_checksums,
                                   on_corrupt=cfg.buffer.on_corrupt)
        self.sender: WeightTransport | None = None
        self.metrics: MetricSinks | None = None
        self.nonfinite_in_row = 0
        self.step = 0
        self.checkpointed = self.collected = 0  # the last checkpoint's step; buffer steps below `collected` are gone

    # ---- the loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        for step in range(self.start(), self.cfg.num_rollout):
            self.step = step
            times = [time.monotonic()]
            batch, commit = self.get_rollout(step, version=step)
            time.sleep(faults.delay_at_s("slow_train_step", step))  # fault injection; 0 otherwise
            self.engine_memory(MemoryAction.RELEASE)  # colocated engines: the GPU is the trainer's until the update
            times.append(time.monotonic())
            train = self.train_step(batch)
            self.return_cached_memory()
            times.append(time.monotonic())
            sync = self.update_engines(version=step + 1)
            times.append(time.monotonic())
            self.log_step(step, commit, train, step_times(times), sync)
            if self.save_or_stop(done_steps=step + 1):
                return
            self.collect_consumed(step)
        self.finish()

    def start(self) -> int:
        """Resume from the latest checkpoint, connect to the engines and publish the weight version
        they serve; the first step to run."""
        with self.clock.phase("resume"):
            start = checkpoint.resume_backend(self.layout.root, self.backend)
        self.checkpointed = start
        if self.rank == 0:
            self.metrics = open_sinks(self.cfg, self.layout.root, start_step=start)
            with self.clock.phase("wait_engines"):
                self.connect_engines()
        if start > 0 or self.cfg.train.int4_qat:
            # engines loaded version 0 from disk (and, for INT4 QAT, not yet on the INT4 grid)
            with self.clock.phase("first_sync"):
                self.sync_weights(version=start)
        if self.rank == 0:
            self.layout.publish_version(start)
        self.clock.publish(self.layout.startup_file(f"trainer_{self.rank}"))
        return start

    def train_step(self, batch: RolloutBatch) -> dict:
        """One rollout step of training: plan, score, compute advantages, then one optimizer step per
        mini-batch. Returns the step's train/* metrics."""
        cfg, b = self.cfg, self.backend
        metrics = StepMetrics(len(b.args.moe_layers))
        plans = self.planner.plan(batch, cfg.train.max_tokens_per_gpu)
        scores = None
        if needs_score_pass(cfg.algo, len(plans)):
            # the same samples per rank as training, packed bigger: a forward-only pass keeps no activations
            forward_plans = self.planner.plan(batch, forward_budget(cfg.train))
            scores = score_pass(b, batch, forward_plans, self.device, cfg.determinism.routing_replay, metrics)
        adv_R, returns_R = token_advantages(batch, local_samples(plans), scores, cfg.algo, self.global_moments)
        for plan in plans:
            counts = self.planner.counts(batch, plan)
            for idx, weight in plan:
                mb = build_micro_batch(batch, idx, adv_R, self.device, weight=weight, with_routing=b.args.is_moe)
                self.train_micro_batch(mb, micro_batch_targets(batch, idx, scores, returns_R, self.device),
                                       counts, metrics)
            norm, stepped = b.optimizer_step()
            metrics.add_update(norm, stepped)
            self.note_nonfinite(stepped, norm)
        out = metrics.reduce(self.device, b.dp_group, b.lr, cfg.determinism.routing_replay)
        self.check_on_policy(out)
        return out

    def train_micro_batch(self, mb: MicroBatch, targets: Targets, counts: GlobalCounts, metrics: StepMetrics) -> None:
        """Forward, loss, backward of one micro-batch (policy, and the critic under PPO)."""
        out = micro_batch_loss(self.objective, self.backend, mb, targets, counts)
        if targets.old_logp_M is None:  # no score pass: this forward measures the routing mismatch
            metrics.add_routing(out.routing, mb.weight)
        loss = out.loss
        if faults.in_range("nan_grad_steps", self.step):
            loss = loss * float("nan")  # fault injection
        (loss * self.backend.loss_scale).backward()  # FSDP averages gradients over ranks: loss_scale undoes that
        metrics.add_micro_batch(mb, loss, out.old_logp_M, out.terms)

    def global_moments(self, *values: float) -> tuple[float, ...]:
        return tuple(all_reduce(list(values), self.device, group=self.backend.dp_group))

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

    def check_on_policy(self, metrics: dict) -> None:
        diff = metrics["train/rollout_logprob_max_abs_diff"]
        if self.cfg.determinism.true_on_policy and diff != 0.0:
            raise RuntimeError(f"true on-policy violated: trainer and engine logprobs differ by up to {diff:.3g}"
                               " (are engines running with --true-on-policy?)")

    # ---- rollouts, engines, control files ------------------------------------------------------------
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
            raise RuntimeError(f"rollout step {step} has no trainable samples (all filtered, aborted, stale, or their reward"
                               " failed: the rollout log names the first reward error)")
        return batch, commit

    def connect_engines(self) -> None:
        """Rank 0: the weight transport to every engine (a group, or colocated handles), and a watcher
        that catches up a restarted engine."""
        rundir, n, key = self.layout, self.cfg.engine.num_engines, self.layout.token()
        urls = rundir.engine_urls(n, timeout_s=self.cfg.engine.startup_timeout_s)
        clients = [EngineClient(u, timeout_s=self.cfg.weights.timeout_s, api_key=key) for u in urls]
        host = os.environ.get("LOCKSTEP_WEIGHTS_HOST") or bind_address()
        self.sender = make_transport(self.cfg.weights, clients, self.device, host,
                                     publish_path=rundir.weights_file,
                                     urls=lambda: rundir.current_engine_urls(n), api_key=key,
                                     engine_type=self.cfg.engine.type)
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

    def return_cached_memory(self) -> None:
        """Colocated on a GPU: the engines wake beside us, so the allocator's cached activation blocks go
        back to the device, or the GPU would hold the training peak and the engines at once."""
        if self.cfg.engine.colocated and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def update_engines(self, version: int) -> dict:
        """The new weights to the engines (colocated ones take their memory back around it), then
        publish the version."""
        self.engine_memory(MemoryAction.RESUME, [MemoryTag.WEIGHTS])
        sync = self.sync_weights(version)
        self.engine_memory(MemoryAction.RESUME, [MemoryTag.KV_CACHE])
        if self.rank == 0:
            self.layout.publish_version(version)
        return sync

    def sync_weights(self, version: int) -> dict:
        """Collective: all ranks gather full tensors; rank 0 sends them to the engines."""
        state = self.backend.full_state(getattr(torch, self.cfg.model.dtype))
        if self.rank != 0:
            for _ in state:
                pass
            return {}
        # Outside sync mode the engines are generating: pause them around the update.
        return self.sender.send(engine_stream(state, self.cfg, self.backend.args), version,
                                pause=self.cfg.rollout.mode != "sync")

    def preemption_requested(self) -> bool:
        """Rank 0 looks for control/CHECKPOINT (the Slurm driver writes it on USR2); all ranks agree."""
        flag = 1.0 if self.rank == 0 and self.layout.checkpoint_requested() else 0.0
        (flag,) = all_reduce([flag], self.device, op=dist.ReduceOp.MAX)
        return flag > 0

    # ---- logs, checkpoints, the end ------------------------------------------------------------------
    def log_step(self, step: int, commit: dict, train: dict, perf: dict, sync: dict) -> None:
        evals = self.eval_metrics(step)
        if self.rank != 0:
            return
        rollout = commit.get("rollout", {})
        record = {"step": step, "weights/version": step + 1, **rollout, **train, **perf, **evals}
        record.update(memory_metrics(self.device, self.engine_peak_memory))
        if sync:
            record["weights/bytes"] = sync["bytes"]
            record["weights/buckets"] = sync["buckets"]
            record["weights/gbps"] = sync["bytes"] / max(sync["seconds"], 1e-9) / 1e9
            record["weights/engine_pause_s"] = sync.get("pause_s", 0.0)
        self.metrics.write(record)

    def eval_metrics(self, step: int) -> dict:
        """eval/* for step `step`'s record: of weights version `step` (the rollout side evaluates it before
        committing step `step`'s rollouts, so it is there), or, in the last record, of the final weights,
        evaluated once the engines hold them: every rank waits for that one (a file, no collective), so
        the checkpoint save after it does not wait out dist_timeout_s."""
        version = self.cfg.eval.version_in_record(step, self.cfg.num_rollout)
        if version is None:
            return {}
        if version == self.cfg.num_rollout:
            summary = self.layout.wait_eval(version, timeout_s=self.cfg.rollout.request_timeout_s * 50)
        else:
            summary = self.layout.eval_step(version).summary()
        return summary["metrics"] if summary else {}

    def engine_peak_memory(self) -> list:
        """The built-in engines' peak GPU memory (their /server_info reports it); [] when not known now."""
        if self.cfg.engine.type != "local" or self.sender is None:
            return []
        try:
            return [c.request("GET", "/server_info").get("peak_memory_reserved_gib") for c in self.sender.clients]
        except EngineError:  # an engine is being restarted: no reading this step
            return []

    def collect_consumed(self, step: int) -> None:
        """buffer.keep_consumed=false: delete trained-on rollout steps a resume will not train again:
        those before the last checkpoint (a restarted trainer re-trains from it), and never the newest
        committed step (it holds the rollout side's state: prompt cursor, unfinished groups)."""
        if self.cfg.buffer.keep_consumed or self.rank != 0:
            return
        upto = min(step, self.checkpointed)
        for done in range(self.collected, upto):
            remove_step(self.layout.buffer, done)
        self.collected = max(self.collected, upto)

    def save_or_stop(self, done_steps: int) -> bool:
        """Checkpoint on schedule; on a pre-emption request checkpoint (once) and tell the driver.
        True: stop here for the requeue."""
        if self.should_save(done_steps):
            self.save(done_steps)
        if done_steps < self.cfg.num_rollout and self.preemption_requested():
            if not self.should_save(done_steps):
                self.save(done_steps)
            if self.rank == 0:
                self.metrics.close()
                self.layout.publish_checkpoint_done(done_steps)
            log.info("checkpointed at step %d on request; exiting for requeue", done_steps)
            return True
        return False

    def should_save(self, done_steps: int) -> bool:
        k = self.cfg.checkpoint.save_interval
        return (self.cfg.checkpoint.save_final and done_steps == self.cfg.num_rollout) or (k > 0 and done_steps % k == 0)

    def save(self, done_steps: int) -> None:
        checkpoint.save_backend(self.layout.root, done_steps, self.backend, self.cfg.checkpoint.keep_last)
        self.checkpointed = done_steps

    def finish(self) -> None:
        if self.cfg.checkpoint.export_hf:
            state = dict(self.backend.full_state(getattr(torch, self.cfg.model.dtype)))
            if self.rank == 0:
                save_hf(state, self.cfg, self.backend.args, self.layout.hf_export, self.layout.model_dir(self.cfg))
        if self.rank == 0:
            self.metrics.close()
            self.layout.request_stop()
            if self.sender:
                self.sender.close()


def step_times(t: list[float]) -> dict[str, float]:
    """perf/* of a step from its four instants: start, rollouts in, trained, engines updated."""
    return {"perf/step_time_s": t[3] - t[0], "perf/rollout_time_s": t[1] - t[0], "perf/train_time_s": t[2] - t[1],
            "perf/weight_sync_time_s": t[3] - t[2]}


def main(run_dir: str, trainer_cls: type[Trainer] = Trainer) -> None:
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
        trainer_cls(cfg, run_dir, clock).run()
        dist.barrier()  # leave together: no rank ends the group while another is in a collective (rank 0's export)
    finally:
        dist.destroy_process_group()
