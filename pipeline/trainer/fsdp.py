"""The FSDP2 training backend: sharded model and optimizer, logprob forward, full-weight export.

Every decoder layer and the root are wrapped with `fully_shard` over a 1-D mesh of all trainer
ranks (gloo on CPU, NCCL/RCCL on GPUs). Master weights stay fp32; with model.dtype=bfloat16 the
forward runs in bf16 through FSDP's mixed-precision policy, which casts exactly as the engine's bf16
weights are cast, so true on-policy mode sees the same numbers on both sides.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from pipeline.config.schema import RunConfig
from pipeline.config.validate import validate
from pipeline.models.attention import keep_attention_out_of_compiled_code
from pipeline.models.hf_io import load_model, read_model_args
from pipeline.models.logprobs import entropy, token_logprobs
from pipeline.models.mtp import mtp_inputs
from pipeline.models.decoder_layer import MoeRouting
from pipeline.models.qwen3 import Qwen3ForCausalLM
from pipeline.trainer.base import MtpScores
from pipeline.trainer.batching import MicroBatch
from pipeline.trainer.optim import (adamw, int4_scale_dtype, lr_scheduler, needs_critic, needs_reference,
                                    policy_and_critic_step)


def full_state(model, args, dtype: torch.dtype | None = None,
               bucket_bytes: int = 512 << 20) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) of a sharded model. Collective: every rank must iterate to the end.

    When `dtype` is the forward's dtype (FSDP's mixed-precision param_dtype: what the engines compute
    with), the parameters go out in flat buckets of up to `bucket_bytes`, in `named_parameters()`
    order: each rank casts its shards into one buffer (one multi-tensor copy), one all-gather per
    bucket (none on one rank) and one multi-tensor copy put the parameters back together. The tensors
    are views of the bucket, so an engine whose parameters share that layout (pipeline/models/flat.py)
    applies a bucket as one copy. Any other dtype gathers and casts parameter by parameter."""
    named = [(n, p) for n, p in model.named_parameters() if not (args.tie_word_embeddings and n == "lm_head.weight")]
    plan = _export_plan(model, named, dtype, bucket_bytes) if dtype is not None else None
    if plan is None:
        for name, p in model.state_dict().items():
            if args.tie_word_embeddings and name == "lm_head.weight":
                continue
            t = p.full_tensor() if isinstance(p, DTensor) else p
            yield name, t.detach().to(dtype or t.dtype)
        return
    for bucket in plan:
        yield from _gather_bucket(bucket, dtype)


@dataclass
class _Bucket:
    """One flat bucket of the export: what does not change between weight syncs (~1-2 us of Python per
    parameter and op, ~300 parameters a version, so it is worked out once)."""

    names: list[str]
    shapes: list[torch.Size]
    numels: list[int]
    slots: list[int]  # elements of every rank's (padded) shard
    shards: list[torch.Tensor]  # this rank's shards, flat; their data is what changes
    group: object  # the process group of the all-gather (None on one rank)


_plans: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _export_plan(model, named, dtype: torch.dtype, bucket_bytes: int) -> list[_Bucket] | None:
    """The model's buckets (None: not a model of dim-0 sharded parameters whose forward runs in
    `dtype`), kept while its parameters and their local shards are the same objects."""
    key = (dtype, bucket_bytes, [id(p) for _, p in named], [id(_local(p)) for _, p in named])
    cached = _plans.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    if dtype != _param_dtype(model) or not all(_dim0_sharded(p) for _, p in named):
        _plans[model] = (key, None)
        return None
    buckets, part, size = [], [], 0
    for n, p in named:
        if part and size + p.numel() * dtype.itemsize > bucket_bytes:
            buckets.append(_bucket(part))
            part, size = [], 0
        part.append((n, p))
        size += p.numel() * dtype.itemsize
    if part:
        buckets.append(_bucket(part))
    _plans[model] = (key, buckets)
    return buckets


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (DTensor.to_local() costs ~20 us of Python; its local tensor is
    the same object)."""
    if not isinstance(p, DTensor):
        return p
    local = getattr(p, "_local_tensor", None)
    return p.to_local() if local is None else local


def _bucket(part: list[tuple[str, torch.Tensor]]) -> _Bucket:
    mesh = next((p.device_mesh for _, p in part if isinstance(p, DTensor)), None)
    world = mesh.size() if mesh is not None else 1
    rows = [-(-p.shape[0] // world) if p.dim() else 1 for _, p in part]  # rows of every rank's padded shard
    slots = [r * (p.numel() // max(p.shape[0], 1) if p.dim() else 1) for r, (_, p) in zip(rows, part)]
    return _Bucket([n for n, _ in part], [p.shape for _, p in part], [p.numel() for _, p in part], slots,
                   [_local(p).detach().reshape(-1) for _, p in part], mesh.get_group() if world > 1 else None)


def _all_gather_rows(out_WL: torch.Tensor, local_L: torch.Tensor, group) -> None:
    """out_WL[r] = rank r's local_L. On gloo through the list form: its single-tensor all-gather left
    trainer processes aborting at exit ("terminate called without an active exception") in 2 of 5
    two-rank runs (torch 2.13), the list form in none of 5 (in 3 of 40 later: the cause was gloo's worker threads
    freeing tensors during interpreter exit, see pipeline.utils.proc.exit_without_finalizing).
    Elsewhere the single-tensor form, which gathers straight into the buffer (torch >= 2.13 calls it
    all_gather_single)."""
    if dist.get_backend(group) == "gloo":
        dist.all_gather(list(out_WL.unbind(0)), local_L, group=group)
    else:
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out_WL.view(-1), local_L, group=group)


def _dim0_sharded(p: torch.Tensor) -> bool:
    return not isinstance(p, DTensor) or (p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(0),))


def _gather_bucket(b: _Bucket, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors of one bucket of dim-0 sharded parameters (torch.chunk's split, as FSDP2's), as
    views of one flat buffer. No autograd here: the shards are detached, the buffers new."""
    device = b.shards[0].device
    local = torch.empty(sum(b.slots), dtype=dtype, device=device)
    dst, src = [], []
    for shard, view in zip(b.shards, local.split(b.slots)):
        if shard.numel():
            dst.append(view if shard.numel() == view.numel() else view[: shard.numel()])
            src.append(shard)
    torch._foreach_copy_(dst, src)  # casts to the forward's dtype, as FSDP's all-gather does
    if b.group is None:
        out = local
    else:
        world = dist.get_world_size(b.group)
        by_rank = torch.empty(world, local.numel(), dtype=dtype, device=device)
        _all_gather_rows(by_rank, local, b.group)
        out = torch.empty(sum(b.numels), dtype=dtype, device=device)
        dst, src, offset, at = [], [], 0, 0
        for numel, width in zip(b.numels, b.slots):
            full = width and numel // width  # ranks whose shard is a full slot; the next holds the rest
            if full:
                dst.append(out[at: at + full * width].view(full, width))
                src.append(by_rank[:full, offset: offset + width])
            rest = numel - full * width
            if rest:
                dst.append(out[at + full * width: at + numel])
                src.append(by_rank[full, offset: offset + rest])
            offset += width
            at += numel
        torch._foreach_copy_(dst, src)
    for name, shape, view in zip(b.names, b.shapes, out.split(b.numels)):
        yield name, view.view(shape)


def _param_dtype(model) -> torch.dtype | None:
    """The FSDP mixed-precision param_dtype the forward runs in (None: not an FSDP2 model)."""
    state = getattr(model, "_get_fsdp_state", None)
    if state is None:
        return None
    st = state()  # FSDP2 internals: torch <= 2.11 keeps one `_fsdp_param_group`, later ones a list
    groups = getattr(st, "_fsdp_param_groups", None)
    if groups is None:
        groups = [g] if (g := getattr(st, "_fsdp_param_group", None)) is not None else []
    try:
        return groups[0].mp_policy.param_dtype or groups[0].fsdp_params[0].sharded_param.dtype
    except (IndexError, AttributeError):
        return None  # unknown layout: full_state takes the per-parameter path


def shard(model: Qwen3ForCausalLM, mesh, compute_dtype: torch.dtype, recompute: bool = False,
          compile: bool = False) -> Qwen3ForCausalLM:
    """FSDP2 per decoder layer and for the whole model (bf16 compute, fp32 gradient reduction).
    recompute: activation checkpointing per layer. compile: each layer's forward through torch.compile
    (inductor fuses norms, RoPE, SwiGLU and the residual adds, forward and backward; attention stays
    the eager varlen / grid call); FSDP's gathers stay outside the compiled code."""
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if compile:
        keep_attention_out_of_compiled_code()
        for layer in model.model.layers:
            layer.forward = torch.compile(layer.forward)
    if recompute:
        from torch.distributed._composable import checkpoint

        for layer in model.model.layers:
            checkpoint(layer)  # activations recomputed in backward (R3 traces replay there too)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


class FSDPBackend:
    """TrainerBackend (base.py) over FSDP2: every rank is data parallel and holds a shard of everything."""

    def __init__(self, cfg: RunConfig, model_dir: str, device: torch.device):
        validate(cfg, read_model_args(model_dir))
        self.cfg, self.device = cfg, device
        self.compute_dtype = getattr(torch, cfg.model.dtype)
        self.world = dist.get_world_size()
        self.dp_rank, self.dp_size, self.dp_group = dist.get_rank(), self.world, None  # every rank is data parallel
        self.loss_scale = float(self.world)  # FSDP averages gradients over ranks; the loss is a sum of shares
        self.mesh = init_device_mesh(device.type, (self.world,))
        self.args, model = load_model(model_dir, dtype=torch.float32, device=device, mtp_layers=cfg.model.mtp_num_layers)
        if cfg.train.int4_qat:
            from pipeline.models.qat import enable_int4_qat

            enable_int4_qat(model, cfg.train.int4_group_size, int4_scale_dtype(cfg))
        self.model = shard(model, self.mesh, self.compute_dtype, recompute=cfg.train.recompute_activations,
                           compile=cfg.train.compile)
        self.optimizer = adamw(self.model.parameters(), cfg, device)
        self.scheduler = lr_scheduler(self.optimizer, cfg)
        self.critic, self.critic_optimizer = self.build_critic(model_dir) if needs_critic(cfg) else (None, None)
        self.ref_model = None
        if needs_reference(cfg):
            _, ref = load_model(model_dir, dtype=torch.float32, device=device, mtp_layers=0)
            ref.requires_grad_(False)
            self.ref_model = shard(ref, self.mesh, self.compute_dtype)

    def build_critic(self, model_dir: str):
        """PPO's critic: the policy's backbone (initialised from the same checkpoint) with a scalar
        value head, zero-initialised, in place of the LM head. It is trained, never exported."""
        from pipeline.models.layers import Linear

        _, critic = load_model(model_dir, dtype=torch.float32, device=self.device, mtp_layers=0)
        critic.lm_head = Linear(self.args.hidden_size, 1, bias=True).to(self.device)
        torch.nn.init.zeros_(critic.lm_head.weight)
        torch.nn.init.zeros_(critic.lm_head.bias)
        critic = shard(critic, self.mesh, self.compute_dtype)
        return critic, adamw(critic.parameters(), self.cfg, self.device, critic=True)

    def values(self, mb: MicroBatch) -> torch.Tensor:
        """V(s_t) [M] at every scored position (the state before each response token)."""
        return self.critic(mb.input_ids_N, mb.positions_N, mb.attn, None, logits_at_M=mb.score_pos_M)[:, 0].float()

    # ---- forward ---------------------------------------------------------------------------------
    def logprobs(self, mb: MicroBatch, model=None, replay: bool = False, want_entropy: bool = False,
                 want_mtp: bool = False):
        """Per-token logprobs [M] of the micro-batch's response tokens (and the MoE routing state).

        want_mtp (a policy with an MTP head): also the head's MtpScores for the same tokens, from the
        same forward."""
        model = model or self.model
        routing = MoeRouting(trace_NLk=mb.trace_NLk, replay=replay) if self.args.is_moe else None
        temp = self.cfg.rollout.rollout_temperature
        mtp_kw = {}
        if want_mtp:
            next_ids_N, at_M, valid_M = mtp_inputs(mb.input_ids_N, mb.attn.cu_seqlens, mb.score_pos_M)
            mtp_kw = dict(mtp_next_ids_N=next_ids_N, mtp_at_M=at_M)
        out = model(mb.input_ids_N, mb.positions_N, mb.attn, routing, logits_at_M=mb.score_pos_M, **mtp_kw)
        logits_MV = out[0] if want_mtp else out
        logp_M = token_logprobs(logits_MV, mb.targets_M, temp)
        ent_M = entropy(logits_MV, temp) if want_entropy else None
        if not want_mtp:
            return logp_M, ent_M, routing
        mtp_logits_MV = out[1]
        return logp_M, ent_M, routing, MtpScores(token_logprobs(mtp_logits_MV, mb.targets_M, temp),
                                                 (mtp_logits_MV.argmax(-1) == mb.targets_M).float(),
                                                 valid_M.float() * mb.mask_M)

    @torch.no_grad()
    def ref_logprobs(self, mb: MicroBatch, replay: bool = False) -> torch.Tensor:
        return self.logprobs(mb, model=self.ref_model, replay=replay)[0]

    # ---- optimizer --------------------------------------------------------------------------------
    def optimizer_step(self) -> tuple[float, bool]:
        """Clip, step, zero. Returns (grad norm, stepped); a non-finite norm skips the update."""
        return policy_and_critic_step(self, self.clip_grads)

    def clip_grads(self, model: torch.nn.Module) -> float:
        """Clip `model`'s gradients to train.clip_grad by their global norm; the norm before."""
        params = [p for p in model.parameters() if p.grad is not None]
        clip = self.cfg.train.clip_grad
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # ---- weights out -------------------------------------------------------------------------------
    def full_state(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        return full_state(self.model, self.args, dtype)
