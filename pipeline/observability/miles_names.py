"""Miles' names for the metrics Lockstep and Miles both log, so a Miles dashboard, panel or comparison
finds them (TensorBoard and W&B get both names when logging.miles_aliases is on; metrics.jsonl keeps
ours). Only metrics with the same definition are listed; where the step and reduction differ, the
README's table says how. Sources: github.com/radixark/miles
  train/*    miles/backends/training_utils/loss_hub/losses.py (reported_loss keys), logged as
             train/<key> by miles/backends/training_utils/log_utils.py log_train_step; learning rates
             as lr-pg_<param group> by miles/backends/fsdp_utils/actor.py and megatron_utils/model.py
  rollout/*  raw_reward, response_lengths: log_utils.py log_rollout_data (per-sample means);
             truncated_ratio, weight_version/min: miles/ray/rollout/metrics.py _compute_metrics_from_samples
  perf/*     rollout_time: miles/ray/rollout/metrics.py (the rollout manager's generate);
             train_time, step_time, update_weights_time: miles/utils/train_metric_utils.py from the
             timers `train`, `update_weights` (miles/backends/*/actor.py)
"""

from __future__ import annotations

# Lockstep key -> Miles key
MILES_ALIASES: dict[str, str] = {
    "train/rollout_logprob_abs_diff": "train/train_rollout_logprob_abs_diff",
    "train/clipfrac": "train/pg_clipfrac",
    "train/entropy": "train/entropy_loss",
    "train/lr": "train/lr-pg_0",
    "rollout/reward_mean": "rollout/raw_reward",
    "rollout/response_len_mean": "rollout/response_lengths",
    "rollout/truncated_frac": "rollout/truncated_ratio",
    "rollout/weight_version_min": "rollout/weight_version/min",
    "rollout/generate_time_s": "perf/rollout_time",
    "perf/train_time_s": "perf/train_time",
    "perf/step_time_s": "perf/step_time",
    "perf/weight_sync_time_s": "perf/update_weights_time",
}
