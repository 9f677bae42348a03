"""The run configuration: one dataclass per component, documented field by field.

Names follow Miles/slime where the concept exists there (rollout_batch_size, n_samples_per_prompt,
global_batch_size, rollout_max_response_len, max_tokens_per_gpu, eps_clip, kl_loss_coef, ...), so a
Miles command line translates key for key. Each section checks itself in `__post_init__`; checks that
span sections live in `RunConfig.__post_init__`; checks that need the model's shape live in
validate.py. Every error names the fix.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from dataclasses import dataclass, field
from typing import Literal

from pipeline.errors import ConfigError


def _positive(section: str, **values) -> None:
    for name, v in values.items():
        if v is not None and not v > 0:  # `not >` so NaN is refused too
            raise ConfigError(f"{section + '.' if section else ''}{name} must be > 0 (got {v})")


def _non_negative(section: str, **values) -> None:
    for name, v in values.items():
        if v is not None and not v >= 0:
            raise ConfigError(f"{section + '.' if section else ''}{name} must be >= 0 (got {v})")


def non_finite(config, path: str = "") -> str | None:
    """The dotted name and value of the first NaN or infinite number in a config tree (dataclasses, lists,
    dicts), or None. Pure. No option means anything at NaN or inf: a run started with one trains on NaN."""
    if dataclasses.is_dataclass(config):
        items = ((f.name, getattr(config, f.name)) for f in dataclasses.fields(config))
    elif isinstance(config, dict):
        items = config.items()
    elif isinstance(config, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(config))
    else:
        return f"{path} (got {config})" if isinstance(config, float) and not math.isfinite(config) else None
    for name, value in items:
        if (found := non_finite(value, f"{path}.{name}" if path else str(name))) is not None:
            return found
    return None


@dataclass
class ModelConfig:
    path: str | None = None
    """Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json) of a Qwen2 / Qwen2.5,
    Qwen3, Qwen3-MoE, Llama 3.x or DeepSeek-V3 model. Null: create a randomly initialised model from `init`
    inside the run directory."""
    init: Literal["tiny-dense", "tiny-moe", "deepseek-v3-tiny", "char-100m", "qwen3-0.5b", "qwen3-1.7b", "qwen3-4b",
                  "qwen3-moe-small", "deepseek-v3-small"] = "tiny-dense"
    """Architecture preset used when `path` is null: tiny-dense / tiny-moe / deepseek-v3-tiny (about 0.1M
    parameters, for CPUs), char-100m (104M parameters at the character tokenizer's 66-row vocabulary:
    learning demos on a GPU, configs/multidigit-*.yaml), qwen3-0.5b / qwen3-1.7b / qwen3-4b (real sizes with Qwen's 151936-row
    vocabulary, for GPU benchmarks), qwen3-moe-small (Qwen3-30B-A3B's layers, 128 experts top-8, 9 of its
    48 layers: 6.2B parameters, sized for one H200 with engine.colocated and train.recompute_activations),
    deepseek-v3-small (DeepSeek-V3's layers at real widths: MLA, 256 experts top-8 in 8 groups, one dense
    layer and MoE layers, sized the same way; see pipeline/models/config.py)."""
    init_seed: int = 0
    """Seed of the random initialisation when `path` is null."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and compute dtype of trainer and built-in engine (bfloat16 on GPUs)."""
    mtp_num_layers: int = 0
    """Multi-token-prediction draft layers (0 or 1; Miles: --mtp-num-layers). 1 keeps the checkpoint's
    MTP head (Qwen3-Next / Qwen3-MoE-MTP names: mtp.fc, mtp.layers.0.*, ...) or adds a fresh one,
    trains it alongside the policy (train.mtp_loss_scaling_factor) and lets engines draft with it
    (engine.speculative_algorithm)."""

    def __post_init__(self):
        if self.mtp_num_layers not in (0, 1):
            raise ConfigError(f"model.mtp_num_layers must be 0 or 1 (got {self.mtp_num_layers})")
        if self.path is not None and not str(self.path).strip():
            raise ConfigError("model.path is empty: give a Hugging Face checkpoint directory, or leave it unset"
                              " (null) to start from model.init")


@dataclass
class DataConfig:
    prompt_data: str = "data/arith/train.jsonl"
    """JSONL file of prompts, one JSON object per line (Miles: --prompt-data)."""
    input_key: str = "prompt"
    """Field holding the prompt text, or a list of chat messages (Miles: --input-key)."""
    label_key: str = "label"
    """Field holding the reference answer given to the reward function (Miles: --label-key)."""
    metadata_key: str = "metadata"
    """Optional field passed through to the reward function and stored with each sample."""
    apply_chat_template: bool = False
    """Render the prompt with the tokenizer's chat template (Miles: --apply-chat-template)."""
    rollout_shuffle: bool = True
    """Shuffle prompts every epoch, deterministically from rollout_seed (Miles: --rollout-shuffle)."""
    max_prompt_len: int = 256
    """Prompts longer than this many tokens are handled per `on_bad_row`."""
    on_bad_row: Literal["skip", "error"] = "skip"
    """A dataset row with a missing/ill-typed field or an oversize prompt: skip it (and count it) or stop."""
    response_key: str = "response"
    """algo.loss_type=sft_loss: field holding the target response text, trained on after the prompt (the
    tokenizer's end-of-text appended). A row without it needs chat messages under input_key whose
    assistant turns are the targets. E.g. `label` trains on the label itself."""

    def __post_init__(self):
        _positive("data", max_prompt_len=self.max_prompt_len)


@dataclass
class RolloutConfig:
    rollout_batch_size: int = 32
    """Prompts per rollout step (Miles: --rollout-batch-size)."""
    n_samples_per_prompt: int = 8
    """Responses sampled per prompt; GRPO normalises rewards within each group (Miles: --n-samples-per-prompt)."""
    rollout_max_response_len: int = 4
    """Most new tokens per response (Miles: --rollout-max-response-len)."""
    rollout_temperature: float = 1.0
    """Sampling temperature; the trainer scores tokens at the same temperature (Miles: --rollout-temperature)."""
    rollout_top_p: float = 1.0
    """Nucleus sampling threshold (Miles: --rollout-top-p)."""
    rollout_top_k: int = -1
    """Top-k sampling; -1 disables it (Miles: --rollout-top-k)."""
    rollout_seed: int = 42
    """Seed of prompt order and of every request's sampling seed (Miles: --rollout-seed)."""
    rm_type: str = "arith"
    """Reward function: a registry name (arith, exact_match, final_answer, math) or a dotted path `module:function`."""
    request_timeout_s: float = 120.0
    """An engine request that takes longer than this fails and is retried on another engine."""
    max_retries: int = 3
    """Attempts per request before the step fails (when retry_budget_s is 0)."""
    retry_budget_s: float = 300.0
    """Keep retrying a failed request (other engines, a restarted one) for this long before the step
    fails; 0 uses max_retries instead."""
    over_sampling_batch_size: int | None = None
    """Groups kept in flight per step (>= rollout_batch_size); the surplus is aborted once
    rollout_batch_size groups passed the filter (Miles: --over-sampling-batch-size). null: no surplus."""
    dynamic_sampling_filter: str | None = None
    """Keep a finished group only if this says so: nonzero_std, or module:function (Miles:
    --dynamic-sampling-filter-path). Filtered groups are replaced by new prompts."""
    max_draws_per_step: int = 8
    """Stop drawing new prompts for a step after this many times rollout_batch_size (a filter that
    rejects everything must not spin forever); the step then commits what it has."""
    partial_rollout: bool = False
    """Aborted groups are kept and continued next step from their tokens instead of being dropped
    (Miles: --partial-rollout)."""
    mask_offpolicy_in_partial_rollout: bool = False
    """Tokens a continued sample got from an older weight version do not count in the loss (Miles:
    --mask-offpolicy-in-partial-rollout)."""
    mode: Literal["sync", "one_step_off", "fully_async"] = "sync"
    """sync: step k is generated with weights k; one_step_off: step k+1 is generated while step k
    trains; fully_async: generation runs up to max_weight_staleness versions ahead and weight updates
    land in the middle of generation (engines pause, swap, continue)."""
    max_weight_staleness: int = 2
    """fully_async: how many versions rollouts may run ahead; older samples are dropped by the trainer."""
    tito_checks: bool = True
    """Report rollout/tito_* (re-tokenisation drift, alternate EOS, special tokens in responses)."""
    generate_fn: str = "pipeline.rollout.single_turn:generate"
    """The rollout function, `module:function` (sync or async): (sample, engine) -> Trajectory, one
    sample's turns (multi-turn, tools, environments; README "Multi-turn and agentic rollouts"). The
    default is single-turn (Miles: --custom-generate-function-path)."""

    def __post_init__(self):
        module, sep, attr = self.generate_fn.partition(":")
        if not (sep and module and attr):
            raise ConfigError(f"rollout.generate_fn {self.generate_fn!r}: write it as module:function"
                              " (e.g. pipeline.rollout.envs.calculator:generate)")
        _positive(
            "rollout",
            rollout_batch_size=self.rollout_batch_size,
            n_samples_per_prompt=self.n_samples_per_prompt,
            rollout_max_response_len=self.rollout_max_response_len,
            rollout_temperature=self.rollout_temperature,
            request_timeout_s=self.request_timeout_s,
            max_draws_per_step=self.max_draws_per_step,
        )
        _non_negative("rollout", max_retries=self.max_retries, retry_budget_s=self.retry_budget_s)
        if not 0.0 < self.rollout_top_p <= 1.0:
            raise ConfigError(f"rollout.rollout_top_p must be in (0, 1] (got {self.rollout_top_p})")
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < self.rollout_batch_size:
            raise ConfigError(f"rollout.over_sampling_batch_size ({self.over_sampling_batch_size}) must be >="
                              f" rollout_batch_size ({self.rollout_batch_size})")
        if self.max_weight_staleness < 1:
            raise ConfigError("rollout.max_weight_staleness must be >= 1")
        if self.rollout_top_k == 0 or self.rollout_top_k < -1:
            raise ConfigError(f"rollout.rollout_top_k must be -1 (off) or >= 1 (got {self.rollout_top_k})")


@dataclass
class EngineCommon:
    """What every engine backend has: how many, where they bind, how requests reach them."""

    num_engines: int = 1
    """Engine servers (each with its own copy of the weights) (Miles: rollout GPUs / GPUs per engine)."""
    max_running_requests: int = 256
    """Sequences decoded together per engine (SGLang --max-running-requests)."""
    host: str = "127.0.0.1"
    """Interface the engine binds to (loopback locally; the node's cluster interface on Slurm)."""
    max_restarts: int = 3
    """A dead engine is restarted (and caught up to the current weights) up to this many times per
    engine; one more death stops the run, naming it."""
    router: Literal["lockstep", "sglang_router"] = "lockstep"
    """How /generate requests reach the engines: lockstep = the rollout manager's own least-loaded
    pool with sticky sessions and retry on another engine; sglang_router = the sglang-router package
    (PyPI) in front of them (control and weight traffic still go to each engine directly)."""
    router_policy: Literal["cache_aware", "round_robin", "power_of_two", "random"] = "cache_aware"
    """sglang_router only: its --policy (cache_aware routes shared prefixes to the same engine)."""
    speculative_algorithm: Literal["NEXTN", "EAGLE"] | None = None
    """Speculative decoding with the model's MTP head (SGLang --speculative-algorithm; NEXTN and EAGLE
    both draft a chain with it here). Needs model.mtp_num_layers=1. Tokens are exactly those of plain
    decoding (bit-identical in true on-policy mode); only the speed changes."""
    speculative_num_steps: int = 3
    """Draft tokens per verify step (SGLang --speculative-num-steps; eagle topk is 1)."""
    disable_cuda_graph: bool = False
    """Run every step eagerly (SGLang's disable_cuda_graph; 0.5.23 spells it --cuda-graph-backend-decode
    disabled --cuda-graph-backend-prefill disabled, which the launcher passes). By default a GPU engine captures
    its plain decode step as CUDA graphs per batch bucket at start (dense models; built-in engine:
    MoE models and speculative steps stay eager)."""
    cuda_graph_max_bs: int | None = None
    """Largest decode batch run from a CUDA graph (SGLang --cuda-graph-max-bs-decode); larger batches run
    eagerly. null: max_running_requests for the built-in engine, SGLang's own default for SGLang."""
    startup_timeout_s: float = 1200.0
    """How long one engine may take to load and serve; the trainer and rollout manager, started beside
    the engines, wait this long for their addresses."""
    colocated: bool = False
    """Engines share GPUs with the trainer: after each step's rollouts they give their memory back
    (/release_memory_occupation: weights and KV cache) while the trainer trains, and take it back for
    the weight update (SGLang engines start with --enable-memory-saver). Sync mode only."""

    def __post_init__(self):
        _positive("engine", num_engines=self.num_engines, max_running_requests=self.max_running_requests,
                  speculative_num_steps=self.speculative_num_steps, startup_timeout_s=self.startup_timeout_s)
        _non_negative("engine", max_restarts=self.max_restarts)
        if self.cuda_graph_max_bs is not None:
            _positive("engine", cuda_graph_max_bs=self.cuda_graph_max_bs)


@dataclass
class LocalEngineConfig(EngineCommon):
    type: Literal["local"] = "local"
    """The built-in torch engine: SGLang's HTTP protocol, same model code as the trainer."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the engine runs; auto picks cuda when a GPU is visible."""
    num_threads: int = 1
    """torch intra-op threads of each engine process on CPU."""
    quantization: Literal["fp8"] | None = None
    """fp8: attention and MLP projections in blockwise FP8 (e4m3, 128x128 block scales; activations
    quantised per token and 128 channels) and FP8 GEMMs: Triton on GPUs with FP8 tensor cores (sm89+,
    MI300), a dequantising torch reference elsewhere (correct, slow). With weights.quantization=fp8
    the sync's FP8 pairs are kept as sent; otherwise each update is quantised on arrival. SGLang's
    --quantization fp8 for the built-in engine."""
    overlap_schedule: bool = False
    """Overlapped decode (SGLang's overlap scheduler; server flag --enable-overlap-schedule): step t+1 is
    launched from step t's sampled tokens still on the device while the host reads step t back (appends,
    finish checks). The same tokens and logprobs as step-by-step decode; plain decode only (not with
    speculative decoding or routing records, which run step by step). Off by default: on the H200 its
    first version ran at 0.67-1.06x of step-by-step decode; the pinned copies since then have not been
    measured on a GPU yet (BENCHMARKS.md, bench/engine_bench.py --overlap)."""
    prefix_cache_tokens: int = 0
    """Prefix cache (SGLang's radix cache, keyed by token ids): a finished request's KV is kept, and a request
    that starts with the same ids prefills only the rest, so a multi-turn trajectory's next turn (sent to
    the same engine: sticky sessions) recomputes only what the environment appended. Up to this many
    tokens are kept (least recently used go first; flushed with every weight update); 0: off. Reported
    as rollout/prefix_cache_hit_rate. Logprobs equal those without it, bit for bit, in true on-policy mode."""
    sampling_backend: Literal["triton", "pytorch"] = "triton"
    """How a GPU engine samples (SGLang --sampling-backend; there flashinfer | pytorch): triton = one fused
    Triton pass over the logits for batches without top-p/top-k (1.2-2.2x decode at batch 64-256 on the
    H200, bench/engine_bench.py --fused-sampling); pytorch = the torch path. Both give the same tokens;
    CPUs always take the torch path."""
    moe_grouped_experts: bool = True
    """MoE models on GPUs: stack each MoE block's expert weights (views of the engine's weights) and run
    gate, up and down for all experts in one grouped Triton kernel each, with no host read per layer,
    so MoE decode also runs from CUDA graphs (lockstep_kernels/gpu/grouped_matmul.py: per row bitwise the
    trainer's per-expert matmul in true on-policy mode). On an H100 (`python bench/moe_decode_bench.py`,
    2026-12-05): bitwise the per-expert loop at 1-512 rows in both modes, graphs equal eager, engine vs
    trainer logprob diff 0; an MoE layer 8-37x faster than the loop, 25-144x from a CUDA graph.
    Off: the per-expert loop and every MoE decode step eager."""

    def __post_init__(self):
        super().__post_init__()
        _positive("engine", num_threads=self.num_threads)
        if self.prefix_cache_tokens < 0:
            raise ConfigError(f"engine.prefix_cache_tokens must be >= 0 (got {self.prefix_cache_tokens}; 0: off)")
        if self.prefix_cache_tokens and self.speculative_algorithm:
            raise ConfigError("engine.prefix_cache_tokens and engine.speculative_algorithm exclude each other in the"
                              " built-in engine (the cache does not hold the draft head's KV): set one of them off")


@dataclass
class SglangEngineConfig(EngineCommon):
    type: Literal["sglang"] = "sglang"
    """`python -m sglang.launch_server` per engine (rollout nodes with GPUs and SGLang installed)."""
    tp_size: int = 1
    """GPUs per engine, tensor parallel (Miles: --rollout-num-gpus-per-engine; SGLang --tp-size)."""
    mem_fraction_static: float = 0.8
    """Fraction of GPU memory for weights + KV cache (Miles: --sglang-mem-fraction-static)."""
    attention_backend: str | None = None
    """SGLang --attention-backend (fa3, flashinfer, triton, ...); null: SGLang's choice. True
    on-policy runs need one SGLang supports deterministically (fa3, flashinfer, triton)."""
    quantization: str | None = None
    """SGLang --quantization (e.g. fp8) for the rollout weights; null: the checkpoint's dtype."""
    kv_cache_dtype: str | None = None
    """SGLang --kv-cache-dtype (e.g. fp8_e4m3); null: auto."""
    chunked_prefill_size: int | None = None
    """SGLang --chunked-prefill-size; null: SGLang's default."""
    ep_size: int = 1
    """SGLang --ep-size: expert parallelism of MoE layers across an engine's tp_size GPUs (DeepSeek-V3,
    Qwen3-MoE); must divide tp_size."""
    attn_dp_size: int = 1
    """SGLang --attn-dp-size: data-parallel attention groups inside the TP group, the FFN / experts stay
    tensor or expert parallel (DP attention: MLA's one latent KV head is not split by TP, so DeepSeek-V3
    engines hold its KV cache once per group, not once per GPU); must divide tp_size."""
    moe_a2a_backend: str | None = None
    """SGLang --moe-a2a-backend (e.g. deepep) for expert-parallel token dispatch; null: SGLang's default."""
    python: str = "python3"
    """Interpreter of the environment that has SGLang (its container's python on clusters)."""
    extra_args: list[str] = field(default_factory=list)
    """Further `sglang.launch_server` arguments, passed as given (checked by SGLang's own parser)."""
    health_interval_s: float = 10.0
    """Seconds between health checks of a serving engine."""
    health_failures: int = 3
    """Consecutive failed health checks after which a hung engine is killed and restarted."""

    def __post_init__(self):
        super().__post_init__()
        _positive("engine", tp_size=self.tp_size, ep_size=self.ep_size, attn_dp_size=self.attn_dp_size,
                  health_interval_s=self.health_interval_s, health_failures=self.health_failures)
        for name in ("ep_size", "attn_dp_size"):
            if self.tp_size % getattr(self, name):
                raise ConfigError(f"engine.{name} ({getattr(self, name)}) must divide engine.tp_size ({self.tp_size}):"
                                  f" SGLang splits an engine's tp_size GPUs into them")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError(f"engine.mem_fraction_static must be in (0, 1) (got {self.mem_fraction_static})")


EngineConfig = LocalEngineConfig | SglangEngineConfig


@dataclass
class TrainConfig:
    backend: Literal["fsdp", "megatron"] = "fsdp"
    """Training backend: fsdp = FSDP2 (torch.distributed.fsdp.fully_shard); megatron = megatron-core's
    GPTModel with tensor / pipeline / expert parallelism (`pip install megatron-core`)."""
    tensor_model_parallel_size: int = 1
    """megatron: ranks that split each layer's weights (Miles: --tensor-model-parallel-size)."""
    expert_model_parallel_size: int = 1
    """megatron: ranks that split the MoE experts (Miles: --expert-model-parallel-size)."""
    pipeline_model_parallel_size: int = 1
    """megatron: pipeline stages (Miles: --pipeline-model-parallel-size): layers split evenly over them;
    micro-batches go through the stages one at a time (no 1F1B interleaving yet)."""
    sequence_parallel: bool = False
    """megatron: sequence parallelism in the TP group (Miles: --sequence-parallel): norms and the residual
    stream split along the sequence over TP ranks; needed for MoE models under TP (experts TP-sharded)."""
    num_gpus: int = 1
    """Trainer ranks (GPUs, or gloo processes on CPU) (Miles: --actor-num-gpus-per-node x nodes)."""
    global_batch_size: int = 256
    """Samples per optimizer step; rollout_batch_size x n_samples_per_prompt must be a multiple (Miles: --global-batch-size)."""
    max_tokens_per_gpu: int = 4096
    """Token budget of one packed micro-batch on one rank (Miles: --max-tokens-per-gpu)."""
    max_tokens_per_gpu_forward: int | None = None
    """Budget of the forward-only passes (old/reference logprobs, values), which keep no activations
    for backward; null: 2 x max_tokens_per_gpu."""
    lr: float = 3e-3
    """AdamW learning rate (Miles: --lr)."""
    lr_warmup_steps: int = 0
    """Linear warm-up over this many optimizer steps (Miles: --lr-warmup-iters)."""
    lr_decay_style: Literal["constant", "cosine", "linear"] = "constant"
    """Decay from lr to min_lr over the run's optimizer steps (Miles: --lr-decay-style)."""
    min_lr: float = 0.0
    """Final learning rate of a decaying schedule (Miles: --min-lr)."""
    weight_decay: float = 0.0
    """AdamW weight decay (Miles: --weight-decay)."""
    adam_beta1: float = 0.9
    """AdamW beta1 (Miles: --adam-beta1)."""
    adam_beta2: float = 0.99
    """AdamW beta2 (Miles: --adam-beta2)."""
    adam_eps: float = 1e-8
    """AdamW epsilon (Miles: --adam-eps)."""
    clip_grad: float = 1.0
    """Gradient-norm clip; 0 disables (Miles: --clip-grad)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where trainer ranks run; auto picks cuda when a GPU is visible."""
    num_threads: int = 1
    """torch intra-op threads of each trainer rank on CPU."""
    int4_qat: bool = False
    """INT4 quantisation-aware training of the MoE experts' projections (fake quantiser with a
    straight-through estimator): engines get and serve the INT4 values, the HF export is packed W4A16
    (compressed-tensors pack-quantized, servable by SGLang/vLLM)."""
    int4_group_size: int = 32
    """Input columns per INT4 scale (must divide hidden and moe_intermediate sizes)."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the MTP draft head's next-next-token loss (Megatron/Miles: --mtp-loss-scaling-factor).
    The head reads detached hidden states, so this loss trains the head only, never the policy."""
    seed: int = 1234
    """Seed of the trainer (dropout-free, so it only matters for model init when no path is given)."""
    recompute_activations: bool = False
    """Activation checkpointing of every decoder layer (Miles: --recompute-granularity full)."""
    expandable_segments: bool = True
    """GPU trainers run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (unless that variable is set):
    micro-batches of different lengths then reuse one growing segment instead of each leaving a cached
    block of its own size behind."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU in GiB (2^30 bytes; an H200 has ~139) that the pre-flight check plans against.
    null: `lockstep run` reads it from the GPU it sees, `lockstep submit` from the cluster profile's
    gpu_memory_gib; without either the check is skipped (with a warning)."""
    check_memory: bool = True
    """Refuse, before anything starts, a GPU run whose estimated per-GPU peak (trainer and engines,
    pipeline/config/memory.py) exceeds the GPU's memory, naming the settings that make it fit. false:
    run anyway (the estimate is not yet calibrated for every setting)."""
    compile: bool = False
    """torch.compile each decoder layer's forward (FSDP2 backend, dense models, default mode): inductor
    fuses the norms, RoPE, SwiGLU and residual adds, forward and backward; attention stays eager. The
    first steps compile (and recompile once for new sequence lengths). Not with
    determinism.true_on_policy: fused kernels round differently from the engine's."""
    dist_timeout_s: float = 600.0
    """Timeout of trainer collectives before a hung peer is reported."""
    max_consecutive_nonfinite: int = 3
    """A NaN/inf loss or gradient skips that optimizer step; this many in a row stop the run (0: never)."""

    def __post_init__(self):
        _positive(
            "train",
            num_gpus=self.num_gpus,
            global_batch_size=self.global_batch_size,
            max_tokens_per_gpu=self.max_tokens_per_gpu,
            lr=self.lr,
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            gpu_memory_gib=self.gpu_memory_gib,
            adam_eps=self.adam_eps,
            num_threads=self.num_threads,
            dist_timeout_s=self.dist_timeout_s,
        )
        _non_negative("train", lr_warmup_steps=self.lr_warmup_steps, weight_decay=self.weight_decay,
                      min_lr=self.min_lr, max_consecutive_nonfinite=self.max_consecutive_nonfinite)
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ConfigError(f"train.adam_beta1 and train.adam_beta2 must be in [0, 1) (got {self.adam_beta1},"
                              f" {self.adam_beta2})")
        parallel = (self.tensor_model_parallel_size, self.expert_model_parallel_size,
                    self.pipeline_model_parallel_size, self.sequence_parallel)
        if self.backend == "fsdp" and parallel != (1, 1, 1, False):
            raise ConfigError("tensor/expert/pipeline/sequence parallelism are megatron options: set train.backend=megatron")
        mp = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if self.num_gpus % mp:
            raise ConfigError(f"train.num_gpus ({self.num_gpus}) must be divisible by train.tensor_model_parallel_size x"
                              f" train.pipeline_model_parallel_size ({mp})")
        if (self.num_gpus // mp) % self.expert_model_parallel_size:
            raise ConfigError(f"train.expert_model_parallel_size ({self.expert_model_parallel_size}) must divide the data"
                              f" parallel size num_gpus / (tensor x pipeline model parallel size) ({self.num_gpus // mp})")
        if self.mtp_loss_scaling_factor < 0:
            raise ConfigError(f"train.mtp_loss_scaling_factor must be >= 0 (got {self.mtp_loss_scaling_factor})")
        if self.clip_grad < 0:
            raise ConfigError(f"train.clip_grad must be >= 0 (got {self.clip_grad})")


ESTIMATORS = ("grpo", "gspo", "dr_grpo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
TOKEN_LEVEL_ESTIMATORS = ("ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


@dataclass
class AlgoConfig:
    advantage_estimator: Literal["grpo", "gspo", "dr_grpo", "ppo", "reinforce_plus_plus",
                                 "reinforce_plus_plus_baseline"] = "grpo"
    """How rewards become advantages (Miles: --advantage-estimator). gspo also switches the policy
    ratio to GSPO's sequence-level ratio; dr_grpo drops the std normalisation; ppo trains a critic."""
    eps_clip: float = 0.2
    """PPO clip range below 1 (Miles: --eps-clip). GSPO uses ~3e-4."""
    eps_clip_high: float | None = None
    """PPO clip range above 1; null uses eps_clip (Miles: --eps-clip-high, 'clip-higher')."""
    eps_clip_c: float | None = None
    """Dual clipping: for negative advantages the loss is at most -A * eps_clip_c (> 1) (Miles: --eps-clip-c)."""
    loss_reduction: Literal["token_mean", "sample_mean", "seq_mean_token_sum"] = "token_mean"
    """token_mean: every token of the global batch weighs the same; sample_mean: every sample;
    seq_mean_token_sum: token sums over a constant (Dr. GRPO)."""
    kl_loss_coef: float = 0.0
    """Weight of the KL loss against the initial (reference) policy; 0 disables it (Miles: --kl-loss-coef)."""
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """KL estimator of the KL loss (Miles: --kl-loss-type)."""
    kl_coef: float = 0.0
    """KL penalty folded into per-token rewards (reinforce_plus_plus*, ppo) (Miles: --kl-coef)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (Miles: --entropy-coef)."""
    grpo_std_normalization: bool = True
    """Divide group-centred rewards by the group std (dr_grpo turns it off)."""
    gamma: float = 1.0
    """Discount of per-token returns (reinforce_plus_plus, ppo; reinforce_plus_plus_baseline is undiscounted) (Miles: --gamma)."""
    lambd: float = 1.0
    """GAE lambda (ppo) (Miles: --lambd)."""
    use_rollout_logprobs: bool = False
    """PPO's 'old' policy is the engine's (behaviour) logprobs instead of the trainer's pre-update
    ones: the ratio then corrects for the staleness of async rollouts (Miles: --use-rollout-logprobs)."""
    off_policy_correction: Literal["auto", "none", "tis", "icepop"] = "auto"
    """Correct for engine/trainer mismatch and staleness: tis weights tokens by min(pi_train/pi_rollout,
    tis_clip); icepop drops tokens whose ratio leaves [icepop_low, icepop_high] (Miles: --use-tis).
    auto: none in sync mode, tis in one_step_off / fully_async (one-step-stale GRPO learned 2.5x
    slower without it on the tiny recipe)."""
    tis_clip: float = 2.0
    """Cap of the TIS weight (Miles: --tis-clip)."""
    icepop_low: float = 0.5
    """Lower bound of the kept ratio band (icepop)."""
    icepop_high: float = 2.0
    """Upper bound of the kept ratio band (icepop)."""
    critic_lr: float = 1e-3
    """Critic learning rate (ppo)."""
    eps_clip_value: float = 0.2
    """Value-loss clip range (ppo) (Miles: --value-clip)."""
    value_loss_coef: float = 0.5
    """Weight of the value loss (ppo)."""
    loss_type: Literal["policy_loss", "sft_loss"] = "policy_loss"
    """policy_loss: RL on rollouts (engines, rewards, the estimator above). sft_loss: supervised
    fine-tuning on data.prompt_data's prompt/response pairs or chat messages (Miles: --loss-type
    sft_loss): mean negative log-likelihood of the response tokens (prompt tokens get no gradient);
    no engines, rollouts or rewards; each step trains rollout_batch_size rows of the shuffled file."""

    def __post_init__(self):
        _positive("algo", eps_clip=self.eps_clip, eps_clip_high=self.eps_clip_high, tis_clip=self.tis_clip,
                  critic_lr=self.critic_lr)
        if self.kl_loss_coef < 0 or self.kl_coef < 0:
            raise ConfigError("algo.kl_loss_coef and algo.kl_coef must be >= 0")
        if self.eps_clip_c is not None and self.eps_clip_c <= 1:
            raise ConfigError(f"algo.eps_clip_c must be > 1 (got {self.eps_clip_c}): it caps -A * ratio at -A * eps_clip_c")
        if not 0 < self.gamma <= 1 or not 0 <= self.lambd <= 1:
            raise ConfigError("algo.gamma must be in (0, 1] and algo.lambd in [0, 1]")
        if self.advantage_estimator == "reinforce_plus_plus_baseline" and self.gamma != 1:
            raise ConfigError("algo.advantage_estimator=reinforce_plus_plus_baseline broadcasts (reward - group mean)"
                              " to every token undiscounted (Miles' definition): algo.gamma must be 1 (for"
                              " discounted returns use reinforce_plus_plus)")
        if not 0 < self.icepop_low < 1 < self.icepop_high:
            raise ConfigError("algo.icepop_low must be in (0, 1) and algo.icepop_high > 1")

    @property
    def token_level(self) -> bool:
        return self.advantage_estimator in TOKEN_LEVEL_ESTIMATORS


@dataclass
class WeightsConfig:
    type: Literal["broadcast", "tensor"] = "broadcast"
    """How trainer rank 0 sends each version. broadcast: over a torch.distributed group with every engine
    (NCCL/RCCL on GPUs, InfiniBand across nodes; gloo on CPU). tensor: colocated engines on the same
    node take CUDA IPC handles (shared memory on CPU) of the exported buckets through
    /update_weights_from_tensor and copy straight from the trainer's memory (Miles/slime's colocated
    update): no group, no staging copy; the engine is paused while buckets land one by one."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend of the broadcast group: auto is nccl (RCCL on ROCm) when the trainer is on a GPU;
    gloo stages tensors through host memory (needed for a broadcast when trainer and engine share one GPU;
    type=tensor is the faster way there)."""
    bucket_size_mb: float = 512.0
    """Tensors are sent in buckets of about this size; one engine update request per bucket."""
    timeout_s: float = 300.0
    """A weight update that has not finished after this many seconds fails with an error (no hang)."""
    keep_host_copy: bool = True
    """Trainer rank 0 keeps the last weights it sent in host memory, to catch up a restarted engine
    without a collective (costs one model's size of CPU memory on that node)."""
    quantization: Literal["none", "fp8"] = "none"
    """fp8: send decoder-layer linear weights as blockwise FP8 (e4m3, 128x128 blocks, fp32 scales;
    SGLang's FP8 layout, half the bytes of bf16) to FP8 rollout engines. Rollouts then come from FP8
    weights while training stays in model.dtype: use TIS (algo.off_policy_correction=tis) and watch
    train/rollout_logprob_abs_diff."""

    tensor_format: Literal["flattened", "per_tensor"] = "flattened"
    """type=tensor: how a bucket's tensors are shared with the engines. flattened: one handle per bucket
    (SGLang's load_format "flattened_bucket": one flat uint8 tensor plus each tensor's name, dtype, shape
    and byte range); per_tensor: one handle per tensor (torch's CUDA IPC makes a handle, an event and a
    ref-counter entry for each: ~3,500 per version of a 128-expert MoE). SGLang engines get flattened
    only when the trainer can import SGLang (the payload names SGLang's metadata class), else
    per_tensor, said once in the log."""

    def __post_init__(self):
        _positive("weights", bucket_size_mb=self.bucket_size_mb, timeout_s=self.timeout_s)



EVAL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class EvalDatasetConfig:
    path: str = ""
    """JSONL file of held-out prompts, rows as in data.prompt_data (input_key and label_key below,
    data.metadata_key)."""
    rm_type: str | None = None
    """Reward function of this set (as rollout.rm_type); null: rollout.rm_type."""
    input_key: str | None = None
    """Field holding the prompt in this set's rows (as data.input_key); null: data.input_key."""
    label_key: str | None = None
    """Field holding the reference answer in this set's rows (as data.label_key); null: data.label_key."""

    def __post_init__(self):
        if not str(self.path).strip():
            raise ConfigError("path is required (name: path/to/test.jsonl, or name: {path: ..., rm_type: ...})")


@dataclass
class EvalConfig:
    interval: int = 0
    """Evaluate every this many steps on the engines' current weights, and also before the first step
    and after the last (Miles: --eval-interval); 0: no evaluation during the run (`lockstep eval` still
    evaluates eval.datasets on the result). Metrics go into the record of the step evaluated (the last
    step's record carries the final weights' evaluation)."""
    datasets: dict[str, str | EvalDatasetConfig] = field(default_factory=dict)
    """name -> JSONL path (or {path, rm_type, input_key, label_key}; null: rollout.rm_type, data.input_key,
    data.label_key) of held-out prompts (Miles: --eval-prompt-data NAME PATH ...). Metrics are
    eval/<name>/*, per-sample results run_dir/eval/step_K/<name>.jsonl."""
    n_samples_per_prompt: int = 1
    """Responses per eval prompt; pass@k is reported for k = 1, 2, 4, ... up to it (Miles:
    --n-samples-per-eval-prompt)."""
    temperature: float | None = None
    """Sampling temperature of eval responses; 0 is greedy (Miles: --eval-temperature). null:
    rollout.rollout_temperature."""
    top_p: float | None = None
    """Nucleus sampling threshold of eval responses (Miles: --eval-top-p); null: rollout.rollout_top_p."""
    max_response_len: int | None = None
    """Most new tokens per eval response (Miles: --eval-max-response-len); null:
    rollout.rollout_max_response_len, which it may not exceed (the engines' context is sized by it)."""
    max_prompts: int | None = None
    """Evaluate only the first this many prompts of each set (file order); null: all of them."""

    def __post_init__(self):
        if self.interval < 0:
            raise ConfigError(f"eval.interval must be >= 0 (got {self.interval}; 0 turns evaluation off)")
        _positive("eval", n_samples_per_prompt=self.n_samples_per_prompt, max_response_len=self.max_response_len,
                  max_prompts=self.max_prompts)
        if self.temperature is not None and self.temperature < 0:
            raise ConfigError(f"eval.temperature must be >= 0 (got {self.temperature}; 0 is greedy)")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"eval.top_p must be in (0, 1] (got {self.top_p})")
        for name, ds in list(self.datasets.items()):
            if not EVAL_NAME.match(name):
                raise ConfigError(f"eval.datasets: name {name!r} must be letters, digits, '_', '.' or '-' (it names"
                                  " metrics eval/<name>/* and the file eval/step_K/<name>.jsonl)")
            if name == "summary":
                raise ConfigError("eval.datasets: 'summary' is reserved (eval/step_K/summary.json): rename the set")
            self.datasets[name] = ds if isinstance(ds, EvalDatasetConfig) else EvalDatasetConfig(path=ds)
        if self.interval and not self.datasets:
            raise ConfigError(f"eval.interval={self.interval} but eval.datasets is empty: add one"
                              " (eval.datasets.test=path/to/test.jsonl) or set eval.interval=0")

    @property
    def enabled(self) -> bool:
        return self.interval > 0 and bool(self.datasets)

    def due(self, version: int, num_rollout: int) -> bool:
        """Whether the weights of `version` (after that many steps) are evaluated: every `interval` from
        version 0 (before any training) and the final one, num_rollout. Version num_rollout - 1 is left
        out: the final evaluation, a step later, takes its place in the last step's record."""
        if not self.enabled or not 0 <= version <= num_rollout:
            return False
        return version == num_rollout or (version % self.interval == 0 and version != num_rollout - 1)

    def version_in_record(self, step: int, num_rollout: int) -> int | None:
        """The weights version whose evaluation metrics.jsonl's record of `step` carries: `step` (the
        weights its rollouts came from in sync mode), the final version in the last record, or None.
        One record per step, so every consumer that counts steps stays right."""
        if step == num_rollout - 1 and self.due(num_rollout, num_rollout):
            return num_rollout
        return step if self.due(step, num_rollout) else None


@dataclass
class DeterminismConfig:
    true_on_policy: bool = False
    """Batch-invariant kernels in engine and trainer: engine and trainer logprobs equal bit for bit."""
    routing_replay: bool = False
    """R3: engines record each token's experts, the trainer's MoE routers replay them (MoE models only)."""
    record_routing: bool = True
    """MoE models: engines return routed experts even without R3, so the routing mismatch is measured."""
    kernel_backend: Literal["auto", "torch"] = "auto"
    """Kernels of the model code in built-in engines and trainers alike (lockstep_kernels): auto = the
    Triton kernels on GPUs (CUDA and ROCm) and the torch paths on CPUs; torch = the torch paths on GPUs
    too (slower: for a GPU where Triton is missing or suspect). Engine flag --kernel-backend."""


@dataclass
class BufferConfig:
    verify_checksums: bool = True
    """Check each shard's CRC-32 against its commit record before training on it."""
    on_corrupt: Literal["error", "skip"] = "error"
    """A corrupt or truncated shard: stop the run, or skip that part (logged and counted)."""
    keep_consumed: bool = True
    """Keep rollout steps on disk after training on them; false deletes them once a checkpoint is past
    them (a resumed or restarted trainer re-trains the steps since its checkpoint; the newest committed
    step always stays: it carries the rollout side's state)."""
    compression: Literal["gzip", "lzf", "none"] = "none"
    """HDF5 filter for token, mask and routing columns (shuffle + this). none writes at the filesystem's
    raw speed; gzip shrinks routing traces 5x (0.19 B/slot) at ~100 MB/s per core (BENCHMARKS.md)."""
    compression_level: int = 1
    """gzip level (1 is fast and already shrinks routing traces well)."""

    def __post_init__(self):
        if not 0 <= self.compression_level <= 9:
            raise ConfigError(f"buffer.compression_level must be in 0..9 (got {self.compression_level})")


@dataclass
class CheckpointConfig:
    save_interval: int = 0
    """Save a checkpoint every this many steps (0: only at the end) (Miles: --save-interval)."""
    keep_last: int = 2
    """Checkpoints kept on disk; older ones are deleted after a newer one is complete."""
    export_hf: bool = True
    """At the end, also write the final policy as a Hugging Face directory run_dir/hf/."""
    save_final: bool = True
    """Save a checkpoint when the run ends (false: only every save_interval steps, and on pre-emption;
    for short benchmark runs, whose final write of weights and optimizer states would dominate)."""
    export_quantization: Literal["none", "fp8"] = "none"
    """The run_dir/hf export's linear weights: none (model.dtype), or fp8: blockwise e4m3 with one fp32
    `weight_scale_inv` per 128 x 128 block and quantization_config quant_method fp8 (DeepSeek-V3's
    published layout, which model.path reads back and SGLang serves)."""

    def __post_init__(self):
        if self.save_interval < 0:
            raise ConfigError(f"checkpoint.save_interval must be >= 0 (got {self.save_interval})")
        _positive("checkpoint", keep_last=self.keep_last)


@dataclass
class WandbConfig:
    enabled: bool = False
    """Log every step's metrics (the keys of metrics.jsonl) and the resolved config to Weights & Biases
    (Miles: --use-wandb). Needs `pip install lockstep[tracking]`."""
    project: str = "lockstep"
    """W&B project (Miles: --wandb-project)."""
    group: str | None = None
    """W&B run group, e.g. one per sweep (Miles: --wandb-group)."""
    name: str | None = None
    """The run's display name; null: the run directory's name."""
    entity: str | None = None
    """W&B team or user (Miles: --wandb-team); null: the API key's default entity."""
    mode: Literal["offline", "online"] = "offline"
    """offline: write run_dir/wandb/ only, no network (upload later: `wandb sync run_dir/wandb/offline-run-*`);
    online: stream to the W&B server (WANDB_API_KEY or `wandb login` on the trainer's node)."""


@dataclass
class LoggingConfig:
    progress: bool = True
    """Show a progress bar on the terminal while the run goes."""
    plot: bool = True
    """Write run_dir/reward.png at the end."""
    tensorboard: bool = False
    """Also write every step's metrics as TensorBoard event files under run_dir/tensorboard/ (Miles:
    --use-tensorboard). Needs `pip install lockstep[tracking]`."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases."""
    miles_aliases: bool = True
    """TensorBoard and W&B also get Miles' names for the metrics Miles logs too
    (train/train_rollout_logprob_abs_diff beside train/rollout_logprob_abs_diff, ...: README table);
    metrics.jsonl keeps Lockstep's names only."""

    def __post_init__(self):
        # find_spec does not import: the check stays instant. A sink that is on needs its package.
        for on, option, package in ((self.tensorboard, "logging.tensorboard", "tensorboard"),
                                    (self.wandb.enabled, "logging.wandb.enabled", "wandb")):
            if on and importlib.util.find_spec(package) is None:
                raise ConfigError(f"{option}=true needs the {package} package, which is not installed:"
                                  " pip install lockstep[tracking] (or set it to false)")


@dataclass
class SlurmGroupConfig:
    nodes: int = 1
    """Nodes of this component."""
    gpus_per_node: int = 0
    """GPUs per node requested for this component (--gpus-per-node); 0 requests none."""
    tasks_per_node: int = 1
    """Processes per node (trainer: one per GPU; rollout: engines per node)."""
    cpus_per_task: int = 1
    """CPU cores per process (--cpus-per-task)."""
    partition: str | None = None
    """Slurm partition; null takes the cluster profile's default."""
    mem_gb: float | None = None
    """Memory per node in GB; null takes the partition default."""
    spare_nodes: int = 0
    """Extra nodes this component holds beyond `nodes` (the job asks for nodes + spare_nodes, with
    --no-kill): a step whose node went down, or failed twice, restarts on a spare inside the allocation
    instead of the job being requeued. hetjob and paired modes (Slurm 22.05 still requeues a whole
    heterogeneous job when one of its nodes goes down; a paired job keeps running)."""

    def __post_init__(self):
        _positive("slurm group", nodes=self.nodes, tasks_per_node=self.tasks_per_node, cpus_per_task=self.cpus_per_task)
        if self.gpus_per_node < 0 or self.spare_nodes < 0:
            raise ConfigError(f"gpus_per_node ({self.gpus_per_node}) and spare_nodes ({self.spare_nodes}) must be >= 0")


@dataclass
class SlurmConfig:
    mode: Literal["hetjob", "colocated", "paired"] = "hetjob"
    """hetjob: one job, a trainer and a rollout component; colocated: one component runs both;
    paired: two jobs (for sites without hetjobs) that find each other through the run directory."""
    cluster: str = "generic-nvidia"
    """Cluster profile from env/<name>.yaml (modules, NCCL/RCCL/IB variables, container)."""
    job_name: str = "lockstep"
    """Slurm job name."""
    time_min: int = 240
    """Wall-clock limit in minutes (--time)."""
    account: str | None = None
    """--account."""
    qos: str | None = None
    """--qos."""
    trainer: SlurmGroupConfig = field(default_factory=lambda: SlurmGroupConfig(gpus_per_node=8, tasks_per_node=8))
    """The trainer component (het group 0). nodes x tasks_per_node must equal train.num_gpus."""
    rollout: SlurmGroupConfig = field(default_factory=lambda: SlurmGroupConfig(gpus_per_node=8, tasks_per_node=1))
    """The rollout component (het group 1): engines (tasks_per_node per node) and the rollout manager."""
    signal_delay_s: int = 120
    """Slurm sends USR2 this long before the time limit (or at pre-emption): checkpoint and requeue."""
    max_requeues: int = 3
    """Requeues of the job before it is left failed: after pre-emption or the time limit (checkpoint,
    requeue), and after a failure the driver cannot recover inside the allocation (it requeues the job
    itself, excluding the node the failure happened on; a node failure is requeued by Slurm). The job
    runs at most 1 + max_requeues times."""
    max_restarts: int = 2
    """Inside one job attempt: restarts in place of the trainer step (all ranks, from the last
    checkpoint) and of the rollout manager, each; one more failure, or a second failure on the same
    node, requeues the job without that node. Engines restart in place under engine.max_restarts."""
    checkpoint_timeout_s: float = 300.0
    """How long a signalled job waits for the trainer's checkpoint before stopping the components."""
    submit_dir: str | None = None
    """submitit's job folder (pickles, batch logs); null: run_dir/slurm."""

    def __post_init__(self):
        _positive("slurm", time_min=self.time_min, signal_delay_s=self.signal_delay_s)
        if self.max_requeues < 0 or self.max_restarts < 0:
            raise ConfigError(f"slurm.max_requeues ({self.max_requeues}) and slurm.max_restarts ({self.max_restarts})"
                              " must be >= 0 (0: no requeue / no restart in place)")


@dataclass
class FaultsConfig:
    """Hang detection (used by the Slurm driver, which restarts or requeues what stopped beating)."""

    heartbeat_interval_s: float = 2.0
    """Every process rewrites run_dir/heartbeat/<component>.json this often."""
    heartbeat_timeout_s: float = 60.0
    """A process whose heartbeat is older than this is treated as dead (killed, then restarted in place
    or the job requeued). Collectives have their own timeout: train.dist_timeout_s."""

    def __post_init__(self):
        _positive("faults", heartbeat_interval_s=self.heartbeat_interval_s,
                  heartbeat_timeout_s=self.heartbeat_timeout_s)
        if self.heartbeat_timeout_s < 3 * self.heartbeat_interval_s:
            raise ConfigError(f"faults.heartbeat_timeout_s ({self.heartbeat_timeout_s}) < 3 x heartbeat_interval_s"
                              f" ({self.heartbeat_interval_s}): a slow file system would look like a hang;"
                              " raise the timeout or beat more often")


GROUP_ESTIMATORS = ("grpo", "gspo", "dr_grpo", "reinforce_plus_plus_baseline")
"""Advantage estimators whose baseline is the other responses to the same prompt."""


@dataclass
class RunConfig:
    run_dir: str = "runs/tiny"
    """The run directory on a shared filesystem: config, rendezvous, buffer, checkpoints, metrics."""
    num_rollout: int = 40
    """Rollout/train steps to run (Miles: --num-rollout)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = field(default_factory=DataConfig)
    """The prompt dataset."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling and rewards."""
    engine: EngineConfig = field(default_factory=LocalEngineConfig)
    """Rollout engines."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The trainer."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Advantages and losses."""
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    """Weight sync from trainer to engines."""
    determinism: DeterminismConfig = field(default_factory=DeterminismConfig)
    """Bitwise train/inference agreement."""
    buffer: BufferConfig = field(default_factory=BufferConfig)
    """The HDF5 rollout buffer."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and export."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Terminal output and plots."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation on held-out prompts between steps (and `lockstep eval`)."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """Submission to Slurm (`lockstep submit`); ignored by `lockstep run`."""
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    """Hang detection."""

    def __post_init__(self):
        if (bad := non_finite(self)) is not None:
            raise ConfigError(f"{bad}: every number must be finite (no nan or inf)")
        _positive("", num_rollout=self.num_rollout)
        r, t = self.rollout, self.train
        samples = self.samples_per_step
        if samples % t.global_batch_size:
            what = (f"rollout_batch_size ({samples}) rows per SFT step" if self.sft else
                    f"rollout_batch_size x n_samples_per_prompt ({r.rollout_batch_size} x {r.n_samples_per_prompt}"
                    f" = {samples})")
            raise ConfigError(f"{what} must be divisible by global_batch_size ({t.global_batch_size}):"
                              f" set train.global_batch_size to a divisor of {samples}")
        if self.sft:
            self.check_sft()
        if t.global_batch_size % t.num_gpus:
            raise ConfigError(
                f"train.global_batch_size ({t.global_batch_size}) must be divisible by train.num_gpus ({t.num_gpus})"
            )
        longest = self.data.max_prompt_len + r.rollout_max_response_len
        if t.max_tokens_per_gpu < longest:
            raise ConfigError(
                f"train.max_tokens_per_gpu ({t.max_tokens_per_gpu}) < data.max_prompt_len +"
                f" rollout.rollout_max_response_len ({longest}): raise it or shorten prompts/responses"
            )
        if self.weights.quantization == "fp8":
            if self.determinism.true_on_policy:
                raise ConfigError("weights.quantization=fp8 and determinism.true_on_policy exclude each other:"
                                  " FP8 rollouts differ from the trainer's logprobs by design (use TIS instead)")
            if self.engine.type == "sglang" and self.engine.quantization != "fp8":
                raise ConfigError("weights.quantization=fp8 sends FP8 weights: start the SGLang engines as FP8"
                                  " engines too (engine.quantization=fp8)")
        if self.checkpoint.export_quantization == "fp8" and t.int4_qat:
            raise ConfigError("checkpoint.export_quantization=fp8 and train.int4_qat exclude each other: the INT4 QAT"
                              " export is packed W4A16; set checkpoint.export_quantization=none")
        if t.compile and self.determinism.true_on_policy:
            raise ConfigError("train.compile and determinism.true_on_policy exclude each other: compiled (fused)"
                              " kernels round differently from the engine's batch-invariant ones")
        if t.compile and t.backend != "fsdp":
            raise ConfigError("train.compile compiles the FSDP2 backend's decoder layers: set train.backend=fsdp")
        if self.engine.quantization == "fp8" and self.determinism.true_on_policy:
            raise ConfigError("engine.quantization=fp8 and determinism.true_on_policy exclude each other: an FP8"
                              " engine computes other numbers than the trainer by design (use TIS instead)")
        if t.backend == "megatron":
            refuse = {
                "model.mtp_num_layers": self.model.mtp_num_layers > 0,
                "determinism.true_on_policy with tensor parallelism (row-parallel layers sum partial products"
                " across ranks, in an order the engine does not)":
                    self.determinism.true_on_policy and t.tensor_model_parallel_size > 1,
            }
            bad = [k for k, v in refuse.items() if v]
            if bad:
                raise ConfigError(f"train.backend=megatron does not support {', '.join(bad)} yet: use train.backend=fsdp")
        if self.engine.speculative_algorithm and not self.model.mtp_num_layers:
            raise ConfigError(f"engine.speculative_algorithm={self.engine.speculative_algorithm} drafts with an"
                              " MTP head: set model.mtp_num_layers=1")
        if r.n_samples_per_prompt < 2 and self.algo.advantage_estimator in GROUP_ESTIMATORS and not self.sft:
            raise ConfigError(
                f"algo.advantage_estimator={self.algo.advantage_estimator} compares each response with the others"
                f" of its prompt, and rollout.n_samples_per_prompt=1 leaves none (every advantage 0): sample"
                " several responses per prompt (e.g. 8), or use ppo / reinforce_plus_plus")
        e = self.eval
        if e.max_response_len is not None and e.max_response_len > r.rollout_max_response_len:
            raise ConfigError(f"eval.max_response_len ({e.max_response_len}) > rollout.rollout_max_response_len"
                              f" ({r.rollout_max_response_len}): the engines' context is sized by the latter; raise it"
                              " or shorten eval responses")
        if self.determinism.true_on_policy and r.mode != "sync":
            raise ConfigError(f"determinism.true_on_policy needs rollout.mode=sync (got {r.mode!r}): {r.mode} trains on"
                              " rollouts of older weights, whose logprobs cannot equal the trainer's; use"
                              " algo.off_policy_correction (TIS) for asynchronous runs")
        if self.engine.colocated and r.mode != "sync":
            raise ConfigError(f"engine.colocated needs rollout.mode=sync (got {r.mode!r}): colocated engines"
                              " give their memory to the trainer, so they cannot generate while it trains")

    def check_sft(self) -> None:
        """algo.loss_type=sft_loss: settings that would make the supervised loss something else."""
        if self.rollout.rollout_temperature != 1.0:
            raise ConfigError(f"algo.loss_type=sft_loss trains the model's own distribution, but the trainer scores"
                              f" at rollout.rollout_temperature ({self.rollout.rollout_temperature}): set it to 1.0")
        if self.algo.kl_loss_coef or self.algo.entropy_coef or self.model.mtp_num_layers or self.algo.advantage_estimator == "ppo":
            raise ConfigError("algo.loss_type=sft_loss has no KL, entropy, MTP or critic terms: set algo.kl_loss_coef=0,"
                              " algo.entropy_coef=0, model.mtp_num_layers=0 and an advantage_estimator other than ppo")
        if self.determinism.routing_replay:
            raise ConfigError("algo.loss_type=sft_loss has no engine routing to replay: set determinism.routing_replay=false")
        if self.eval.interval:
            raise ConfigError("algo.loss_type=sft_loss runs no engines to evaluate on: set eval.interval=0 and evaluate"
                              " the result with `lockstep eval RUN_DIR --dataset NAME=PATH`")

    @property
    def sft(self) -> bool:
        """Supervised fine-tuning (algo.loss_type=sft_loss): trainers only, data straight from the file."""
        return self.algo.loss_type == "sft_loss"

    @property
    def off_policy_correction(self) -> str:
        c = self.algo.off_policy_correction
        return ("none" if self.rollout.mode == "sync" else "tis") if c == "auto" else c

    @property
    def staleness(self) -> int:
        """How many weight versions behind the trainer a rollout step may be generated."""
        r = self.rollout
        return {"sync": 0, "one_step_off": 1, "fully_async": r.max_weight_staleness}[r.mode]

    @property
    def samples_per_step(self) -> int:
        """Samples one step trains on: a group per prompt (RL), one row each (SFT)."""
        if self.sft:
            return self.rollout.rollout_batch_size
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt

    @property
    def optimizer_steps_per_rollout(self) -> int:
        return self.samples_per_step // self.train.global_batch_size
