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
from pipeline.models.hf_io import read_model_args
from pipeline.models.tokenizer import load_tokenizer
from pipeline.rollout import protocol
from pipeline.rollout.client import EnginePool, Generation
from pipeline.rollout.data import Prompt, PromptDataset
from pipeline.rollout.evaluation import Evaluator
from pipeline.rollout.filters import resolve_filter
from pipeline.rollout.rewards import resolve_reward, score
from pipeline.rollout.tito import check_sample, token_hash
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
        self.dataset = PromptDataset(cfg.data, self.tokenizer, seed=cfg.rollout.rollout_seed)
        log.info("%s", self.dataset.stats.report())
        self.reward_fn = resolve_reward(cfg.rollout.rm_type)
        self.keep = resolve_filter(cfg.rollout.dynamic_sampling_filter)
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
        """Generate (or continue) the group's samples and score the finished ones."""
        cfg = self.cfg.rollout
        n = cfg.n_samples_per_prompt
        if not g.samples:
            g.samples = [None] * n
        todo = [i for i in range(n) if g.samples[i] is None or g.samples[i].status == SampleStatus.ABORTED]
        inputs, params = [], []
        for i in todo:
            prior = g.samples[i]
            done_len = len(prior.response_ids) if prior else 0
            inputs.append(list(g.prompt.input_ids) + (list(prior.response_ids) if prior else []))
            params.append(protocol.sampling_params(
                max_new_tokens=cfg.rollout_max_response_len - done_len, temperature=cfg.rollout_temperature,
                top_p=cfg.rollout_top_p, top_k=cfg.rollout_top_k,
                seed=sampling_seed(cfg.rollout_seed, step, g.group_id, i)))
        moe_shape = (len(self.args.moe_layers), self.args.num_experts_per_tok) if self.record_routing else None
        gens = self.pool.generate(inputs, params, min_version=version, return_logprob=True,
                                  return_routed_experts=self.record_routing,
                                  moe_shape=moe_shape, rid=[f"s{step}-g{g.group_id}-{i}" for i in todo],
                                  session=f"g{g.group_id}") if todo else []
        for i, gen in zip(todo, gens):
            g.samples[i] = self.to_sample(g, i, gen, g.samples[i])
        return g

    def to_sample(self, g: Group, i: int, gen: Generation, prior: Sample | None) -> Sample:
        cfg = self.cfg.rollout
        response = (list(prior.response_ids) if prior else []) + list(gen.output_ids)
        logprobs = (list(prior.logprobs) if prior else []) + list(gen.logprobs)
        version = gen.weight_version if gen.weight_version is not None else 0
        mask = [1] * len(response)
        if prior is not None:
            old_mask = list(prior.loss_mask)
            if cfg.mask_offpolicy_in_partial_rollout and prior.weight_version < version:
                old_mask = [0] * len(old_mask)  # generated by an older policy
            mask = old_mask + [1] * len(gen.output_ids)
            version = min(version, prior.weight_version)
        status = FINISH_TO_STATUS.get(gen.finish_reason, SampleStatus.COMPLETED)
        meta = dict(g.prompt.metadata, draw=g.draw)
        meta["token_hash"] = token_hash(list(g.prompt.input_ids) + response)
        if gen.spec_verify_ct:  # tokens after the prefill's first came from this many verify forwards
            meta["spec"] = [len(gen.output_ids) - 1, gen.spec_verify_ct]
        reward, comps = 0.0, {}
        if status != SampleStatus.ABORTED:
            # The reward sees text; training sees the token ids exactly as generated (TITO).
            text = self.tokenizer.decode(response, skip_special_tokens=True)
            reward, comps, error = score(self.reward_fn, text, g.prompt.label, g.prompt.metadata)
            if error:
                status, meta["reward_error"] = SampleStatus.FAILED, error
            if cfg.tito_checks:
                report = check_sample(g.prompt.input_ids, response, self.tokenizer, [self.tokenizer.eos_token_id],
                                      g.prompt.text)
                if report.issues:
                    meta["tito"] = report.issues
        return Sample(group_id=g.group_id, sample_idx=i, prompt_idx=g.prompt.index, prompt_ids=list(g.prompt.input_ids),
                      response_ids=response, logprobs=logprobs, reward=reward, reward_components=comps,
                      weight_version=version, status=status, metadata=meta, loss_mask=mask,
                      routed_experts=gen.routed_experts)

    # ---- commit ----------------------------------------------------------------------------------------
    def commit(self, step: int, version: int, kept: list[Group], filtered: list[int], dropped: list[int],
               elapsed: float) -> dict:
        trained = [s for g in kept for s in g.samples]
        waiting = [s for g in self.pending for s in g.samples]
        batch = RolloutBatch.from_samples(trained + waiting, num_experts=self.args.num_experts)
        summary = self.summarize(RolloutBatch.from_samples(trained) if trained else batch, trained, elapsed)
        summary["rollout/request_retries"] = self.pool.retries  # cumulative: requests re-issued after an engine failed
        summary["data/rows_skipped"] = sum(self.dataset.stats.skipped.values())
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
        }


def main(run_dir: str, producer_rank: int = 0, num_producers: int = 1) -> None:
    cfg = load_resolved(run_dir)
    manager = RolloutManager(cfg, run_dir, producer_rank, num_producers)
    try:
        manager.run()
    finally:
        if manager.router is not None:
            manager.router.stop()


def spec_summary(samples: list[Sample]) -> dict:
    """Speculative decoding: decoded tokens per verify forward (1.0 = no draft accepted)."""
    spec = [s.metadata["spec"] for s in samples if "spec" in s.metadata]
    rounds = sum(v for _, v in spec)
    return {"rollout/spec_accept_length": sum(t for t, _ in spec) / rounds} if rounds else {}
