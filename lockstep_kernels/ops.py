"""The ops the model calls. Each picks: default torch op, or (in batch-invariant mode) the Triton
kernel on GPUs / the batch-invariant torch path on CPUs. See lockstep_kernels/__init__.py."""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lockstep_kernels import torch_ref
from lockstep_kernels.dispatch import use_triton
from lockstep_kernels.mode import is_batch_invariant as _bi

_FEW_QUERIES = 16
_SDPA_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
GREEDY_EPS = 1e-5
"""A temperature below this means greedy decoding: such rows are scored (and sampled) at temperature 1."""


def scaled_logits(logits_MV: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """fp32 logits divided by the temperature (temperature ~0 means greedy: scored at 1)."""
    logits = logits_MV.float()
    if isinstance(temperature, torch.Tensor):
        t = torch.where(temperature < GREEDY_EPS, torch.ones_like(temperature), temperature).float()
        return logits / t[:, None]
    return logits / (temperature if temperature >= GREEDY_EPS else 1.0)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not _bi():
        return F.linear(x, weight, bias)
    if use_triton(x):
        from lockstep_kernels.gpu.matmul import bi_linear

        return bi_linear(x, weight, bias)
    return torch_ref.linear(x, weight, bias)


def grouped_linear(x_AK: torch.Tensor, w_ENK: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """Per-expert linear over rows grouped by expert: out[offsets[e]:offsets[e+1]] =
    linear(x[offsets[e]:offsets[e+1]], w[e]), [A, N] (no bias; offsets_E1 int32, offsets[E] = A).

    On GPUs in both modes one Triton launch for every expert (gpu/grouped_matmul.py), its expert rows
    bitwise what `linear` gives them in batch-invariant mode; the offsets stay on the device (no host
    sync, CUDA-graph capturable). Elsewhere the reference: `linear` per expert, the offsets read to the
    host. Forward only (the engine's MoE decode); training runs the per-expert loop."""
    if use_triton(x_AK):
        from lockstep_kernels.gpu.grouped_matmul import bi_grouped_linear

        return bi_grouped_linear(x_AK, w_ENK, offsets_E1)
    bounds = offsets_E1.tolist()
    out = [linear(x_AK[lo:hi], w_NK) for lo, hi, w_NK in zip(bounds, bounds[1:], w_ENK)]
    return torch.cat(out) if out else x_AK.new_empty(0, w_ENK.shape[1])


def silu(x: torch.Tensor) -> torch.Tensor:
    if not _bi() or x.is_cuda:  # elementwise on GPUs: every element runs the same instructions
        return F.silu(x)
    return torch_ref.silu(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """Elementwise sigmoid (DeepSeek-V3's router scores); 1 / (1 + exp(-x)) on CPUs in batch-invariant mode."""
    if not _bi() or x.is_cuda:
        return torch.sigmoid(x)
    return torch_ref.sigmoid(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The engine (inference mode) on GPUs takes the fused kernel in default mode too (one launch instead
    # of eight); the trainer, scoring passes included, keeps the torch formula unless batch-invariant
    # mode asks for the kernel, so its no-grad and training forwards round alike.
    fused_inference = torch.is_inference_mode_enabled() and weight.dtype == x.dtype
    if (_bi() or fused_inference) and use_triton(x):
        from lockstep_kernels.gpu.rms_norm import bi_rms_norm

        return bi_rms_norm(x, weight, eps)
    return torch_ref.rms_norm(x, weight, eps)  # row reductions over the last dim: invariant on CPU


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dim."""
    if not _bi():
        return torch.log_softmax(x.float(), dim=-1)
    if use_triton(x):
        from lockstep_kernels.gpu.log_softmax import bi_log_softmax

        return bi_log_softmax(x)
    return torch_ref.log_softmax(x)


def token_logprobs(logits_MV: torch.Tensor, tokens_M: torch.Tensor, temperature) -> torch.Tensor:
    """log softmax(logits / T)[token] per row, fp32. On GPUs always the fused Triton kernel (never
    materialises the [rows, vocab] fp32 log-softmax; batch-invariant too); elsewhere log-softmax + gather."""
    if use_triton(logits_MV):
        from lockstep_kernels.gpu.log_softmax import bi_token_logprob

        return bi_token_logprob(logits_MV, tokens_M, temperature)
    logp_MV = log_softmax(scaled_logits(logits_MV, temperature))
    return logp_MV.gather(-1, tokens_M[:, None].long()).squeeze(-1)


# The batch-invariant decode kernel: tests/triton_checks.py bi_decode showed its bits equal to the attention
# kernel's and to the trainer's packed path on an H100 (2026-12-05; it cannot be shown on the CPU interpreter:
# see that check), and a 1.7b true on-policy run kept logprob diff 0 with it. False falls back to `attention`.
BI_DECODE = True


def decode_attention(q_BHD: torch.Tensor, k_SGTD: torch.Tensor, v_SGTD: torch.Tensor, lens_B: torch.Tensor) -> torch.Tensor:
    """One query per sequence: q[b] attends to keys 0..lens[b]-1 of cache slot b (slots 0..B-1 of the
    [S, G, T, D] cache, S >= B, any T). Returns [B, H, D]. Key lengths stay on the device (no host sync,
    same launches for every step: CUDA-graph safe). Default mode on GPUs: the split-key Triton decode
    kernel. Batch-invariant mode: the bits of `attention` for the query at position lens[b] - 1 (which
    do not depend on T): on GPUs the decode kernel in its batch-invariant form (one program per KV head
    and sequence, gpu/decode_attention.py), else `attention` itself."""
    b = q_BHD.shape[0]
    k_BGTD, v_BGTD = k_SGTD[:b], v_SGTD[:b]
    qpos_B1 = (lens_B - 1)[:, None]
    if use_triton(q_BHD):
        from lockstep_kernels.gpu.attention import KERNEL_DIMS, QUERY_ROWS
        from lockstep_kernels.gpu.decode_attention import bi_decode_attention, decode_attention_fwd

        if not _bi():
            return decode_attention_fwd(q_BHD, k_BGTD, v_BGTD, lens_B)
        d, g = q_BHD.shape[-1], k_BGTD.shape[1]
        if (BI_DECODE and d in KERNEL_DIMS and k_BGTD.shape[-1] == v_BGTD.shape[-1] == d
                and q_BHD.shape[1] // g <= QUERY_ROWS):
            return bi_decode_attention(q_BHD, k_BGTD, v_BGTD, lens_B)
    return attention(q_BHD[:, :, None], k_BGTD, v_BGTD, qpos_B1)[:, :, 0]


def softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dim."""
    if not _bi():
        return torch.softmax(x, dim=-1, dtype=torch.float)
    return torch.exp(log_softmax(x))


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row. Batch-invariant mode breaks ties by the lower index
    (a stable sort), so equal router scores pick the same experts whatever the batch."""
    if not _bi():
        return torch.topk(x, k, dim=-1).indices
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def packed_causal_attention(q_NHD, k_NGD, v_NGD, cu_seqlens_B1: torch.Tensor, max_len: int) -> torch.Tensor | None:
    """Causal GQA attention over sequences packed back to back (sequence b is rows cu_seqlens[b]:
    cu_seqlens[b+1]), [N, H, D], by flash attention's varlen kernel: no padded grid, no mask, no
    scatter/gather. None where that kernel does not apply (CPU, fp32, batch-invariant mode, a torch
    without torch.nn.attention.varlen): the caller then takes the padded-grid path (which it may also
    choose itself: pipeline.models.attention.PackedCausal(varlen=False), for benchmarks)."""
    if (_bi() or not q_NHD.is_cuda or q_NHD.dtype not in (torch.float16, torch.bfloat16)
            or _varlen() is None):
        return None
    fn, params = _varlen()
    h, g = q_NHD.shape[1], k_NGD.shape[1]
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if h != g:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # older torch: give every query head its key/value head
            k_NGD, v_NGD = k_NGD.repeat_interleave(h // g, 1), v_NGD.repeat_interleave(h // g, 1)
    return fn(q_NHD, k_NGD, v_NGD, cu_seqlens_B1, cu_seqlens_B1, max_len, max_len, **kwargs)


@functools.cache
def _varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def attention(q_BHQD, k_BGTD, v_BGTD, qpos_BQ, scale: float | None = None) -> torch.Tensor:
    """Causal GQA attention: query (b, i) attends to keys 0..qpos_BQ[b, i]. Returns [B, H, Q, Dv].
    scale: the softmax scale (None: 1/sqrt(D)); v's head dim Dv may differ from q's and k's D (MLA)."""
    if not _bi():
        h, g, t = q_BHQD.shape[1], k_BGTD.shape[1], k_BGTD.shape[2]
        mask_BQT = torch.arange(t, device=qpos_BQ.device)[None, None, :] <= qpos_BQ[:, :, None]
        # Decode and verify steps: not cuDNN, which builds an execution plan per new shape (~2 ms of CPU
        # per call) and decode meets a new key length every step (57% of a 113 ms decode step,
        # bench/profile_decode.py). Long queries (training, prefill) keep it: there it is the fastest
        # (excluding it everywhere took a 0.5B training step from 236 to 632 ms).
        few = q_BHQD.is_cuda and q_BHQD.shape[2] <= _FEW_QUERIES
        with sdpa_kernel(_SDPA_NO_CUDNN) if few else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q_BHQD, k_BGTD, v_BGTD, attn_mask=mask_BQT[:, None], enable_gqa=h != g,
                                                  scale=scale)
    if use_triton(q_BHQD):
        from lockstep_kernels.gpu.attention import bi_attention

        return bi_attention(q_BHQD, k_BGTD, v_BGTD, qpos_BQ, scale)
    return torch_ref.attention(q_BHQD, k_BGTD, v_BGTD, qpos_BQ, scale)
