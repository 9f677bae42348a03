"""Per-GPU memory estimate of a run: the trainer's peak, the engines', and how they share a GPU.

Pure arithmetic on a model's shape (ModelArgs) and the RunConfig, no torch, so `lockstep run` and
`lockstep submit` refuse a run that cannot fit before anything starts (pipeline/launch/prepare.py).
Every coefficient is a named constant below that says which code keeps which tensor. They are read
from the code, not yet fitted to measured peaks: bench/gpu_matrix.py measures them on an H200 and
the constants are to be calibrated from it. The MoE and megatron paths are the least certain.

All sizes are bytes; GIB converts. Legend: N tokens of a micro-batch (train.max_tokens_per_gpu), M
scored tokens (taken as N: an upper bound, responses are most of a micro-batch), h hidden size, I
intermediate size, Im an expert's intermediate size, E experts, k experts per token, qd = query heads x
head dim, kd = KV heads x head dim, H query heads, V vocabulary, c bytes of model.dtype.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from pipeline.config.schema import RunConfig
from pipeline.errors import UserError
from pipeline.models.config import ModelArgs, model_preset
from pipeline.models.hf_config import read_model_args

GIB = float(1 << 30)

# ---- trainer: parameters, gradients, optimizer (pipeline/trainer/fsdp.py) ---------------------------
MASTER_BYTES = 4
"""Per parameter: master weights are fp32 (load_model(dtype=float32)); FSDP casts each layer to
model.dtype only for its forward (MixedPrecisionPolicy(param_dtype=...))."""
GRAD_BYTES = 4
"""Per parameter: gradients of the fp32 sharded parameters (reduce_dtype fp32). They live from the
first backward until optimizer_step's zero_grad(set_to_none=True)."""
ADAM_BYTES = 8
"""Per parameter: AdamW's exp_avg and exp_avg_sq in fp32, created at the first step (fused=True on GPUs
adds no copy)."""
REFERENCE_BYTES = 4
"""Per parameter of the reference model (algo.kl_loss_coef or kl_coef > 0): loaded fp32 as well,
no gradients, no optimizer."""

# ---- trainer: activations kept for backward (pipeline/models/qwen3.py, lockstep_kernels/torch_ref.py) --
NORM_FP32_BYTES = 4
"""Per element of an RMSNorm input: torch_ref.rms_norm keeps `x.float()` for backward (pow and mul
save it); it also keeps the normed value before `weight *` (c bytes). The trainer takes this torch path
on GPUs too unless determinism.true_on_policy switches on the Triton kernel."""
ATTN_LSE_BYTES = 4
"""Per query head and token: flash attention's fp32 log-sum-exp, kept for its backward."""
ROUTER_PROB_BYTES = 4
"""Per expert and token: the router's fp32 softmax, kept for backward (MoeRouting.route)."""
BACKWARD_LAYERS = 1
"""Layers' worth of activation gradients in flight during backward, beside the saved activations."""
RECOMPUTE_LAYERS = 2
"""With train.recompute_activations: one layer's activations rebuilt in backward, and their gradients."""
LOGIT_COPIES = 2
"""Per scored token and vocabulary row, in model.dtype: the logits the fused logprob kernel saves for
backward (TokenLogprob) and their gradient. bench/results/h200/logprob.json: the fused kernel's peak
above the logits is exactly that gradient (1.25 GB at 4096 tokens)."""
ENTROPY_BYTES = 16
"""Per row of one entropy chunk (models/logprobs.ENTROPY_CHUNK_ROWS) and vocabulary entry when
algo.entropy_coef > 0: fp32 scaled logits, log-softmax, its exp and their product, recomputed chunk by
chunk in backward; the whole micro-batch adds one more model.dtype gradient of the logits (the two
losses' gradients are summed)."""
ENTROPY_CHUNK_ROWS = 1024
FSDP_PREFETCH_LAYERS = 2
"""Decoder layers whose full model.dtype parameters are gathered at once: the one computing and the
one FSDP2 prefetches. The root's (embedding, final norm, LM head) stay gathered from forward to
backward (FSDP2 does not reshard the root after forward)."""
FSDP_GRAD_BYTES_EXTRA = 4
"""Per parameter of a layer in backward: besides its model.dtype gradient, the fp32 copy FSDP
reduce-scatters (reduce_dtype=float32)."""

# ---- fixed costs ------------------------------------------------------------------------------------
TRAINER_CONTEXT_GIB = 1.0
"""A trainer process's CUDA context (~0.5 GiB with torch's kernels loaded), NCCL buffers, cuBLAS
workspaces. A guess until measured."""
ALLOCATOR_SLACK = 0.10
"""The caching allocator reserves more than it hands out; a fraction of the trainer's transient memory
(activations, logits, FSDP buffers). A guess until measured."""
ENGINE_CONTEXT_GIB = 2.1
"""A built-in engine's CUDA context, CUDA-graph pool and small buffers: what stays when it releases
its weights and KV cache (engine.colocated). Measured once: 2.10 GiB (NVML, in the OOM report of a
trainer beside it) for a sleeping bf16 4B engine with 12 decode graphs on an H100, 2026-12-07; the
engine logs what its allocator still holds at every release."""
SGLANG_RUNTIME_GIB = 3.0
"""An SGLang server's memory beyond engine.mem_fraction_static of the GPU (activations, CUDA graphs,
context); also what stays after /release_memory_occupation. A guess until measured."""

# ---- built-in engine (pipeline/rollout/engine/core.py) ------------------------------------------------
ENGINE_PREFILL_TOKENS = 16384
"""Engine(max_prefill_tokens=16384): the most tokens one prefill forward takes."""
SAMPLING_BYTES = 12
"""Per running request and vocabulary row: fp32 logits and the sampler's scaled / noisy copies."""
SYNC_BUCKETS = 2
"""Weight-sync buckets (weights.bucket_size_mb) the trainer holds at once: the one sent and the next."""


@dataclass(frozen=True)
class Placement:
    """Where the run's processes sit, as far as memory goes (launch/ decides it)."""

    trainer_gpu: bool
    """A trainer rank runs on a GPU."""
    engine_gpu: bool
    """Engines run on GPUs."""
    shared: bool
    """A trainer rank and `engines_per_gpu` engines share one GPU."""
    engines_per_gpu: int = 1
    """Engines (or SGLang TP shards) on the busiest GPU."""


@dataclass(frozen=True)
class TrainerMemory:
    """One trainer rank's peak, in bytes, by component (the critic, under PPO, is in each of them)."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    fsdp_buffers: float
    reference: float
    context: float
    sync_buckets: float

    @property
    def peak(self) -> float:
        """At the start of a micro-batch's backward, once AdamW's states exist: every saved activation, the
        logits and their gradient, the gradients accumulated so far (the weight sync comes later, smaller)."""
        return (self.weights + self.grads + self.optimizer + self.activations + self.logits + self.fsdp_buffers
                + self.reference + self.context)

    @property
    def resident(self) -> float:
        """Between training phases (rollout and weight sync): weights, optimizer states, reference, the
        sync's buckets; gradients are freed by the step and activations by the allocator's empty_cache
        (loop.py does that when engines are colocated)."""
        return self.weights + self.optimizer + self.reference + self.context + self.sync_buckets

    def line(self) -> str:
        return (f"weights {_g(self.weights)}, grads {_g(self.grads)}, AdamW {_g(self.optimizer)}, activations"
                f" {_g(self.activations)}, logits {_g(self.logits)}, FSDP buffers {_g(self.fsdp_buffers)}"
                + (f", reference {_g(self.reference)}" if self.reference else "") + f", context {_g(self.context)}")


@dataclass(frozen=True)
class EngineMemory:
    """One engine's memory on its GPU, in bytes."""

    weights: float
    kv_cache: float
    workspace: float
    context: float

    @property
    def peak(self) -> float:
        return self.weights + self.kv_cache + self.workspace + self.context

    @property
    def idle(self) -> float:
        """After /release_memory_occupation (engine.colocated): weights, KV cache and workspace given back."""
        return self.context

    def line(self) -> str:
        return (f"weights {_g(self.weights)}, KV cache {_g(self.kv_cache)}, workspace {_g(self.workspace)},"
                f" context {_g(self.context)}")


@dataclass(frozen=True)
class MemoryEstimate:
    """The busiest GPU's peak and what it is made of."""

    trainer: TrainerMemory | None
    """The trainer rank's memory (None: it runs on a CPU)."""
    engine: EngineMemory | None
    """One engine's (None: engines run on CPUs)."""
    placement: Placement
    colocated: bool

    @property
    def total(self) -> float:
        """Peak bytes on the busiest GPU."""
        t, e, p = self.trainer, self.engine, self.placement
        engines = p.engines_per_gpu * e.peak if e else 0.0
        if t and e and p.shared:
            if self.colocated:  # the engines sleep while the trainer trains, and wake beside its resident state
                return max(t.peak + p.engines_per_gpu * e.idle, t.resident + engines)
            return t.peak + engines
        return max(t.peak if t else 0.0, engines)

    def headline(self) -> str:
        """What the total is made of, in a few words: `trainer 82 GiB + engine 37 GiB resident together`."""
        t, e, p = self.trainer, self.engine, self.placement
        n = p.engines_per_gpu
        eng = f"{n} engines {n} x {_g(e.peak)}" if e and n > 1 else (f"engine {_g(e.peak)}" if e else "")
        if t and e and p.shared:
            if not self.colocated:
                return f"trainer {_g(t.peak)} + {eng} resident together"
            if t.peak + n * e.idle >= t.resident + n * e.peak:
                return f"trainer {_g(t.peak)} while training + {_g(n * e.idle)} of sleeping engines"
            return f"trainer's resident {_g(t.resident)} + {eng} during rollouts"
        return f"trainer {_g(t.peak)}" if t and (not e or t.peak >= n * e.peak) else eng

    def line(self) -> str:
        """The whole breakdown on one line (logged by a passing check; what a calibration compares)."""
        parts = [f"~{_g(self.total)} per GPU ({self.headline()})"]
        if self.trainer:
            parts.append(f"trainer: {self.trainer.line()}")
        if self.engine:
            parts.append(f"engine: {self.engine.line()}")
        return "; ".join(parts)


def _g(nbytes: float) -> str:
    gib = nbytes / GIB
    return f"{gib:.0f} GiB" if gib >= 10 else f"{gib:.1f} GiB"


# ---- the model's shape ----------------------------------------------------------------------------------
def model_args(cfg: RunConfig) -> ModelArgs:
    """The policy's shape: model.path's config.json, or the model.init preset (as make_initial_model
    builds it: real sizes with Qwen's vocabulary, tiny ones with the tiny tokenizer's)."""
    if cfg.model.path:
        args = read_model_args(cfg.model.path)
        return dataclasses.replace(args, mtp_num_hidden_layers=cfg.model.mtp_num_layers)
    from pipeline.models.tokenizer import TINY_CHARS, TINY_SPECIALS

    vocab = len(TINY_SPECIALS) + len(TINY_CHARS)  # real sizes pad it to their own vocabulary (model_preset)
    return model_preset(cfg.model.init, vocab, None, 0, 0, mtp_layers=cfg.model.mtp_num_layers)


def _attention_params(a: ModelArgs) -> int:
    if a.is_mla:
        return a.attention_params()
    h, hd = a.hidden_size, a.head_dim
    qd, kd = a.num_attention_heads * hd, a.num_key_value_heads * hd
    bias = (qd + 2 * kd + h) if a.attention_bias else 0  # q, k, v, o
    return 2 * h * qd + 2 * h * kd + 2 * hd + bias


def layer_params(a: ModelArgs, i: int) -> tuple[int, int]:
    """(dense, expert) parameters of decoder layer i: attention, norms, dense MLP or router; experts."""
    h = a.hidden_size
    dense = _attention_params(a) + 2 * h
    if a.is_mla:  # DeepSeek-V3: the router's correction bias and the shared experts are dense too
        mlp_dense, experts = a.mlp_params(i)
        return dense + mlp_dense, experts
    if a.is_moe_layer(i):
        return dense + a.num_experts * h, a.num_experts * 3 * h * a.moe_intermediate_size
    return dense + 3 * h * a.intermediate_size, 0


def root_params(a: ModelArgs) -> int:
    """Embedding, final norm and (untied) LM head: what FSDP wraps at the root."""
    emb = a.vocab_size * a.hidden_size
    return emb + a.hidden_size + (0 if a.tie_word_embeddings else emb)


def mtp_params(a: ModelArgs) -> int:
    """The MTP head (pipeline/models/mtp.py): fc [h, 2h], three norms, one decoder layer like layer 0
    (DeepSeek-V3: like its nextn layer, an MoE layer)."""
    if not a.mtp_num_hidden_layers:
        return 0
    dense, experts = layer_params(a, a.num_hidden_layers if a.is_mla else 0)  # DeepSeek's nextn layer: MoE
    return 2 * a.hidden_size * a.hidden_size + 3 * a.hidden_size + dense + experts


def _norm_bytes(width: int, rows: int, c: int) -> int:
    """What an RMSNorm over `rows` rows of `width` per token keeps: the fp32 copy, the normed value and
    the fp32 rsqrt per row (torch_ref.rms_norm)."""
    return (NORM_FP32_BYTES + c) * width + NORM_FP32_BYTES * rows


def mla_activation_bytes(a: ModelArgs, c: int) -> float:
    """Bytes per token an MLA block keeps for backward, its input norm excluded (pipeline/models/mla.py;
    PackedCausal's grid path: flash attention's varlen kernel takes equal q/k and v head dims only)."""
    H, D, V = a.num_attention_heads, a.head_dim, a.v_head_dim
    C, R, ql = a.kv_lora_rank, a.qk_rope_head_dim, a.q_lora_rank or 0
    q = _norm_bytes(ql, 1, c) + c * ql if ql else 0  # q_a_layernorm, and its output (q_b_proj's input)
    kv = _norm_bytes(C, 1, c) + c * (C + R)  # kv_a_layernorm, the latent row (kv_b_proj's input)
    # q, the expanded keys and values scattered into the [B, T] grid the attention keeps, its output and
    # log-sum-exp, the output gathered back (o_proj's input); RoPE keeps only the shared cos / sin
    return q + kv + c * H * (2 * D + V) + 2 * c * H * V + ATTN_LSE_BYTES * H


def layer_activation_bytes(a: ModelArgs, i: int, c: int) -> float:
    """Bytes per token that decoder layer i keeps for backward (pipeline/models/qwen3.py, default kernels,
    flash attention's varlen path); tests/test_memory.py compares it with what autograd saves."""
    h, hd = a.hidden_size, a.head_dim
    H, K = a.num_attention_heads, a.num_key_value_heads
    qd, kd = H * hd, K * hd
    norm = _norm_bytes(h, 1, c) + c * h  # + its output, read by the next projections
    # q and k: their norm, and the RoPE'd tensor flash attention keeps (RoPE's products keep only the
    # shared cos / sin); q also attention's output (read by o_proj), k also v.
    attn = norm + _norm_bytes(qd, H, c) + _norm_bytes(kd, K, c) + 2 * c * (qd + kd) + ATTN_LSE_BYTES * H
    if a.is_mla:
        attn = norm + mla_activation_bytes(a, c)
    if a.is_moe_layer(i) and a.is_mla:
        k, e = a.num_experts_per_tok, a.num_experts
        # the fp32 router (deepseek.TopkRouter): the fp32 copy of its input, the sigmoid scores, the
        # expert mask (bool), each group's two best (int64 ids) and score, the chosen ids (int64), weights
        # and their sum; per (token, expert) pair as Qwen3-MoE's below with an fp32 routing weight; the
        # shared experts' gate / silu / up / product
        g = a.n_group if a.topk_group < a.n_group else 0
        router = 4 * h + (ROUTER_PROB_BYTES + 1) * e + 20 * g + 20 * k + 4
        pair = 12 + 3 * c * h + 4 * c * a.moe_intermediate_size  # the token ids (int64), the fp32 weight
        shared = 4 * c * a.moe_intermediate_size * a.n_shared_experts
        return attn + norm + router + k * pair + shared
    if a.is_moe_layer(i):
        k = a.num_experts_per_tok
        # the router: fp32 softmax, top-k ids (int64), the chosen fp32 weights and their sum (norm_topk)
        router = ROUTER_PROB_BYTES * a.num_experts + 8 * k + 4 * k + 4
        # per (token, expert) pair (layers.run_experts): the gather's and the placement's token ids and the
        # grouping order (int64), the routing weight, the gathered input, gate / silu / up / product, the
        # expert's output and the weighted one
        pair = 24 + c + c * h + 4 * c * a.moe_intermediate_size + 2 * c * h
        mlp = norm + router + k * pair
    else:
        mlp = norm + 4 * c * a.intermediate_size  # gate (silu's input), silu's output, up, their product
    return attn + mlp


# ---- the trainer -----------------------------------------------------------------------------------
def trainer_memory(a: ModelArgs, cfg: RunConfig) -> TrainerMemory:
    """One trainer rank's peak (see the constants above for where each term comes from)."""
    t, algo = cfg.train, cfg.algo
    c = 2 if cfg.model.dtype == "bfloat16" else 4
    layers = [layer_params(a, i) for i in range(a.num_hidden_layers)]
    dense = sum(d for d, _ in layers) + root_params(a) + mtp_params(a)
    experts = sum(e for _, e in layers)
    critic = algo.advantage_estimator == "ppo"
    if t.backend == "megatron":
        # Megatron shards layers over pipeline stages and tensor ranks, experts over EP ranks too; no
        # data-parallel sharding (torch AdamW on each rank's shards). Activations: the stage's layers,
        # split over TP ranks (approximate: norms and the residual are split only with sequence_parallel).
        tp, pp, ep = t.tensor_model_parallel_size, t.pipeline_model_parallel_size, t.expert_model_parallel_size
        shard, expert_shard, act_share = tp * pp, tp * pp * ep, 1.0 / (tp * pp)
    else:  # FSDP2 shards every parameter over all ranks
        shard = expert_shard = t.num_gpus
        act_share = 1.0
    params = dense / shard + experts / expert_shard
    # PPO's critic: the policy's backbone with a [1, h] value head instead of an untied LM head
    head = 0 if a.tie_word_embeddings else a.vocab_size * a.hidden_size
    trained = params + ((params - head / shard) if critic else 0.0)

    n = t.max_tokens_per_gpu
    per_layer = [layer_activation_bytes(a, i, c) for i in range(a.num_hidden_layers)]
    biggest = max(per_layer)
    if t.recompute_activations:  # checkpoint(layer): the layer's input stays; one layer is rebuilt at a time
        acts = a.num_hidden_layers * c * a.hidden_size + RECOMPUTE_LAYERS * biggest
    else:
        acts = sum(per_layer) + BACKWARD_LAYERS * biggest
    mtp = bool(a.mtp_num_hidden_layers) and t.mtp_loss_scaling_factor > 0 and t.backend == "fsdp"
    if mtp:
        acts += layer_activation_bytes(a, a.num_hidden_layers if a.is_mla else 0, c)
    acts *= n * act_share * (2 if critic else 1)  # PPO: the critic's graph is alive beside the policy's
    entropy = algo.entropy_coef > 0
    per_vocab = LOGIT_COPIES * c * (2 if mtp else 1) + (c if entropy else 0)
    logits = (n * per_vocab + (ENTROPY_BYTES * min(n, ENTROPY_CHUNK_ROWS) if entropy else 0)) * a.vocab_size
    logits /= t.tensor_model_parallel_size if t.backend == "megatron" else 1

    layer_total = max(d + e for d, e in layers)
    buffers = (FSDP_PREFETCH_LAYERS * c + c + FSDP_GRAD_BYTES_EXTRA) * layer_total
    buffers += (2 * c + FSDP_GRAD_BYTES_EXTRA) * root_params(a)  # root: params, grads, fp32 reduce copy
    buffers *= 2 if critic else 1
    if t.backend == "megatron":
        buffers = 0.0  # no gathers: each rank computes with its own shards (the casts are in activations)
    reference = REFERENCE_BYTES * params if (algo.kl_loss_coef > 0 or algo.kl_coef > 0) else 0.0
    slack = 1.0 + ALLOCATOR_SLACK
    return TrainerMemory(
        weights=MASTER_BYTES * trained, grads=GRAD_BYTES * trained, optimizer=ADAM_BYTES * trained,
        activations=acts * slack, logits=logits * slack, fsdp_buffers=buffers * slack, reference=reference,
        context=TRAINER_CONTEXT_GIB * GIB, sync_buckets=SYNC_BUCKETS * cfg.weights.bucket_size_mb * (1 << 20))


# ---- the engines --------------------------------------------------------------------------------------
def engine_memory(a: ModelArgs, cfg: RunConfig, gpu_bytes: float) -> EngineMemory:
    """One engine on its GPU: the built-in engine's weights, KV cache (KVCache: [max_running_requests,
    KV heads, context, head dim] keys and values per layer, context = data.max_prompt_len +
    rollout.rollout_max_response_len as the launcher passes it) and prefill / sampling workspace; an
    SGLang server's mem_fraction_static of the GPU (weights + its KV pool) and its runtime beyond it."""
    e = cfg.engine
    c = 2 if cfg.model.dtype == "bfloat16" else 4
    total = a.num_params() + mtp_params(a)
    if e.type == "sglang":
        pool = e.mem_fraction_static * gpu_bytes
        weights = min(total * c / e.tp_size, pool)
        return EngineMemory(weights=weights, kv_cache=pool - weights, workspace=0.0, context=SGLANG_RUNTIME_GIB * GIB)
    if e.quantization == "fp8":  # decoder linear weights in e4m3 (+ one fp32 scale per 128x128 block)
        linear = sum(sum(layer_params(a, i)) for i in range(a.num_hidden_layers))
        weights = linear * (1 + 4 / (128 * 128)) + (total - linear) * c
    else:
        weights = total * c
    context = cfg.data.max_prompt_len + cfg.rollout.rollout_max_response_len
    kv_layers = a.num_hidden_layers + (1 if e.speculative_algorithm else 0)  # the draft head's own cache
    if a.is_mla:  # LatentCache: one latent row (kv_lora_rank + qk_rope_head_dim) per token and layer
        kv = kv_layers * e.max_running_requests * context * (a.kv_lora_rank + a.qk_rope_head_dim) * c
    else:
        kv = 2 * kv_layers * e.max_running_requests * a.num_key_value_heads * context * a.head_dim * c
    h = a.hidden_size
    if a.is_moe:  # live inside one layer of a prefill: residual, normed input, routed copies and expert MLPs
        live = 2 * h * c + a.num_experts_per_tok * (2 * h + 3 * a.moe_intermediate_size) * c + 4 * a.num_experts
        if a.is_mla:  # fp32 routed outputs, the shared experts
            live += a.num_experts_per_tok * 4 * h + 3 * a.moe_intermediate_size * a.n_shared_experts * c
    else:
        live = (2 * h + 3 * a.intermediate_size) * c
    if a.is_mla:  # a prefill expands every latent row to all heads' keys and values (kv_b's output, keys, values)
        live = max(live, a.num_attention_heads * (a.qk_nope_head_dim + 2 * a.head_dim + 2 * a.v_head_dim) * c)
    workspace = ENGINE_PREFILL_TOKENS * live + e.max_running_requests * a.vocab_size * SAMPLING_BYTES
    return EngineMemory(weights=weights, kv_cache=kv, workspace=workspace, context=ENGINE_CONTEXT_GIB * GIB)


def estimate(cfg: RunConfig, placement: Placement, gpu_gib: float, args: ModelArgs | None = None) -> MemoryEstimate:
    a = args or model_args(cfg)
    return MemoryEstimate(
        trainer=trainer_memory(a, cfg) if placement.trainer_gpu else None,
        engine=engine_memory(a, cfg, gpu_gib * GIB) if placement.engine_gpu else None,
        placement=placement, colocated=cfg.engine.colocated)


# ---- where things run ---------------------------------------------------------------------------------
def local_placement(cfg: RunConfig, gpu_visible: bool) -> Placement:
    """`lockstep run`: trainer rank r on GPU r, every engine on the default GPU 0 (beside rank 0)."""
    trainer = cfg.train.device == "cuda" or (cfg.train.device == "auto" and gpu_visible)
    engine_device = getattr(cfg.engine, "device", "cuda")  # SGLang runs on GPUs only
    engine = not cfg.sft and (engine_device == "cuda" or (engine_device == "auto" and gpu_visible))  # SFT: none
    per_gpu = cfg.engine.num_engines
    return Placement(trainer, engine, trainer and engine, per_gpu)


def slurm_placement(cfg: RunConfig, gpus: bool) -> Placement:
    """`lockstep submit`: slurm.mode colocated puts engines (one GPU per engine or TP shard) on the trainer's
    GPUs; hetjob and paired give them GPUs of their own."""
    s = cfg.slurm
    tp = getattr(cfg.engine, "tp_size", 1)
    trainer = gpus and s.trainer.gpus_per_node > 0 and cfg.train.device != "cpu"
    if s.mode == "colocated":
        engine = trainer and getattr(cfg.engine, "device", "cuda") != "cpu"
        gpus_there = max(s.trainer.nodes * s.trainer.gpus_per_node, 1)
        return Placement(trainer, engine, trainer and engine, math.ceil(cfg.engine.num_engines * tp / gpus_there))
    engine = gpus and s.rollout.gpus_per_node > 0 and getattr(cfg.engine, "device", "cuda") != "cpu"
    return Placement(trainer, engine, False, 1)


# ---- the pre-flight check ---------------------------------------------------------------------------------
def _with(cfg: RunConfig, changes: dict[str, dict]) -> RunConfig:
    """cfg with fields of its sections replaced: _with(cfg, {"train": {"recompute_activations": True}})."""
    return dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in changes.items()})


def _toggles(cfg: RunConfig, placement: Placement) -> list[tuple[str, str, dict]]:
    """Settings that cost time, not results: (setting, why, the config changes)."""
    out = []
    if placement.shared and not cfg.engine.colocated:
        why = "engine memory is given back while training"
        why += "" if cfg.rollout.mode == "sync" else "; needs rollout.mode=sync"
        out.append(("engine.colocated=true", why, {"engine": {"colocated": True}, "rollout": {"mode": "sync"}}))
    if placement.trainer_gpu and not cfg.train.recompute_activations:
        out.append(("train.recompute_activations=true", "", {"train": {"recompute_activations": True}}))
    return out


def _largest(lo: int, hi: int, fits) -> int | None:
    """The largest value in [lo, hi] for which fits(value) (monotone); None if not even lo fits."""
    if lo > hi or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _shrink(cfg: RunConfig, placement: Placement, gpu_gib: float, a: ModelArgs) -> str | None:
    """One numeric setting that makes cfg fit: the tokens of a micro-batch, else the engines' share."""
    def fits(changes: dict) -> bool:
        return estimate(_with(cfg, changes), placement, gpu_gib, a).total <= gpu_gib * GIB

    t, e = cfg.train, cfg.engine
    if placement.trainer_gpu:
        longest = cfg.data.max_prompt_len + cfg.rollout.rollout_max_response_len
        n = _largest(longest, t.max_tokens_per_gpu - 1, lambda v: fits({"train": {"max_tokens_per_gpu": v}}))
        if n is not None:
            return f"train.max_tokens_per_gpu to <= {n}"
    if placement.engine_gpu and e.type == "local":
        r = _largest(1, e.max_running_requests - 1, lambda v: fits({"engine": {"max_running_requests": v}}))
        if r is not None:
            return f"engine.max_running_requests to <= {r}"
    if placement.engine_gpu and e.type == "sglang":
        pct = _largest(5, round(e.mem_fraction_static * 100) - 1,
                       lambda v: fits({"engine": {"mem_fraction_static": v / 100}}))
        if pct is not None:
            return f"engine.mem_fraction_static to <= {pct / 100:.2f}"
    return None


def check(cfg: RunConfig, placement: Placement, gpu_gib: float, args: ModelArgs | None = None) -> MemoryEstimate:
    """The estimate if it fits in gpu_gib; otherwise a UserError that names it and the settings that
    make the run fit: every setting that costs only time (engine.colocated, recompute), the one that saves
    most first, each with the estimate it leads to; then, if those are not enough or as the alternative,
    the micro-batch tokens (or the engines' share) that would fit."""
    a = args or model_args(cfg)
    est = estimate(cfg, placement, gpu_gib, a)
    limit = gpu_gib * GIB
    if est.total <= limit:
        return est
    taken, current, now = [], cfg, est.total
    toggles = _toggles(cfg, placement)
    while toggles:  # greedy: the setting that saves most on top of those taken
        options = [(now - estimate(_with(current, ch), placement, gpu_gib, a).total, key, why, ch)
                   for key, why, ch in toggles]
        gain, key, why, changes = max(options, key=lambda o: o[0])
        if gain <= 0:
            break
        current, now = _with(current, changes), now - gain
        taken.append(f"{key} ({why + '; ' if why else ''}-{_g(gain)}, to ~{_g(now)})")
        toggles = [tg for tg in toggles if tg[0] != key]
    name = os.path.basename(os.path.normpath(cfg.model.path)) if cfg.model.path else cfg.model.init
    where = "one" if cfg.train.num_gpus == 1 else "each"
    need = est.total / GIB
    need_s = f"{need:.1f}" if round(need) <= round(gpu_gib) else f"{need:.0f}"  # not "139 GiB needs ~139"
    head = f"{name} on {where} {gpu_gib:.0f} GiB GPU needs ~{need_s} GiB ({est.headline()})"
    settings = "set " + " and ".join(taken) if taken else ""
    if now <= limit:
        alone = _shrink(cfg, placement, gpu_gib, a)
        fix = settings + (f", or lower {alone}" if alone else "")
    elif (shrink := _shrink(current, placement, gpu_gib, a)) is not None:
        fix = (settings + ", and " if settings else "") + f"lower {shrink}"
    else:
        fix = (settings + "; still too much: " if settings else "") + (
            "use more GPUs (train.num_gpus shards weights, gradients and optimizer states) or a smaller model")
    raise UserError(f"{head}: {fix} (an estimate, pipeline/config/memory.py; train.check_memory=false skips the check)")
