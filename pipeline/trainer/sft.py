"""Supervised fine-tuning (algo.loss_type=sft_loss): the step loop of loop.py with the data file in the
rollout buffer's place and no engines.

Each step trains the next rollout_batch_size rows of the shuffled file (pipeline/rollout/sft_data.py),
built on every rank alike; planning, packing, the backend, checkpoints, metric sinks and the HF export
are the RL trainer's. The loss is the NLL of the response tokens (objective.supervised_loss). The data
cursor (rows drawn so far) is saved in each checkpoint, so a resumed run trains on exactly the rows
an uninterrupted one would, mid-epoch included, and ends with bit-identical weights.
"""

from __future__ import annotations

import logging

from pipeline.buffer.schema import RolloutBatch
from pipeline.config.schema import RunConfig
from pipeline.models.tokenizer import load_tokenizer
from pipeline.observability.startup import StartupClock
from pipeline.rollout.sft_data import SftDataset
from pipeline.trainer import checkpoint, loop

log = logging.getLogger("lockstep.trainer")


class SftTrainer(loop.Trainer):
    def __init__(self, cfg: RunConfig, run_dir: str, clock: StartupClock | None = None):
        super().__init__(cfg, run_dir, clock)
        tok = load_tokenizer(self.layout.model_dir(cfg))
        self.data = SftDataset(cfg.data, tok, seed=cfg.rollout.rollout_seed,
                               max_len=cfg.data.max_prompt_len + cfg.rollout.rollout_max_response_len)
        self.cursor = 0
        """Rows of the endless shuffled stream trained on so far."""

    def start(self) -> int:
        start = super().start()
        if start > 0:
            self.cursor = self.saved_cursor(start)
        return start

    def saved_cursor(self, step: int) -> int:
        data = checkpoint.read_state(self.layout.root, step).get("data")
        if data is None:  # a checkpoint of a run without one (RL): rows as the steps imply
            log.warning("checkpoint step %d holds no data cursor: continuing at row %d of the stream", step,
                        step * self.cfg.samples_per_step)
            return step * self.cfg.samples_per_step
        if data["rows"] != len(self.data):
            log.warning("the data file had %d usable rows when checkpoint step %d was saved and has %d now: the"
                        " order from here is not the one the first run would have had", data["rows"], step, len(self.data))
        return int(data["cursor"])

    def get_rollout(self, step: int, version: int) -> tuple[RolloutBatch, dict]:
        """The step's rows from the data file; data/epoch (epochs done after this step) beside them."""
        size = self.cfg.samples_per_step
        batch = self.data.batch_at(self.cursor, size)
        self.cursor += size
        return batch, {"rollout": {"data/epoch": self.cursor / len(self.data)}}

    def save(self, done_steps: int) -> None:
        checkpoint.save_backend(self.layout.root, done_steps, self.backend, self.cfg.checkpoint.keep_last,
                                extra={"data": {"cursor": self.cursor, "rows": len(self.data)}})

    # ---- no engines: nothing to connect, sync or compare with; no buffer to collect --------------------
    def connect_engines(self) -> None:
        pass

    def sync_weights(self, version: int) -> dict:
        return {}

    def update_engines(self, version: int) -> dict:
        return {}

    def engine_memory(self, action, tags=None) -> None:
        pass

    def check_on_policy(self, metrics: dict) -> None:
        pass

    def collect_consumed(self, step: int) -> None:
        pass


def main(run_dir: str) -> None:
    loop.main(run_dir, SftTrainer)
