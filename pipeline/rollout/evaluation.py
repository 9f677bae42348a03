"""Evaluation on held-out prompts: eval sets -> engines -> rewards -> per-sample JSONL + eval/<name>/* metrics.

The rollout manager runs it on the engines between steps (eval.interval; in sync mode on weights
version K just before step K's rollouts, so it pauses nothing: the trainer is waiting for them), and
`lockstep eval` runs it alone on a started engine. Both write one evaluation directory (RunDir's
EvalDir): `<name>.jsonl` per set, atomically, then `summary.json`, published last, which marks the
evaluation complete; a rerun (resume) skips an evaluation whose summary is there, so records are
neither lost nor doubled.

Rows, input_key / label_key and reward functions are the training data's (an eval set may name its
own rm_type, input_key and label_key). Sampling seeds are a pure function of (rollout_seed, set name, step, prompt, sample), so
an evaluation is reproducible and independent of batching and of which engine answers.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from concurrent.futures import Executor, ThreadPoolExecutor

from pipeline.algo.eval_metrics import ScoredSample, eval_summary
from pipeline.config.schema import RunConfig
from pipeline.models.tokenizer import Tokenizer
from pipeline.rollout import protocol
from pipeline.rollout.client import EnginePool, Generation
from pipeline.rollout.data import Prompt
from pipeline.rollout.eval_data import EvalSet, load_eval_sets
from pipeline.rollout.rewards import score
from pipeline.run import EvalDir
from pipeline.utils.fs import atomic_write_bytes

log = logging.getLogger("lockstep.eval")


def eval_seed(rollout_seed: int, name: str, step: int, prompt: int, sample: int) -> int:
    """The sampling seed of one eval response: a pure function of the run's seed, the set, the step
    evaluated, the prompt and the sample (the set's name through CRC-32: stable across processes)."""
    x = ((rollout_seed * 1_000_003 + zlib.crc32(name.encode())) * 1_000_033 + step) * 1_000_037 + prompt
    return (x * 1_009 + sample) % (1 << 62)


class Evaluator:
    """Generates and scores every eval set on an engine pool; writes one evaluation directory."""

    def __init__(self, cfg: RunConfig, tokenizer: Tokenizer, pool: EnginePool, executor: Executor | None = None,
                 sets: list[EvalSet] | None = None):
        self.cfg, self.tokenizer, self.pool = cfg, tokenizer, pool
        self.executor = executor or ThreadPoolExecutor(max_workers=32, thread_name_prefix="eval")
        self.sets = load_eval_sets(cfg, tokenizer) if sets is None else sets
        for s in self.sets:
            log.info("eval set %s: %s (%d prompts evaluated)", s.name, s.stats.report(), len(s.prompts))

    def sampling(self) -> dict:
        """Eval sampling settings (null ones fall back to the rollout's)."""
        e, r = self.cfg.eval, self.cfg.rollout
        return {"max_new_tokens": e.max_response_len or r.rollout_max_response_len,
                "temperature": r.rollout_temperature if e.temperature is None else e.temperature,
                "top_p": e.top_p or r.rollout_top_p, "top_k": r.rollout_top_k}

    def evaluate(self, step: int, out: EvalDir, min_version: int = 0) -> dict:
        """Evaluate every set on the engines' weights (version >= min_version); write out/<name>.jsonl
        for each, then out/summary.json. Returns the eval/<name>/* metrics."""
        t0 = time.monotonic()
        os.makedirs(out.root, exist_ok=True)
        metrics: dict[str, float] = {}
        for s in self.sets:
            rows, scored = self.run_set(s, step, min_version)
            atomic_write_bytes(out.samples(s.name), "".join(json.dumps(r) + "\n" for r in rows).encode())
            for key, value in eval_summary(scored, self.cfg.eval.n_samples_per_prompt).items():
                metrics[f"eval/{s.name}/{key}"] = value
        metrics["eval/time_s"] = time.monotonic() - t0
        out.publish_summary({"step": step, "metrics": metrics, "sampling": self.sampling(),
                             "n_samples_per_prompt": self.cfg.eval.n_samples_per_prompt,
                             "sets": {s.name: out.samples(s.name) for s in self.sets}})
        log.info("eval of weights at step %d: %s (%.1fs)", step, ", ".join(
            f"{s.name} pass@1 {metrics[f'eval/{s.name}/pass@1']:.3f}" for s in self.sets), metrics["eval/time_s"])
        return metrics

    def run_set(self, s: EvalSet, step: int, min_version: int) -> tuple[list[dict], list[ScoredSample]]:
        n = self.cfg.eval.n_samples_per_prompt
        results = list(self.executor.map(lambda i: self.run_prompt(s, step, i, n, min_version), range(len(s.prompts))))
        rows = [row for part in results for row, _ in part]
        scored = [sc for part in results for _, sc in part]
        return rows, scored

    def run_prompt(self, s: EvalSet, step: int, i: int, n: int, min_version: int) -> list[tuple[dict, ScoredSample]]:
        """One prompt's n responses in one request (token ids in and out), scored."""
        p = s.prompts[i]
        seeds = [eval_seed(self.cfg.rollout.rollout_seed, s.name, step, i, j) for j in range(n)]
        sp = self.sampling()
        params = [protocol.sampling_params(max_new_tokens=sp["max_new_tokens"], temperature=sp["temperature"],
                                           top_p=sp["top_p"], top_k=sp["top_k"], seed=seed) for seed in seeds]
        gens = self.pool.generate([list(p.input_ids)] * n, params, min_version=min_version, return_logprob=False,
                                  rid=[f"eval{step}-{s.name}-{i}-{j}" for j in range(n)], session=f"eval-{i}")
        return [self.to_row(s, i, j, p, gen, seeds[j]) for j, gen in enumerate(gens)]

    def to_row(self, s: EvalSet, i: int, j: int, p: Prompt, gen: Generation, seed: int) -> tuple[dict, ScoredSample]:
        text = self.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
        reward, comps, error = score(s.reward_fn, text, p.label, p.metadata)
        version = gen.weight_version if gen.weight_version is not None else 0
        row = {"prompt_idx": i, "sample": j, "prompt": p.text, "label": p.label, "response": text,
               "response_ids": list(gen.output_ids), "response_len": len(gen.output_ids), "reward": reward,
               "finish_reason": gen.finish_reason, "weight_version": version, "seed": seed}
        if comps:
            row["reward_components"] = comps
        if error:
            row["reward_error"] = error
        return row, ScoredSample(prompt=i, reward=reward, response_len=len(gen.output_ids),
                                 truncated=gen.finish_reason == "length", weight_version=version)
