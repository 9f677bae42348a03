"""TensorBoard event files under run_dir/tensorboard/ (a MetricSink; `tensorboard --logdir` reads them).

Written by torch's SummaryWriter, which needs only the `tensorboard` package. Each numeric key is a
scalar (stored as float32, TensorBoard's simple_value) at the record's step; strings are left out.
A resumed run opens the writer with purge_step = its first step: TensorBoard's readers then drop the
older files' events from that step on, so a re-run step has one value, the new one, as in
metrics.jsonl. The resolved config is a text summary at step 0, written once: a resume keeps it.
"""

from __future__ import annotations

from pipeline.observability.base import scalars
from pipeline.run import RunDir


def tensorboard_dir(run_dir: str) -> str:
    return RunDir(run_dir).tensorboard


class TensorBoardSink:
    def __init__(self, run_dir: str, start_step: int, config_yaml: str, aliases: dict[str, str] | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.aliases = aliases
        self.writer = SummaryWriter(log_dir=tensorboard_dir(run_dir), purge_step=start_step)
        if start_step == 0:
            # Markdown: an indented block keeps the YAML as written.
            self.writer.add_text("config", "\n".join("    " + line for line in config_yaml.splitlines()), 0)
            self.writer.flush()

    def write(self, record: dict, step: int) -> None:
        for key, value in scalars(record, self.aliases).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # as current as metrics.jsonl: a crash loses nothing already logged

    def close(self) -> None:
        self.writer.close()
