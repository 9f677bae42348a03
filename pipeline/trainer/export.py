"""What the policy's weights become on their way out: the stream a weight sync sends the engines, and
the Hugging Face directory written at the end. Each transform is one named step over the (HF name,
tensor) stream of TrainerBackend.full_state."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from pipeline.config.schema import RunConfig
from pipeline.models.config import ModelArgs
from pipeline.trainer.optim import int4_scale_dtype

State = Iterable[tuple[str, torch.Tensor]]


def engine_stream(state: State, cfg: RunConfig, args: ModelArgs) -> State:
    """The weights an engine loads, in order: the INT4 values the trainer computed with (train.int4_qat),
    no MTP head for SGLang's target model, FP8 pairs for FP8 engines (weights.quantization=fp8)."""
    if cfg.train.int4_qat:
        state = int4_qat_values(state, cfg)
    if cfg.engine.type == "sglang" and args.mtp_num_hidden_layers:
        state = without_mtp(state)
    if cfg.weights.quantization == "fp8":
        state = fp8(state)
    return state


def int4_qat_values(state: State, cfg: RunConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Expert projections replaced by their INT4 values (q * scale): what the QAT forward used."""
    from pipeline.models.qat import int4_values

    return int4_values(state, cfg.train.int4_group_size, int4_scale_dtype(cfg))


def without_mtp(state: State) -> Iterator[tuple[str, torch.Tensor]]:
    """SGLang's target model skips mtp.* names; its draft worker keeps the checkpoint's head."""
    return ((k, v) for k, v in state if not k.startswith("mtp."))


def fp8(state: State) -> Iterator[tuple[str, torch.Tensor]]:
    """Decoder-layer linear weights as blockwise FP8 with their scales (pipeline/weights/quant.py)."""
    from pipeline.weights.quant import fp8_stream

    return fp8_stream(state)


def save_hf(state: dict[str, torch.Tensor], cfg: RunConfig, args: ModelArgs, out_dir: str, tokenizer_dir: str) -> None:
    """The final policy as a Hugging Face directory; with train.int4_qat, packed W4A16 (compressed-tensors
    pack-quantized: the checkpoint an INT4 rollout engine serves); with checkpoint.export_quantization=fp8,
    DeepSeek-V3's blockwise FP8 layout (e4m3 weights with 128x128 weight_scale_inv)."""
    from pipeline.models.hf_io import save_model
    from pipeline.models.qat import w4a16_state

    qcfg = None
    if cfg.train.int4_qat:
        state, qcfg = w4a16_state(state, cfg.train.int4_group_size, int4_scale_dtype(cfg))
    elif cfg.checkpoint.export_quantization == "fp8":
        from pipeline.models.fp8 import block_fp8_state
        from pipeline.models.hf_config import BLOCK_FP8_CONFIG

        state, qcfg = block_fp8_state(state), dict(BLOCK_FP8_CONFIG)
    save_model(state, args, out_dir, tokenizer_dir=tokenizer_dir, quantization_config=qcfg)
