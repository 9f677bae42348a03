"""The rollout manager: prompts -> engines (/generate, token ids in and out) -> rewards -> HDF5 shard.

Runs as its own process (on the first rollout node under Slurm). For each step the trainer requests
it draws the step's prompts, sends each prompt's group of n samples to the least-loaded engine (a
failed request is retried on another), scores rewards, and commits run_dir/buffer/step_K/.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

from pipeline.buffer.reader import BufferReader
from pipeline.buffer.schema import RolloutBatch, Sample
from pipeline.buffer.writer import ShardWriter, WriteOptions, clean_uncommitted
from pipeline.config import load_resolved
from pipeline.config.schema import RunConfig
from pipeline.launch import rendezvous as rdzv
from pipeline.launch.layout import RunLayout
from pipeline.models.hf_io import read_model_args
from pipeline.models.tokenizer import load_tokenizer
from pipeline.rollout.client import EnginePool, Generation
from pipeline.rollout.data import Prompt, PromptDataset
from pipeline.rollout.rewards import resolve_reward, score
from pipeline.rollout.tito import check_sample, token_hash

log = logging.getLogger("lockstep.rollout")

FINISH_TO_STATUS = {"stop": "completed", "length": "truncated", "abort": "aborted"}


def sampling_seed(rollout_seed: int, step: int, group: int, sample: int) -> int:
    """A per-sample seed that depends only on (seed, step, group, sample): reproducible and batch-free."""
    x = (rollout_seed * 1_000_003 + step) * 1_000_033 + group
    return (x * 1_009 + sample) % (1 << 62)


class RolloutManager:
    def __init__(self, cfg: RunConfig, run_dir: str, producer_rank: int = 0, num_producers: int = 1):
        self.cfg, self.layout = cfg, RunLayout(run_dir)
        self.rank, self.num_producers = producer_rank, num_producers
        model_dir = self.layout.model_dir(cfg)
        self.args = read_model_args(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.dataset = PromptDataset(cfg.data, self.tokenizer, seed=cfg.rollout.rollout_seed)
        self.reward_fn = resolve_reward(cfg.rollout.rm_type)
        urls = rdzv.engine_urls(run_dir, cfg.engine.num_engines)
        self.pool = EnginePool(urls, timeout_s=cfg.rollout.request_timeout_s, max_retries=cfg.rollout.max_retries,
                               api_key=os.environ.get("LOCKSTEP_API_KEY"))
        self.writer = ShardWriter(self.layout.buffer, producer_rank, num_producers, model_id=model_dir,
                                  opts=WriteOptions.from_config(cfg.buffer))
        self.executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="rollout")
        self.record_routing = self.args.is_moe and (cfg.determinism.routing_replay or cfg.determinism.record_routing)

    def run(self) -> None:
        removed = clean_uncommitted(self.layout.buffer) if self.rank == 0 else []
        if removed:
            log.info("removed %d uncommitted leftovers from an earlier run", len(removed))
        step = 0
        while True:
            request = rdzv.wait_step_request(self.layout.root, step)
            if request is None:
                log.info("stop requested; rollout manager exits")
                return
            step = int(request["step"])
            if BufferReader(self.layout.buffer).is_committed(step):
                # Generated before a restart by the same weights version (training is deterministic).
                log.info("step %d already committed; reusing it", step)
            else:
                self.run_step(step, int(request["weight_version"]))
            step += 1

    def run_step(self, step: int, version: int) -> dict:
        t0 = time.monotonic()
        cfg = self.cfg.rollout
        prompts = self.dataset.batch(step, cfg.rollout_batch_size)[self.rank:: self.num_producers]
        first_group = step * cfg.rollout_batch_size + self.rank
        futures = [self.executor.submit(self.generate_group, step, first_group + j * self.num_producers, p, version)
                   for j, p in enumerate(prompts)]
        samples = [s for f in futures for s in f.result()]
        batch = RolloutBatch.from_samples(samples, num_experts=self.args.num_experts)
        elapsed = time.monotonic() - t0
        summary = self.summarize(batch, samples, elapsed)
        self.writer.write(step, batch, attrs={"weight_version_requested": version}, summary=summary)
        if self.rank == 0:
            self.writer.commit(step, extra={"rollout": summary})
        log.info("step %d: %d samples, reward %.3f, %.2fs", step, len(batch), summary["rollout/reward_mean"], elapsed)
        return summary

    def generate_group(self, step: int, group: int, prompt: Prompt, version: int) -> list[Sample]:
        cfg = self.cfg.rollout
        n = cfg.n_samples_per_prompt
        params = [{
            "max_new_tokens": cfg.rollout_max_response_len,
            "temperature": cfg.rollout_temperature,
            "top_p": cfg.rollout_top_p,
            "top_k": cfg.rollout_top_k,
            "sampling_seed": sampling_seed(cfg.rollout_seed, step, group, i),
            "no_stop_trim": True,
            "skip_special_tokens": False,
        } for i in range(n)]
        moe_shape = (len(self.args.moe_layers), self.args.num_experts_per_tok) if self.record_routing else None
        gens = self.pool.generate([prompt.input_ids] * n, params, return_logprob=True,
                                  return_routed_experts=self.record_routing, moe_shape=moe_shape,
                                  rid=[f"s{step}-g{group}-{i}" for i in range(n)])
        return [self.to_sample(group, i, prompt, g) for i, g in enumerate(gens)]

    def to_sample(self, group: int, i: int, prompt: Prompt, gen: Generation) -> Sample:
        # The reward sees text; training sees gen.output_ids exactly as generated (TITO).
        text = self.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
        reward, comps, error = score(self.reward_fn, text, prompt.label, prompt.metadata)
        status = "failed" if error else FINISH_TO_STATUS.get(gen.finish_reason, "completed")
        meta = dict(prompt.metadata)
        meta["token_hash"] = token_hash(list(prompt.input_ids) + list(gen.output_ids))
        if self.cfg.rollout.tito_checks:
            report = check_sample(prompt.input_ids, gen.output_ids, self.tokenizer, [self.tokenizer.eos_token_id],
                                  prompt.text)
            if report.issues:
                meta["tito"] = report.issues
        if error:
            meta["reward_error"] = error
        return Sample(group_id=group, sample_idx=i, prompt_idx=prompt.index, prompt_ids=prompt.input_ids,
                      response_ids=gen.output_ids, logprobs=gen.logprobs, reward=reward, reward_components=comps,
                      weight_version=int(gen.weight_version or 0), status=status, metadata=meta,
                      routed_experts=gen.routed_experts)

    @staticmethod
    def summarize(batch: RolloutBatch, samples: list[Sample], elapsed: float) -> dict:
        n = max(len(batch), 1)
        return {
            "rollout/reward_mean": float(batch.rewards.mean()) if len(batch) else 0.0,
            "rollout/reward_std": float(batch.rewards.std()) if len(batch) else 0.0,
            "rollout/response_len_mean": float(batch.response_len.mean()) if len(batch) else 0.0,
            "rollout/truncated_frac": float((batch.status == 1).sum()) / n,
            "rollout/reward_failed": int(sum(s.status == "failed" for s in samples)),
            "rollout/num_samples": len(batch),
            "rollout/tokens": int(batch.response_len.sum()),
            "rollout/generate_time_s": elapsed,
            "rollout/tokens_per_s": float(batch.response_len.sum()) / max(elapsed, 1e-9),
            "rollout/weight_version_min": int(batch.weight_version.min()) if len(batch) else 0,
            **{f"rollout/tito_{kind}_frac": sum(kind in s.metadata.get("tito", ()) for s in samples) / n
               for kind in ("retokenize_drift", "alternate_eos", "special_token_in_response")},
        }


def main(run_dir: str, producer_rank: int = 0, num_producers: int = 1) -> None:
    cfg = load_resolved(run_dir)
    RolloutManager(cfg, run_dir, producer_rank, num_producers).run()
