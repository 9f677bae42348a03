"""The rollout manager: prompts -> engines (/generate, token ids in and out) -> rewards -> HDF5 shard.

Runs as its own process (on the first rollout node under Slurm). Rollout step k may start once the
trainer has published weight version >= k - staleness (sync: 0, one_step_off: 1, fully_async: N).
Per step it keeps `over_sampling_batch_size` groups (one prompt, n samples) in flight on the
least-loaded engines; as a group finishes it is scored (off the critical path, in the group's thread)
and filtered; once rollout_batch_size groups are kept the surplus is aborted. Aborted groups are
written into the step's shard as `aborted` (partial) / `deferred` (finished) samples and, with
partial_rollout, continued next step from their tokens. Everything the next step needs (the prompt
cursor, the unfinished groups) is in the committed shard, so a restart loses nothing.

With eval.interval, rank 0 also evaluates the held-out sets (evaluation.py) on the weights it was
given, before the step's rollouts: weights version K in sync mode (the trainer waits for step K
meanwhile, nothing else runs), whatever version is current in the async modes (the samples record
it), and version num_rollout after the last step.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

from pipeline.buffer.reader import BufferReader
from pipeline.buffer.schema import RolloutBatch, Sample, SampleStatus
from pipeline.buffer.writer import ShardWriter, WriteOptions, clean_uncommitted
from pipeline.config import load_resolved
from pipeline.config.schema import RunConfig
from pipeline.models.hf_config import read_model_args
from pipeline.models.tokenizer import load_tokenizer
from pipeline.rollout.base import RolloutSample, TurnAborted
from pipeline.rollout.client import EnginePool
from pipeline.rollout.data import Prompt, PromptDataset
from pipeline.rollout.evaluation import Evaluator
from pipeline.rollout.filters import resolve_filter, zero_std_metrics
from pipeline.rollout.functions import resolve_generate_fn, run_generate_fn
from pipeline.rollout.handle import PoolHandle
from pipeline.rollout.rewards import label_for, resolve_reward, score
from pipeline.rollout.tito import check_turns, compare_calls, token_hash
from pipeline.rollout.trajectory import (Trajectory, assemble_routing, calls_from_record, generated_mask,
                                         offpolicy_mask)
from pipeline.run import RunDir

log = logging.getLogger("lockstep.rollout")

FINISH_TO_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}
WAITING = (SampleStatus.ABORTED, SampleStatus.DEFERRED)  # in the shard for their group, not trained on yet


def defer(s: Sample) -> Sample:
    """A finished sample of a group that waits for the next step (its status is kept in metadata)."""
    if s.status in WAITING:
        return s
    return replace(s, status=SampleStatus.DEFERRED, metadata=dict(s.metadata, final_status=s.status.label))


def undefer(s: Sample) -> Sample:
    if s.status != SampleStatus.DEFERRED:
        return s
    meta = dict(s.metadata)
    return replace(s, status=SampleStatus.from_label(meta.pop("final_status", "completed")), metadata=meta)


def mask_older(s: Sample, version: int) -> Sample:
    """Zero the loss mask of the turns a sample carried over from weights older than the step's `version`
    (a continued partial rollout's earlier turns, a deferred sample's whole response): off-policy tokens
    do not count (rollout.mask_offpolicy_in_partial_rollout), so true on-policy holds for the rest."""
    p = len(s.prompt_ids)
    old = [(a, b) for a, b, v, _ in s.metadata.get("turns", ()) if v < version]
    if not old:
        return s
    mask = list(s.loss_mask)
    for a, b in old:
        mask[a - p:b - p] = [0] * (b - a)
    return replace(s, loss_mask=mask)


def sampling_seed(rollout_seed: int, step: int, group: int, sample: int) -> int:
    """A per-sample seed that depends only on (seed, step, group, sample): reproducible and batch-free."""
    x = (rollout_seed * 1_000_003 + step) * 1_000_033 + group
    return (x * 1_009 + sample) % (1 << 62)


@dataclass
class Group:
    """One prompt's n samples, as far as they got. `draw` is the prompt's position in the data stream."""

    group_id: int
    draw: int
    prompt: Prompt
    samples: list[Sample] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return bool(self.samples) and all(s is not None and s.status != SampleStatus.ABORTED for s in self.samples)


class RolloutManager:
    def __init__(self, cfg: RunConfig, run_dir: str, producer_rank: int = 0, num_producers: int = 1):
        self.cfg, self.rundir = cfg, RunDir(run_dir)
        self.rank, self.num_producers = producer_rank, num_producers
        model_dir = self.rundir.model_dir(cfg)
        self.args = read_model_args(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.dataset = PromptDataset(cfg.data, self.tokenizer, seed=cfg.rollout.rollout_seed,
                                     label_for=label_for(cfg.rollout.rm_type))
        log.info("%s", self.dataset.stats.report())
        self.reward_fn = resolve_reward(cfg.rollout.rm_type)
        self.keep = resolve_filter(cfg.rollout.dynamic_sampling_filter)
        self.generate_fn = resolve_generate_fn(cfg.rollout.generate_fn)
        urls = self.rundir.engine_urls(cfg.engine.num_engines, timeout_s=cfg.engine.startup_timeout_s)
        key = self.rundir.token()
        self.router = None
        if cfg.engine.router == "sglang_router":
            from pipeline.rollout.router import SglangRouter

            self.router = SglangRouter(cfg.engine.router_policy, api_key=key,
                                       log_path=self.rundir.log_file(f"router_{producer_rank}"))
            self.router.start(urls)
        self.pool = EnginePool(urls, timeout_s=cfg.rollout.request_timeout_s, max_retries=cfg.rollout.max_retries,
                               api_key=key, resolve=lambda: self.rundir.current_engine_urls(cfg.engine.num_engines),
                               retry_budget_s=cfg.rollout.retry_budget_s or None,
                               frontend=self.router.sync if self.router else None)
        self.writer = ShardWriter(self.rundir.buffer, producer_rank, num_producers, model_id=model_dir,
                                  opts=WriteOptions.from_config(cfg.buffer))
        self.reader = BufferReader(self.rundir.buffer)
        self.executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="rollout")
        self.sample_executor = ThreadPoolExecutor(max_workers=256, thread_name_prefix="sample")  # one per trajectory
        self.record_routing = self.args.is_moe and (cfg.determinism.routing_replay or cfg.determinism.record_routing)
        self.next_draw = producer_rank  # producer r draws r, r + P, r + 2P, ...
        self.pending: list[Group] = []
        self.evaluator = (Evaluator(cfg, self.tokenizer, self.pool, self.executor)
                          if cfg.eval.enabled and producer_rank == 0 else None)

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        if self.rank == 0:
            removed = clean_uncommitted(self.rundir.buffer)
            if removed:
                log.info("removed %d uncommitted leftovers from an earlier run", len(removed))
        step = self.restore()
        while step < self.cfg.num_rollout:
            version = self.rundir.wait_version(step - self.cfg.staleness)
            if version is None:
                log.info("stop requested; rollout manager exits")
                return
            self.evaluate(step, version)
            self.run_step(step, version)
            step += 1
        if self.evaluator and self.cfg.eval.due(step, self.cfg.num_rollout):  # after the last step
            version = self.rundir.wait_version(step)
            if version is not None:
                self.evaluate(step, version)
        log.info("all %d rollout steps committed; rollout manager exits", self.cfg.num_rollout)

    def evaluate(self, step: int, version: int) -> None:
        """Evaluate weights version >= `version` as the evaluation of step `step`, when due and not done
        yet (a restart skips what an earlier start completed)."""
        if self.evaluator is None or not self.cfg.eval.due(step, self.cfg.num_rollout):
            return
        out = self.rundir.eval_step(step)
        if out.summary() is not None:
            log.info("eval of step %d already complete (%s)", step, out.summary_file)
            return
        self.evaluator.evaluate(step, out, min_version=version)

    def restore(self) -> int:
        """Continue after the last committed step: its commit record holds the prompt cursor, its shard
        the unfinished groups."""
        steps = self.reader.committed_steps()
        if not steps:
            return 0
        last = steps[-1]
        state = self.reader.commit(last).get("rollout_state", {})
        self.next_draw = int(state.get("next_draw", (last + 1) * self.cfg.rollout.rollout_batch_size))
        batch = self.reader.read_step(last)
        self.pending = self.groups_from(batch, pending_only=True)
        log.info("resuming after committed step %d (next draw %d, %d unfinished groups)", last, self.next_draw,
                 len(self.pending))
        return last + 1

    def groups_from(self, batch: RolloutBatch, pending_only: bool) -> list[Group]:
        import json

        groups: dict[int, Group] = {}
        for i in range(len(batch)):
            status = SampleStatus(int(batch.status[i]))
            if pending_only and status not in WAITING:
                continue
            meta = json.loads(batch.metadata[i])
            gid = int(batch.group_id[i])
            prompt = self.dataset.prompts[int(batch.prompt_idx[i])]
            g = groups.setdefault(gid, Group(gid, int(meta.get("draw", -1)), prompt))
            p = int(batch.prompt_len[i])
            g.samples.append(Sample(
                group_id=gid, sample_idx=int(batch.sample_idx[i]), prompt_idx=int(batch.prompt_idx[i]),
                prompt_ids=batch.sequence(i)[:p].tolist(), response_ids=batch.sequence(i)[p:].tolist(),
                logprobs=batch.logprobs[batch.response_slice(i)].tolist(), reward=float(batch.rewards[i]),
                weight_version=int(batch.weight_version[i]), status=status,
                metadata=meta, loss_mask=batch.loss_mask[batch.response_slice(i)].tolist(),
                routed_experts=batch.routing(i)))
        return list(groups.values())

    # ---- one step ------------------------------------------------------------------------------------
    def run_step(self, step: int, version: int) -> dict:
        t0 = time.monotonic()
        r = self.cfg.rollout
        target = r.rollout_batch_size // self.num_producers
        in_flight_max = (r.over_sampling_batch_size or r.rollout_batch_size) // self.num_producers
        max_draws = r.max_draws_per_step * r.rollout_batch_size
        queue = list(self.pending)
        self.pending = []
        kept: list[Group] = []
        filtered_draws: list[int] = []
        futures = {}
        draws = 0

        def submit_next() -> bool:
            nonlocal draws
            if queue:
                g = queue.pop(0)
            elif draws < max_draws:
                g = self.new_group(step)
                draws += 1
            else:
                return False
            futures[self.executor.submit(self.run_group, step, g, version)] = g
            return True

        while len(futures) < in_flight_max and submit_next():
            pass
        aborted = False
        while futures:
            done, _ = wait(list(futures), return_when=FIRST_COMPLETED)
            for f in done:
                g = futures.pop(f)
                g = f.result()
                if not g.finished or aborted or len(kept) >= target:
                    # Aborted mid-generation, or finished after the step was full: the next step
                    # takes it first. Its finished samples wait (deferred) with it.
                    g.samples = [defer(s) for s in g.samples]
                    self.pending.append(g)
                elif self.keep(g.samples):
                    g.samples = [undefer(s) for s in g.samples]
                    if r.mask_offpolicy_in_partial_rollout:
                        g.samples = [mask_older(s, version) for s in g.samples]
                    kept.append(g)
                else:
                    filtered_draws.append(g.draw)
                    submit_next()  # replace the filtered group with a new prompt
                if not aborted and len(kept) >= target:
                    aborted = True
                    if futures:
                        self.pool.abort_all()  # the surplus comes back partial
        if not r.partial_rollout:
            dropped = [g.draw for g in self.pending]
            self.pending = []
        else:
            dropped = []
        kept.sort(key=lambda g: g.draw)  # completion order varies; the shard's order must not
        self.pending.sort(key=lambda g: g.draw)
        return self.commit(step, version, kept, filtered_draws, dropped, time.monotonic() - t0)

    def new_group(self, step: int) -> Group:
        draw = self.next_draw
        self.next_draw += self.num_producers
        # The draw index is unique across producers and steps: it is the group id.
        return Group(group_id=draw, draw=draw, prompt=self.dataset.prompt_at(draw))

    def run_group(self, step: int, g: Group, version: int) -> Group:
        """Generate (or continue) the group's samples, each by the rollout function, and score them."""
        n = self.cfg.rollout.n_samples_per_prompt
        if not g.samples:
            g.samples = [None] * n
        todo = [i for i in range(n) if g.samples[i] is None or g.samples[i].status == SampleStatus.ABORTED]
        futures = [self.sample_executor.submit(self.run_sample, step, g, i, version) for i in todo]
        for i, f in zip(todo, futures):
            g.samples[i] = f.result()
        return g

    def run_sample(self, step: int, g: Group, i: int, version: int) -> Sample:
        """One sample through rollout.generate_fn; an aborted turn leaves a partial sample that resumes later."""
        cfg = self.cfg.rollout
        prior = g.samples[i]
        replay = None
        if prior is not None:
            replay = calls_from_record(list(prior.prompt_ids) + list(prior.response_ids), len(prior.prompt_ids),
                                       list(prior.logprobs), prior.routed_experts, prior.metadata.get("turns", []))
        moe_shape = (len(self.args.moe_layers), self.args.num_experts_per_tok) if self.record_routing else None
        handle = PoolHandle(self.pool, session=f"g{g.group_id}", rid=f"s{step}-g{g.group_id}-{i}",
                            temperature=cfg.rollout_temperature, top_p=cfg.rollout_top_p, top_k=cfg.rollout_top_k,
                            seed=sampling_seed(cfg.rollout_seed, step, g.group_id, i), min_version=version,
                            prompt_len=len(g.prompt.input_ids), max_response_len=cfg.rollout_max_response_len,
                            moe_shape=moe_shape, replay=replay)
        sample = RolloutSample(prompt_ids=list(g.prompt.input_ids), label=g.prompt.label,
                               metadata=dict(g.prompt.metadata), tokenizer=self.tokenizer, group_id=g.group_id,
                               sample_idx=i, prompt_text=g.prompt.text, max_response_len=cfg.rollout_max_response_len)
        try:
            traj = run_generate_fn(self.generate_fn, sample, handle)
        except TurnAborted:
            return self.partial_sample(g, i, handle)
        return self.to_sample(g, i, traj, handle)

    def partial_sample(self, g: Group, i: int, handle: PoolHandle) -> Sample:
        """An aborted trajectory as far as it got: the cut call's input and partial output, its calls recorded."""
        last = handle.calls[-1]
        tokens = last.input_ids + last.output_ids
        p = len(g.prompt.input_ids)
        traj = Trajectory(prompt_len=p, tokens=tokens, finish_reason="abort")
        gen = generated_mask(handle.calls, len(tokens))
        traj.loss_mask = gen[p:].tolist()
        traj.logprobs = [0.0] * (len(tokens) - p)
        for c in handle.calls:
            a, b = c.span
            traj.logprobs[a - p: b - p] = c.logprobs
        return self.to_sample(g, i, traj, handle)

    def to_sample(self, g: Group, i: int, traj: Trajectory, handle: PoolHandle) -> Sample:
        cfg = self.cfg.rollout
        calls, p = handle.calls, traj.prompt_len
        assert p == len(g.prompt.input_ids), "a trajectory starts with its sample's prompt (Trajectory.start)"
        over = len(traj.tokens) - p - cfg.rollout_max_response_len
        if over > 0:
            # Only environment ids appended after the last turn can be past the budget (the handle ends a
            # turn there): cut them, so the trainer's max_tokens_per_gpu holds. Nothing trains on them.
            assert not any(traj.loss_mask[-over:]), "generated tokens past rollout_max_response_len"
            del traj.tokens[-over:], traj.loss_mask[-over:], traj.logprobs[-over:]
            traj.metadata["env_tokens_cut"] = over
        response = traj.response_ids
        mask = list(traj.loss_mask)
        if cfg.mask_offpolicy_in_partial_rollout:
            mask = offpolicy_mask(calls, mask, p)  # tokens generated by an older policy do not count
        version = min((c.weight_version for c in calls), default=0)
        status = FINISH_TO_STATUS.get(traj.finish_reason, SampleStatus.COMPLETED)
        meta = dict(g.prompt.metadata, draw=g.draw, **traj.metadata)
        meta["token_hash"] = token_hash(traj.tokens)
        meta["turns"] = [c.record() for c in calls]  # [start, end, weight version, finish] per engine call
        meta["cached_tokens"] = sum(c.cached_tokens for c in calls if not c.replayed)
        meta["sent_tokens"] = sum(len(c.input_ids) for c in calls if not c.replayed)
        if handle.replay_diverged:
            meta["replay_diverged"] = True
        check = compare_calls(traj.tokens, p, traj.loss_mask, traj.logprobs, calls)
        if check.total:
            meta["tito_turn_mismatch"] = check.total
            meta["tito_turns"] = {"input": check.input_mismatches, "output": check.output_mismatches,
                                  "mask": check.mask_mismatches, "logprob": check.logprob_mismatches}
        spec = [c for c in calls if not c.replayed and c.spec_verify_ct]
        if spec:  # tokens after each prefill's first came from this many verify forwards
            meta["spec"] = [sum(len(c.output_ids) - 1 for c in spec), sum(c.spec_verify_ct for c in spec)]
        reward, comps = 0.0, dict(traj.reward_components)
        if status != SampleStatus.ABORTED:
            if traj.reward is not None:
                reward = float(traj.reward)
            else:
                # The reward sees text; training sees the token ids exactly as generated (TITO).
                text = self.tokenizer.decode(response, skip_special_tokens=True)
                reward, comps, error = score(self.reward_fn, text, g.prompt.label, g.prompt.metadata)
                if error:
                    status, meta["reward_error"] = SampleStatus.FAILED, error
            if cfg.tito_checks:
                report = check_turns(g.prompt.input_ids, response, [c.span for c in calls], self.tokenizer,
                                     [self.tokenizer.eos_token_id], g.prompt.text)
                if report.issues:
                    meta["tito"] = report.issues
        routed = None
        if self.record_routing:
            routed = assemble_routing(calls, len(traj.tokens), self.args.num_experts_per_tok)
        return Sample(group_id=g.group_id, sample_idx=i, prompt_idx=g.prompt.index, prompt_ids=list(g.prompt.input_ids),
                      response_ids=response, logprobs=list(traj.logprobs), reward=reward, reward_components=comps,
                      weight_version=version, status=status, metadata=meta, loss_mask=mask,
                      routed_experts=routed)

    # ---- commit ----------------------------------------------------------------------------------------
    def commit(self, step: int, version: int, kept: list[Group], filtered: list[int], dropped: list[int],
               elapsed: float) -> dict:
        trained = [s for g in kept for s in g.samples]
        waiting = [s for g in self.pending for s in g.samples]
        batch = RolloutBatch.from_samples(trained + waiting, num_experts=self.args.num_experts)
        summary = self.summarize(RolloutBatch.from_samples(trained) if trained else batch, trained, elapsed)
        summary["rollout/request_retries"] = self.pool.retries  # cumulative: requests re-issued after an engine failed
        summary["data/rows_skipped"] = sum(self.dataset.stats.skipped.values())
        summary.update(zero_std_metrics([g.samples for g in kept]))
        summary.update({"rollout/groups_kept": len(kept), "rollout/groups_filtered": len(filtered),
                        "rollout/groups_pending": len(self.pending), "rollout/groups_dropped": len(dropped),
                        "rollout/weight_version": version})
        self.writer.write(step, batch, attrs={"weight_version_at_start": version}, summary=summary)
        if self.rank == 0:
            state = {"next_draw": self.next_draw, "filtered_draws": filtered, "dropped_draws": dropped,
                     "kept_draws": [g.draw for g in kept], "pending_draws": [g.draw for g in self.pending]}
            self.writer.commit(step, extra={"rollout": summary, "rollout_state": state})
        log.info("step %d (weights %d): %d groups kept, %d filtered, %d pending, reward %.3f, %.2fs", step, version,
                 len(kept), len(filtered), len(self.pending), summary["rollout/reward_mean"], elapsed)
        errors = [s.metadata["reward_error"] for s in trained if s.metadata.get("reward_error")]
        if errors:  # scored 0 and not trained on: say why, or the run only shows reward 0
            log.warning("step %d: the reward function failed on %d of %d samples (first: %s)", step, len(errors),
                        len(trained), errors[0])
        return summary

    @staticmethod
    def summarize(batch: RolloutBatch, samples: list[Sample], elapsed: float) -> dict:
        n = max(len(batch), 1)
        return {
            "rollout/reward_mean": float(batch.rewards.mean()) if len(batch) else 0.0,
            "rollout/reward_std": float(batch.rewards.std()) if len(batch) else 0.0,
            "rollout/response_len_mean": float(batch.response_len.mean()) if len(batch) else 0.0,
            "rollout/truncated_frac": float((batch.status == SampleStatus.TRUNCATED).sum()) / n,
            "rollout/reward_failed": int(sum(s.status == SampleStatus.FAILED for s in samples)),
            "rollout/num_samples": len(batch),
            "rollout/tokens": int(batch.response_len.sum()),
            "rollout/generate_time_s": elapsed,
            "rollout/tokens_per_s": float(batch.response_len.sum()) / max(elapsed, 1e-9),
            "rollout/weight_version_min": int(batch.weight_version.min()) if len(batch) else 0,
            **{f"rollout/tito_{kind}_frac": sum(kind in s.metadata.get("tito", ()) for s in samples) / n
               for kind in ("retokenize_drift", "alternate_eos", "special_token_in_response")},
            **spec_summary(samples),
            **turn_summary(samples),
            **{f"rollout/reward/{k}": float(v[v == v].mean()) for k, v in batch.reward_components.items()
               if len(batch) and (v == v).any()},
        }


def main(run_dir: str, producer_rank: int = 0, num_producers: int = 1) -> None:
    cfg = load_resolved(run_dir)
    manager = RolloutManager(cfg, run_dir, producer_rank, num_producers)
    try:
        manager.run()
    finally:
        if manager.router is not None:
            manager.router.stop()


def turn_summary(samples: list[Sample]) -> dict:
    """Multi-turn: engine calls per sample, TITO mismatches across turns (expected 0), prefix-cache hits."""
    n = max(len(samples), 1)
    sent = sum(s.metadata.get("sent_tokens", 0) for s in samples)
    cached = sum(s.metadata.get("cached_tokens", 0) for s in samples)
    return {
        "rollout/turns_mean": sum(len(s.metadata.get("turns", ())) for s in samples) / n,
        "rollout/tito_turn_mismatch": int(sum(s.metadata.get("tito_turn_mismatch", 0) for s in samples)),
        # samples whose ids drifted from what the engine consumed or produced (a decode and re-encode)
        "rollout/tito_turn_drift_frac": sum(any(s.metadata.get("tito_turns", {}).get(k) for k in ("input", "output"))
                                            for s in samples) / n,
        "rollout/prefix_cache_hit_rate": cached / sent if sent else 0.0,
        "rollout/masked_tokens_frac": (sum(len(s.loss_mask) - sum(s.loss_mask) for s in samples)
                                       / max(sum(len(s.loss_mask) for s in samples), 1)),
    }


def spec_summary(samples: list[Sample]) -> dict:
    """Speculative decoding: decoded tokens per verify forward (1.0 = no draft accepted)."""
    spec = [s.metadata["spec"] for s in samples if "spec" in s.metadata]
    rounds = sum(v for _, v in spec)
    return {"rollout/spec_accept_length": sum(t for t, _ in spec) / rounds} if rounds else {}
