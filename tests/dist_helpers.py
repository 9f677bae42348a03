"""Code that runs inside spawned gloo processes (importable, so torch.multiprocessing can pickle it)."""

from __future__ import annotations

import datetime
import os

import numpy as np
import torch
import torch.distributed as dist


def random_batch(vocab: int, n: int = 16, seed: int = 0):
    from pipeline.buffer.schema import RolloutBatch, Sample

    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        p, r = int(rng.integers(2, 7)), int(rng.integers(1, 5))
        samples.append(Sample(group_id=i // 4, sample_idx=i % 4, prompt_idx=i,
                              prompt_ids=rng.integers(4, vocab, p).tolist(),
                              response_ids=rng.integers(4, vocab, r).tolist(),
                              logprobs=(-rng.random(r) * 3).tolist(), reward=float(rng.random() > 0.5)))
    return RolloutBatch.from_samples(samples)


def train_one_step(rank: int, world: int, init_file: str, model_dir: str, run_dir: str, out: str,
                   overrides: list[str]) -> None:
    from pipeline.config import load_config
    from pipeline.trainer.loop import Trainer

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        cfg = load_config(None, [f"model.path={model_dir}", f"run_dir={run_dir}", "train.device=cpu",
                                 f"train.num_gpus={world}", *overrides])
        trainer = Trainer(cfg, run_dir)
        metrics = trainer.train_on(random_batch(trainer.backend.args.vocab_size))
        state = dict(trainer.backend.full_state())
        if rank == 0:
            torch.save({"state": state, "metrics": metrics}, out)
    finally:
        dist.destroy_process_group()
