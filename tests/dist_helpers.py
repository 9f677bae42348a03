"""Code that runs inside spawned gloo processes (importable, so torch.multiprocessing can pickle it)."""

from __future__ import annotations

import contextlib
import datetime
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.utils.proc import exit_without_finalizing


def spawn(fn, world: int, init_file: str, *args) -> None:
    """Run fn(rank, world, init_file, *args) in `world` spawned processes; raises if one fails."""
    mp.start_processes(_entry, nprocs=world, start_method="spawn", args=(fn, world, init_file, *args))


def _entry(rank: int, fn, world: int, init_file: str, *args) -> None:
    fn(rank, world, init_file, *args)
    exit_without_finalizing(0)  # as a trainer process: gloo's threads may still free tensors (see there)


@contextlib.contextmanager
def gloo_group(rank: int, world: int, init_file: str):
    """The default process group of this spawned process, on gloo; every rank leaves it at a barrier
    (none ends it while another is still in a collective: rank 0 saves results after the last one)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


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
    from pipeline.trainer.fsdp import full_state
    from pipeline.trainer.loop import Trainer

    os.environ["LOCAL_RANK"] = str(rank)
    with gloo_group(rank, world, init_file):
        cfg = load_config(None, [f"model.path={model_dir}", f"run_dir={run_dir}", "train.device=cpu",
                                 f"train.num_gpus={world}", *overrides])
        trainer = Trainer(cfg, run_dir)
        metrics = trainer.train_step(random_batch(trainer.backend.args.vocab_size))
        b = trainer.backend
        state = {n: t.clone() for n, t in b.full_state()}  # parameter by parameter (on one rank: the parameters)
        # the weight sync's export: flat buckets in the forward's dtype (small ones here: several buckets)
        flat = [list(full_state(b.model, b.args, b.compute_dtype, bucket_bytes=bb)) for bb in (512 << 20, 4096)]
        # the export's plan is kept between syncs: an in-place update (what the optimizer does) shows
        with torch.no_grad():
            for p in b.model.parameters():
                p.mul_(2)
        flat.append(list(full_state(b.model, b.args, b.compute_dtype, bucket_bytes=4096)))
        if rank == 0:
            storages = [len({t.untyped_storage().data_ptr() for _, t in f}) for f in flat]
            torch.save({"state": state, "metrics": metrics, "flat": [dict(f) for f in flat[:2]], "doubled": dict(flat[2]),
                        "flat_order": [n for n, _ in flat[0]], "flat_storages": storages}, out)


@contextlib.contextmanager
def megatron_backend(rank: int, world: int, init_file: str, model_dir: str, overrides: list[str]):
    """The megatron backend on CPU in this gloo process (its process group ended on exit)."""
    from pipeline.config import load_config
    from pipeline.trainer.megatron.backend import MegatronBackend

    with gloo_group(rank, world, init_file):
        cfg = load_config(None, [f"model.path={model_dir}", "train.device=cpu", f"train.num_gpus={world}",
                                 "train.global_batch_size=8", "train.backend=megatron", *overrides])
        yield MegatronBackend(cfg, model_dir, torch.device("cpu"))


def megatron_forward(b, replay: bool) -> torch.Tensor:
    """Logits [M, V] of megatron_batch on every rank (with its R3 trace set when `replay`)."""
    from pipeline.models.attention import PackedCausal
    from pipeline.trainer.batching import MicroBatch

    ids, cu, score, trace = megatron_batch(b.args)
    if replay:
        mb = MicroBatch.__new__(MicroBatch)
        mb.input_ids_N, mb.attn, mb.score_pos_M, mb.trace_NLk = ids, PackedCausal(cu), score, trace
        b.set_replay(b.model, mb)
    return b.forward_to_head(b.model, ids, cu, score, lambda lg: (lg.float(),),
                             ((score.shape[0], b.args.vocab_size),))[0]


def megatron_logits(rank: int, world: int, init_file: str, model_dir: str, out: str, tp: int, ep: int,
                    replay: bool, sp: bool = False, pp: int = 1) -> None:
    """In a gloo process: build the megatron backend at (tp, ep, pp), then save its logits on a packed
    batch (with an R3 trace from our model when `replay`), the global gradient norm of a loss on them,
    and its gathered full HF state."""
    overrides = [f"train.tensor_model_parallel_size={tp}", f"train.expert_model_parallel_size={ep}",
                 f"train.pipeline_model_parallel_size={pp}", f"determinism.routing_replay={str(replay).lower()}",
                 f"train.sequence_parallel={str(sp).lower()}"]
    with megatron_backend(rank, world, init_file, model_dir, overrides) as b:
        logits = megatron_forward(b, replay)
        # gradients of a loss on the logits, then the global norm; data-parallel ranks (EP) all read this
        # batch here, and gradients are summed over them
        (logits.square().mean() / b.dp_size).backward()
        b.reduce_grads()
        grad_norm = b.global_grad_sq() ** 0.5
        b.set_replay(b.model, None) if replay else None
        state = dict(b.full_state())
        if rank == 0:
            torch.save({"logits": logits.detach(), "state": state, "grad_norm": grad_norm}, out)


def megatron_grads(rank: int, world: int, init_file: str, model_dir: str, out: str, recompute: bool) -> None:
    """In a gloo process: one forward + backward of the megatron backend on megatron_batch (R3 replay for
    MoE), with or without activation recompute; saves the gradients and how many layer forwards ran
    under megatron's activation checkpoint."""
    from megatron.core import tensor_parallel

    overrides = ["determinism.routing_replay=true", f"train.recompute_activations={str(recompute).lower()}"]
    with megatron_backend(rank, world, init_file, model_dir, overrides) as b:
        calls = []
        original = tensor_parallel.random.CheckpointFunction.forward

        def counted(ctx, *args):
            calls.append(1)
            return original(ctx, *args)

        tensor_parallel.random.CheckpointFunction.forward = staticmethod(counted)
        megatron_forward(b, replay=b.args.is_moe).square().mean().backward()
        grads = {n: p.grad.clone() for n, p in b.model.named_parameters()}
        if rank == 0:
            torch.save({"grads": grads, "checkpointed": len(calls)}, out)


def megatron_batch(args):
    """A packed batch of three sequences and, for MoE, a routing trace (the experts our model picks
    with its router weights negated, so replaying it must change the result)."""
    from pipeline.models.attention import PackedCausal

    g = torch.Generator().manual_seed(0)
    lengths = [5, 9, 3]
    ids = torch.randint(1, args.vocab_size, (sum(lengths),), generator=g)
    ctx = PackedCausal.from_lengths(lengths)
    score = torch.tensor([1, 2, 3, 4, 8, 12, 13, 15])
    trace = None
    if args.is_moe:
        n, k = ids.shape[0], args.num_experts_per_tok
        trace = torch.stack([torch.randperm(args.num_experts, generator=g)[:k] for _ in range(n * len(args.moe_layers))])
        trace = trace.view(n, len(args.moe_layers), k).to(torch.int16)
    return ids, ctx.cu_seqlens, score, trace



def backend_setup(rank: int, world: int, init_file: str, model_dir: str, out: str, overrides: list[str]) -> None:
    """In a gloo process: build the FSDP2 and the megatron backend on `model_dir` and save, for each,
    whether it is a TrainerBackend and what its optimizers and schedule are."""
    from pipeline.config import load_config
    from pipeline.trainer.base import TrainerBackend
    from pipeline.trainer.fsdp import FSDPBackend
    from pipeline.trainer.megatron.backend import MegatronBackend

    with gloo_group(rank, world, init_file):
        got = {}
        for name, cls in (("fsdp", FSDPBackend), ("megatron", MegatronBackend)):
            cfg = load_config(None, [f"model.path={model_dir}", "train.device=cpu", f"train.num_gpus={world}",
                                     "train.global_batch_size=8", f"train.backend={name}", *overrides])
            b = cls(cfg, model_dir, torch.device("cpu"))
            settings = lambda o: (type(o).__name__, {k: v for k, v in o.defaults.items()})  # noqa: E731
            got[name] = {"interface": isinstance(b, TrainerBackend), "optimizer": settings(b.optimizer),
                         "critic_optimizer": settings(b.critic_optimizer), "reference": b.ref_model is not None,
                         "scheduler": type(b.scheduler).__name__,
                         "lr_factors": [b.scheduler.lr_lambdas[0](s) for s in range(12)]}
        if rank == 0:
            torch.save(got, out)
