"""The metric sinks a run's config asks for, behind one MetricSink: metrics.jsonl always, TensorBoard
(logging.tensorboard) and Weights & Biases (logging.wandb.enabled) beside it. Trainer rank 0 opens
them once it knows the step it starts from, writes one record per step and closes them at the end.
"""

from __future__ import annotations

from pipeline.config.schema import RunConfig
from pipeline.observability.base import MetricSink
from pipeline.observability.metrics import JsonlSink


class MetricSinks:
    """Every record to every sink, in order (metrics.jsonl first: it is the record of the run)."""

    def __init__(self, sinks: list[MetricSink]):
        self.sinks = sinks

    def write(self, record: dict, step: int | None = None) -> None:
        """step: the record's own "step" when not given (the trainer's records carry it)."""
        step = record["step"] if step is None else step
        for sink in self.sinks:
            sink.write(record, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_sinks(cfg: RunConfig, run_dir: str, start_step: int = 0) -> MetricSinks:
    """start_step: the first step this start runs (a resume re-runs steps >= it; each sink says how
    it treats what it already held for them)."""
    from pipeline.observability.miles_names import MILES_ALIASES

    log = cfg.logging
    aliases = MILES_ALIASES if log.miles_aliases else None
    sinks: list[MetricSink] = [JsonlSink(run_dir, start_step)]
    if log.tensorboard:
        from pipeline.config import dump_config
        from pipeline.observability.tensorboard_sink import TensorBoardSink

        sinks.append(TensorBoardSink(run_dir, start_step, dump_config(cfg), aliases))
    if log.wandb.enabled:
        from pipeline.config.core import to_dict
        from pipeline.observability.wandb_sink import WandbSink

        sinks.append(WandbSink(log.wandb, run_dir, to_dict(cfg), aliases))
    return MetricSinks(sinks)
