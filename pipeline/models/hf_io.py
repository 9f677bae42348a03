"""Hugging Face checkpoint directories: config.json + safetensors (single file or sharded index).

`load_model` builds our decoder (any family pipeline/models/hf_config.py reads) from a real HF
directory; `save_model` writes one that transformers (and SGLang's loader) read back. Writes are atomic: a temp directory renamed into place.
Blockwise FP8 checkpoints (DeepSeek-V3's published layout: e4m3 `weight` + fp32 `weight_scale_inv` per
128 x 128 block) are dequantised on reading (W = q x scale_inv, what training starts from); an FP8
engine (load_model(quantization="fp8")) keeps the checkpoint's pairs as they are.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch

from pipeline.errors import UserError
from pipeline.models.config import ModelArgs
from pipeline.models.fp8 import SCALE_SUFFIX
from pipeline.utils.fs import atomic_dir
from pipeline.models.hf_config import read_model_args, write_hf_config  # noqa: F401 (read_model_args: kept importable here)
from pipeline.models.hf_files import IGNORED_SUFFIXES, INDEX_NAME, SINGLE_NAME, head_differs, tied_head_error, weight_files  # noqa: F401

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")


def read_state_dict(model_dir: str, dequantize: bool = True) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by HF name; FP8 (weight, weight_scale_inv) pairs dequantised to fp32
    unless `dequantize` is false."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for name in weight_files(model_dir):
        try:
            state.update(load_file(os.path.join(model_dir, name)))
        except Exception as e:
            raise UserError(f"{os.path.join(model_dir, name)!r}: its tensors cannot be read (truncated?): {e}") from None
    state = {k: v for k, v in state.items() if not k.endswith(IGNORED_SUFFIXES)}
    if any(k.endswith(".weight_packed") for k in state):  # a W4A16 (compressed-tensors) checkpoint
        from pipeline.models.qat import dense_from_w4a16

        state = dense_from_w4a16(state)
    return _dequantized(state) if dequantize else state


def _dequantized(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FP8 (weight, weight_scale_inv) pairs replaced by their fp32 weights (W = q x scale_inv per block)."""
    if not any(k.endswith(SCALE_SUFFIX) for k in state):
        return state
    from pipeline.weights.quant import dequantize_fp8_pairs

    return dequantize_fp8_pairs(state, {})


MTP_PREFIX = "mtp."
MTP_INIT_SEED = 0  # a draft head added to a checkpoint without one starts the same in every process


def load_model(model_dir: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               mtp_layers: int | None = None, quantization: str | None = None):
    """Build the model from an HF directory. Returns (args, model).

    mtp_layers: None builds what config.json says; 0 drops a checkpoint's MTP draft head; 1 keeps it,
    or adds a freshly initialised one (seeded, so trainer and engines start equal) when it has none.
    quantization: "fp8" gives the projections blockwise FP8 weights (pipeline/models/fp8.py), the
    checkpoint's own where it has them."""
    from pipeline.models.fp8 import checkpoint_pairs
    from pipeline.models.qwen3 import Qwen3ForCausalLM

    args = read_model_args(model_dir)
    state = read_state_dict(model_dir, dequantize=False)
    pairs = checkpoint_pairs(state) if quantization == "fp8" else {}
    state = _dequantized(state)
    if args.is_mla:
        from pipeline.models.deepseek import nextn_to_mtp

        state, args = nextn_to_mtp(state, args, mtp_layers)
    fresh_mtp = False
    if mtp_layers is not None and mtp_layers != args.mtp_num_hidden_layers:
        fresh_mtp = mtp_layers > 0
        args = dataclasses.replace(args, mtp_num_hidden_layers=mtp_layers)
    if not args.mtp_num_hidden_layers or fresh_mtp:
        state = {k: v for k, v in state.items() if not k.startswith(MTP_PREFIX)}
    with torch.device("meta"):
        model = Qwen3ForCausalLM(args)
    # Cast on the meta device (free), then allocate: no full-model transient in the build dtype (the
    # engine's caching allocator kept such a copy reserved: +15 GiB for a bf16 4B engine on the H200).
    model = model.to(dtype).to_empty(device=device)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if fresh_mtp:
        model.init_weights(MTP_INIT_SEED, prefix=MTP_PREFIX)
    load_state(model, state, source=model_dir, allow_missing=MTP_PREFIX if fresh_mtp else None)
    if quantization == "fp8":
        from pipeline.models.fp8 import keep_pairs, to_fp8

        to_fp8(model)
        keep_pairs(model, pairs)
    elif quantization is not None:
        raise ValueError(f"quantization {quantization!r}: load_model knows fp8 only")
    return args, model


def load_state(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str = "checkpoint",
               allow_missing: str | None = None) -> None:
    """Copy an HF-named state dict into the model; refuse missing (except under the prefix
    `allow_missing`) or unexpected names."""
    expected = set(model.state_dict().keys())
    if allow_missing:
        expected = {k for k in expected if not k.startswith(allow_missing)}
    if model.args.tie_word_embeddings:
        check_tied(state.get("model.embed_tokens.weight"), state.get("lm_head.weight"), source)
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        expected.discard("lm_head.weight")
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing or unexpected:
        raise UserError(
            f"{source}: weights do not match the architecture in config.json "
            f"(missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''})"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in state.items():
            target = params[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise UserError(f"{source}: {name} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}")
            # A device target converts on the device (non_blocking copies cast there; blocking ones cast
            # on the host first: an fp32 4B model took ~10 s to load that way).
            target.copy_(tensor, non_blocking=target.device.type != "cpu")
    if any(p.device.type == "cuda" for p in params.values()):
        torch.cuda.synchronize()


def check_tied(embedding: torch.Tensor | None, lm_head: torch.Tensor | None, source: str) -> None:
    """config.json ties the LM head to the embedding: a saved lm_head.weight must then be the embedding
    (transformers keeps a different one untied; Lockstep would drop it and train another model)."""
    if head_differs(embedding, lm_head):
        raise tied_head_error(source)


def save_model(
    state: dict[str, torch.Tensor],
    args: ModelArgs,
    out_dir: str,
    tokenizer_dir: str | None = None,
    max_shard_bytes: int = 4 << 30,
    dtype: torch.dtype | None = None,
    quantization_config: dict | None = None,
) -> None:
    """Write an HF checkpoint directory (sharded above max_shard_bytes), atomically."""
    from safetensors.torch import save_file

    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    if args.is_mla:  # the MTP head as DeepSeek's nextn layer
        from pipeline.models.deepseek import mtp_to_nextn

        state = mtp_to_nextn(state, args)
    if dtype is not None:  # FP8 weights and their fp32 scales stay as they are
        state = {k: v.to(dtype) if v.is_floating_point() and v.itemsize > 1 and not k.endswith(SCALE_SUFFIX) else v
                 for k, v in state.items()}
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    with atomic_dir(out_dir) as tmp:
        hf_cfg = write_hf_config(args)
        if dtype is not None:
            hf_cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        if quantization_config is not None:
            hf_cfg["quantization_config"] = quantization_config
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_cfg, f, indent=2)
        if len(shards) == 1:
            save_file(shards[0], os.path.join(tmp, SINGLE_NAME), metadata={"format": "pt"})
        else:
            weight_map = {}
            total = 0
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
                for name, t in shard.items():
                    weight_map[name] = fname
                    total += t.numel() * t.element_size()
            with open(os.path.join(tmp, INDEX_NAME), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        gen = {"bos_token_id": args.bos_token_id, "eos_token_id": args.eos_token_id, "pad_token_id": args.pad_token_id}
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(gen, f, indent=2)
        if tokenizer_dir:
            for name in TOKENIZER_FILES:
                src = os.path.join(tokenizer_dir, name)
                if os.path.exists(src) and name != "generation_config.json":
                    shutil.copy(src, os.path.join(tmp, name))
