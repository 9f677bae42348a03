"""The megatron-core training backend: GPTModel with tensor, pipeline and expert parallelism.

The TrainerBackend interface (pipeline/trainer/base.py), as the FSDP2 backend's, so the trainer loop,
losses and data path are shared: `logprobs` on a packed micro-batch, `optimizer_step`, `full_state`
in HF names.

Parallel layout: WORLD = TP x DP x PP ranks (train.tensor_model_parallel_size,
train.pipeline_model_parallel_size; megatron's order, TP fastest, so rank 0 is on the first stage);
MoE experts are further split over EP ranks inside DP (train.expert_model_parallel_size). The ranks of
one TP group and of one pipeline read the same micro-batches (`dp_rank` / `dp_size` say which data a
rank takes). Pipeline stages hand activations on inside autograd (pipeline/trainer/megatron/stages.py);
every stage ends a forward with the last stage's logprobs, so the loop's loss code runs on all ranks.
Gradients of dense weights are summed over the data-parallel group, those of experts over the
expert-data-parallel group, tied embeddings over the first and last stage (megatron's groups). The
optimizer is torch AdamW on each rank's shards, built as FSDP2's (pipeline/trainer/optim.py; megatron's
distributed optimizer needs CUDA); the gradient norm is the global one over all shards.

PPO's critic (`values`) is the same GPTModel with a scalar value head (layers.ValueHead) as its
output layer. Weights come from the HF checkpoint (convert.to_megatron) and go back out through convert.to_hf
after gathering TP shards and EP experts. R3 replays the engine's experts through megatron's own
RouterReplay. Checkpoints are torch DCP, one model/optimizer namespace per (tp, ep, pp) rank: resume
with the same layout.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from pipeline.config.schema import RunConfig
from pipeline.config.validate import validate
from pipeline.models.hf_io import read_model_args, read_state_dict
from pipeline.models.logprobs import entropy, token_logprobs
from pipeline.trainer.batching import MicroBatch
from pipeline.trainer.megatron import stages
from pipeline.trainer.optim import (adamw, int4_scale_dtype, lr_scheduler, needs_critic, needs_reference,
                                    policy_and_critic_step)


class RankNamed(nn.Module):
    """Holds the rank's GPTModel under a name unique to its (tp, ep) coordinates, so DCP checkpoints
    (keyed by parameter name) keep every rank's shards apart instead of deduplicating them."""

    def __init__(self, gpt: nn.Module, name: str):
        super().__init__()
        self.key = name
        setattr(self, name, gpt)

    @property
    def gpt(self) -> nn.Module:
        return getattr(self, self.key)

    def forward(self, *args, **kwargs):
        return self.gpt(*args, **kwargs)

    @property
    def post_process(self) -> bool:  # holds the output layer (the last pipeline stage)
        return self.gpt.post_process

    def set_input_tensor(self, hidden: torch.Tensor) -> None:  # a later pipeline stage's input
        self.gpt.set_input_tensor(hidden)

    # DCP checkpoints (pipeline/trainer/checkpoint.py): tensors only, every key carries the rank's name.
    def dcp_state(self, optimizer, for_load: bool = False) -> tuple[dict, dict]:
        params = dict(self.named_parameters())
        model = {k: v for k, v in self.state_dict().items() if not k.endswith("_extra_state")}
        optim = {}
        for name, p in params.items():
            st = optimizer.state.get(p) or {}
            if for_load and not st:  # before the first step: places for what the checkpoint holds
                st = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                      "step": torch.zeros((), dtype=torch.float32)}
            for k, v in st.items():
                optim[f"{name}.{k}"] = v
        return model, optim

    def load_dcp_state(self, optimizer, model: dict, optim: dict) -> None:
        self.load_state_dict(model, strict=False)
        for name, p in self.named_parameters():
            optimizer.state[p] = {k: optim[f"{name}.{k}"] for k in ("step", "exp_avg", "exp_avg_sq")
                                  if f"{name}.{k}" in optim}


class MegatronBackend:
    """TrainerBackend (base.py) over megatron-core's GPTModel: TP x DP x PP ranks, EP inside DP."""

    def __init__(self, cfg: RunConfig, model_dir: str, device: torch.device):
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from pipeline.trainer.megatron.model import build_gpt, transformer_config

        self.args = read_model_args(model_dir)
        validate(cfg, self.args)
        if device.type == "cpu":
            from pipeline.trainer.megatron.cpu_compat import install

            install()
        t = cfg.train
        self.cfg, self.device = cfg, device
        self.compute_dtype = getattr(torch, cfg.model.dtype)
        self.tp, self.ep, self.pp = t.tensor_model_parallel_size, t.expert_model_parallel_size, t.pipeline_model_parallel_size
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(self.tp, self.pp, expert_model_parallel_size=self.ep)
            model_parallel_cuda_manual_seed(t.seed)
        self.ps = ps
        self.tp_rank, self.ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
        self.links = stages.Links(ps)
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.dp_group = ps.get_data_parallel_group()
        use_te = device.type == "cuda" and _has_te() and not t.int4_qat  # QAT hooks megatron's own linear layers
        self.sp = t.sequence_parallel and self.tp > 1
        self.pad_to = self.tp if self.sp else 1  # sequence parallel splits the padded length over TP ranks
        config = transformer_config(self.args, tp=self.tp, ep=self.ep, sequence_parallel=t.sequence_parallel,
                                    dtype=self.compute_dtype, on_cpu=device.type == "cpu",
                                    routing_replay=self.args.is_moe and cfg.determinism.routing_replay, pp=self.pp,
                                    recompute=t.recompute_activations)
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        offset = get_transformer_layer_offset(config)
        self.layers = range(offset, offset + get_num_layers_to_build(config))  # this stage's, global indices
        hf = read_state_dict(model_dir)
        first, last = self.links.first, self.links.last
        self.model = self.build(build_gpt(self.args, config, use_te, first, last), hf)
        if t.int4_qat:
            from pipeline.trainer.megatron.layers import mark_int4_qat

            mark_int4_qat(self.model, t.int4_group_size, int4_scale_dtype(cfg))
        self.optimizer = adamw(self.model.parameters(), cfg, device)
        self.scheduler = lr_scheduler(self.optimizer, cfg)
        self.critic, self.critic_optimizer = self.build_critic(use_te, hf) if needs_critic(cfg) else (None, None)
        self.ref_model = None
        if needs_reference(cfg):
            self.ref_model = self.build(build_gpt(self.args, config, use_te, first, last), hf).requires_grad_(False)
        self.loss_scale = 1.0  # gradients are summed over data-parallel ranks here (FSDP averages)

    def build_critic(self, use_te: bool, hf: dict[str, torch.Tensor]):
        """PPO's critic: the policy's backbone (from the same checkpoint) with a zero-initialised scalar
        value head in place of the output layer, routing live. Trained and checkpointed, never exported."""
        from pipeline.trainer.megatron.layers import ValueHead
        from pipeline.trainer.megatron.model import build_gpt, transformer_config

        t = self.cfg.train
        config = transformer_config(self.args, tp=self.tp, ep=self.ep, sequence_parallel=t.sequence_parallel,
                                    dtype=self.compute_dtype, on_cpu=self.device.type == "cpu", pp=self.pp,
                                    recompute=t.recompute_activations)
        gpt = build_gpt(self.args, config, use_te, self.links.first, self.links.last)
        if self.links.last:
            gpt.output_layer = ValueHead(self.args.hidden_size, sequence_parallel=self.sp)
        critic = self.build(gpt, hf, prefix="critic_", head=("output_layer.weight", "output_layer.bias"))
        critic.links = stages.Links(self.ps, own_groups=True)  # its hand-overs share the policy's backward
        return critic, adamw(critic.parameters(), self.cfg, self.device, critic=True)

    def values(self, mb: MicroBatch) -> torch.Tensor:
        """V(s_t) [M] at every scored position (the state before each response token)."""
        m = mb.score_pos_M.shape[0]
        return self.forward_to_head(self.critic, mb.input_ids_N, mb.attn.cu_seqlens, mb.score_pos_M,
                                    lambda v_M1: (v_M1[:, 0].float(),), ((m,),))[0]

    def build(self, gpt: nn.Module, hf: dict[str, torch.Tensor], prefix: str = "", head: tuple = ()) -> RankNamed:
        from pipeline.trainer.megatron.convert import stage_shard, to_megatron

        shard = to_megatron(hf, self.args, self.tp_rank, self.tp, self.ep_rank, self.ep)
        if self.pp > 1:
            shard = stage_shard(shard, self.args, self.layers, self.links.first, self.links.last)
        shard = {k: v for k, v in shard.items() if k not in head}  # a head of its own (the critic's)
        missing, unexpected = gpt.load_state_dict(shard, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state") and k not in head]
        assert not missing and not unexpected, (missing, unexpected)
        name = prefix + f"tp{self.tp_rank}_ep{self.ep_rank}" + (f"_pp{self.links.stage}" if self.pp > 1 else "")
        return RankNamed(gpt.to(self.device), name)

    # ---- forward ---------------------------------------------------------------------------------
    def logprobs(self, mb: MicroBatch, model=None, replay: bool = False, want_entropy: bool = False,
                 want_mtp: bool = False):
        model = model or self.model
        assert not want_mtp, "the megatron backend has no MTP head (the config refuses model.mtp_num_layers)"
        if self.args.is_moe and self.cfg.determinism.routing_replay:
            self.set_replay(model, mb if replay and mb.trace_NLk is not None else None)
        temp = self.cfg.rollout.rollout_temperature

        def head(logits_MV):
            logp_M = token_logprobs(logits_MV, mb.targets_M, temp).float()
            return (logp_M, entropy(logits_MV, temp).float()) if want_entropy else (logp_M,)

        m = mb.score_pos_M.shape[0]
        outs = self.forward_to_head(model, mb.input_ids_N, mb.attn.cu_seqlens, mb.score_pos_M, head,
                                    ((m,), (m,)) if want_entropy else ((m,),))
        return outs[0], (outs[1] if want_entropy else None), None

    def forward_to_head(self, model, input_ids_N, cu_seqlens, score_pos_M, head, shapes) -> tuple[torch.Tensor, ...]:
        """`head(logits [M, V])` -> fp32 tensors of `shapes`, on every rank. Under pipeline parallelism the
        forward runs stage by stage and the last stage's head outputs reach the others (stages.py)."""
        from pipeline.trainer.megatron.model import logits_at

        links = getattr(model, "links", None) or self.links
        stages.flush()
        hidden = stages.from_previous(links, self.device) if not links.first else None
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
            out = logits_at(model, input_ids_N, cu_seqlens, score_pos_M, self.pad_to, hidden_TBD=hidden)
        if not links.last:
            return stages.to_next(out, links, shapes)
        outs = head(out)
        if self.pp > 1:
            for t in outs:
                stages.broadcast_from_last(t, t.shape, self.device, links)
        return outs

    def set_replay(self, model: nn.Module, mb: MicroBatch | None) -> None:
        """R3: give `model`'s routers the engine's experts (None: route live again), in the order its
        MoE layers see tokens ([T, B] of the padded batch, flattened). Padding tokens, and tokens the
        engine left untraced, are sent to experts 0..k-1 (padding is never scored)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        from pipeline.trainer.megatron.model import padded_batch

        # this pipeline stage's layers' routers
        replays = [m.router_replay for m in model.modules() if getattr(m, "router_replay", None) is not None]
        if mb is None:
            for r in replays:
                r.clear_indices()
                r.clear_router_replay_action()
            return

        ids, _, _, (seq, pos) = padded_batch(mb.input_ids_N, mb.attn.cu_seqlens, self.pad_to)
        b, t = ids.shape
        trace = mb.trace_NLk[:, self.layers.start:self.layers.stop].long()
        k = trace.shape[-1]
        grid = torch.arange(k, device=trace.device).expand(t, b, trace.shape[1], k).clone()
        known = (trace >= 0).all(-1)  # [N, L]
        filled = torch.where(known[..., None], trace, grid[0, 0])
        grid[pos, seq] = filled
        if self.sp:  # sequence parallel: each TP rank's routers see its own slice of the sequence
            t //= self.tp
            grid = grid[self.tp_rank * t:(self.tp_rank + 1) * t]
        assert len(replays) == trace.shape[1], (len(replays), tuple(trace.shape))
        for i, r in enumerate(replays):
            r.clear_indices()
            r.set_target_indices(grid[:, :, i].reshape(t * b, k))
            r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    @torch.no_grad()
    def ref_logprobs(self, mb: MicroBatch, replay: bool = False) -> torch.Tensor:
        return self.logprobs(mb, model=self.ref_model, replay=replay)[0]

    # ---- optimizer --------------------------------------------------------------------------------
    def optimizer_step(self) -> tuple[float, bool]:
        """Sum gradients over the data-parallel groups, clip by the global norm, step, zero."""
        return policy_and_critic_step(self, self.clipped_norm)

    def clipped_norm(self, model: nn.Module) -> float:
        """Reduce `model`'s gradients, clip them to train.clip_grad by the global norm; the norm before."""
        self.reduce_grads(model)
        norm = math.sqrt(self.global_grad_sq(model))
        clip = self.cfg.train.clip_grad
        if math.isfinite(norm) and clip > 0 and norm > clip:
            for p in model.parameters():
                p.grad.mul_(clip / (norm + 1e-6))
        return norm

    def reduce_grads(self, model: nn.Module | None = None) -> None:
        """Every rank's gradients to what the whole batch gives its shards (megatron's finalize_model_grads)."""
        model = model or self.model
        stages.flush()  # backward's gradient sends
        ps = self.ps
        expert_group = ps.get_expert_data_parallel_group()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        tied = self.args.tie_word_embeddings and model is not self.critic  # the critic's head is its own
        if self.pp > 1 and tied and (self.links.first or self.links.last):
            # the first stage's embedding and the last stage's copy of it: one weight, one gradient
            dist.all_reduce(model.gpt.shared_embedding_or_output_weight().grad, group=ps.get_embedding_group())
        for name, p in model.named_parameters():
            if self.tp > 1 and tp_partial_grad(name, p):
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
            expert = ".experts." in name
            group, size = (expert_group, ps.get_expert_data_parallel_world_size()) if expert else (self.dp_group, self.dp_size)
            if size > 1:
                dist.all_reduce(p.grad, group=group)

    def global_grad_sq(self, model: nn.Module | None = None) -> float:
        """Sum of squared gradients over the whole model: each shard counted once (TP-replicated
        weights on TP rank 0, data-parallel copies on their group's rank 0, a tied embedding on the
        first pipeline stage). Which weights TP splits is the conversion's rule (convert.tp_sharded):
        megatron's `tensor_model_parallel` mark is not set on weights it does not initialise."""
        from pipeline.trainer.megatron.convert import tp_sharded

        ps = self.ps
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in (model or self.model).named_parameters():
            expert = ".experts." in name
            first_copy = (ps.get_expert_data_parallel_rank() if expert else self.dp_rank) == 0
            one_tp_copy = self.tp_rank == 0 or tp_sharded(name)
            if first_copy and one_tp_copy and not getattr(p, "shared", False):
                total += p.grad.double().pow(2).sum()
        dist.all_reduce(total)
        return float(total)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # ---- weights out -------------------------------------------------------------------------------
    def full_state(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor), on every rank. Collective: TP shards are gathered over the TP group,
        experts over the EP group, pipeline stages' layers over the pipeline, then converted."""
        from pipeline.trainer.megatron.convert import global_names, to_hf

        ps = self.ps
        tp_group, ep_group = ps.get_tensor_model_parallel_group(), ps.get_expert_model_parallel_group()
        mine = {k: v.detach() for k, v in self.model.gpt.state_dict().items() if not k.endswith("_extra_state")}
        by_tp = [dict() for _ in range(self.tp)]
        for name, t in mine.items():
            parts = [torch.empty_like(t) for _ in range(self.tp)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            for r in range(self.tp):
                by_tp[r][name] = parts[r]
        shards = [by_tp]
        if self.ep > 1:
            shards = [[dict(s) for s in by_tp] for _ in range(self.ep)]
            for name in mine:
                if ".experts." not in name:
                    continue
                for r in range(self.tp):
                    parts = [torch.empty_like(by_tp[r][name]) for _ in range(self.ep)]
                    dist.all_gather(parts, by_tp[r][name].contiguous(), group=ep_group)
                    for e in range(self.ep):
                        shards[e][r][name] = parts[e]
        if self.pp > 1:
            shards = self.merge_stages([[global_names(s, self.args, self.layers) for s in row] for row in shards])
        hf = to_hf(shards, self.args)
        for name, t in hf.items():
            if self.args.tie_word_embeddings and name == "lm_head.weight":
                continue
            yield name, t.to(dtype or t.dtype)

    def merge_stages(self, shards: list[list[dict]]) -> list[list[dict]]:
        """Every stage's part of each (ep, tp) shard, on every stage: names and shapes first, then each
        tensor broadcast from its stage."""
        links = self.links
        meta = {(e, r, k): (tuple(v.shape), v.dtype) for e, row in enumerate(shards) for r, d in enumerate(row)
                for k, v in d.items()}
        every = [None] * links.size
        dist.all_gather_object(every, meta, group=links.group)
        merged = [[{} for _ in row] for row in shards]
        for stage, theirs in enumerate(every):
            for (e, r, k), (shape, dtype) in theirs.items():
                mine = stage == links.stage
                buf = shards[e][r][k].contiguous() if mine else torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(buf, links.ranks[stage], group=links.group)
                merged[e][r][k] = buf
        return merged


def tp_partial_grad(name: str, p: torch.Tensor) -> bool:
    """Replicated weights that each TP rank sees only part of the input of: q/k norms (applied to the
    rank's own heads) and, with sequence parallelism, every norm (the rank's own tokens). Their
    gradients are summed over the TP group (megatron's finalize_model_grads does the same)."""
    return "q_layernorm" in name or "k_layernorm" in name or bool(getattr(p, "sequence_parallel", False))


def _has_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True
