"""The request bodies Lockstep sends to SGLang-protocol engines, built in one place.

Every body here is checked against SGLang's own request types by the contract tests
(tests/test_sglang_contract.py: field names against `sglang.srt.managers.io_struct`, sampling
parameters through `sglang.srt.sampling.sampling_params.SamplingParams`), so a field renamed in a
new SGLang release fails a test instead of being silently ignored by the server.

`EXTENSIONS` names the fields Lockstep adds for the built-in engine; SGLang's endpoints drop unknown
fields (FastAPI body models), so they cost nothing there.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


# Lockstep-only fields, per endpoint (read by the built-in engine, ignored by SGLang).
EXTENSIONS: dict[str, frozenset[str]] = {
    "/init_weights_update_group": frozenset({"timeout_s"}),
}


class MemoryTag(StrEnum):
    """What /release_memory_occupation and /resume_memory_occupation act on (SGLang's tag names)."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"


class MemoryAction(StrEnum):
    """The two memory calls of colocated engines (/<action>_memory_occupation)."""

    RELEASE = "release"
    RESUME = "resume"


def version_to_wire(version: int) -> str:
    """A weight version as SGLang's protocol carries it (a string); Lockstep's versions are ints."""
    return str(int(version))


def version_from_wire(value) -> int | None:
    """A weight version as an engine reported it (SGLang: a string; the built-in engine too, as SGLang),
    or None when it reported none."""
    if value in (None, "", "None"):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"weight version {value!r} is not an integer: Lockstep numbers versions 0, 1, 2, ... "
                         "(it starts SGLang engines with --weight-version 0)") from None


def sampling_params(*, max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed: int) -> dict:
    """One sample's parameters. The response is kept exactly as generated (no stop-string trimming,
    special tokens kept), so the tokens trained on are the tokens sampled (TITO)."""
    return {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "sampling_seed": seed, "no_stop_trim": True, "skip_special_tokens": False}


def generate_body(input_ids: list[list[int]] | list[int], params: list[dict] | dict, *, return_logprob: bool = True,
                  return_routed_experts: bool = False, rid: list[str] | str | None = None) -> dict:
    """A batch (lists of prompts, parameters and ids) or one prompt (as sglang-router requires)."""
    body: dict = {"input_ids": input_ids, "sampling_params": params, "return_logprob": return_logprob}
    if return_routed_experts:
        body["return_routed_experts"] = True
    if rid is not None:
        body["rid"] = rid
    return body


def abort_body(rid: str | None = None) -> dict:
    return {"rid": rid or "", "abort_all": rid is None}


def init_group_body(*, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
                    backend: str, timeout_s: float) -> dict:
    return {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend, "timeout_s": timeout_s}


class WeightSelector(StrEnum):
    """Which model runners a weight-update session covers (SGLang's `selector`: the target model, the
    speculative draft model, or both)."""

    TARGET = "target"
    DRAFT = "draft"
    ALL = "all"


# SGLang's answers (scheduler_components/weight_updater.py) when the session protocol is broken; the
# built-in engine gives the same ones. Since SGLang 0.5.2x /update_weights_from_tensor and
# /update_weights_from_distributed run only inside a session: POST /begin_weight_update before a
# version's first bucket, /end_weight_update after its last (/update_weights_from_disk needs none).
SESSION_REQUIRED = "{endpoint} must run between begin_weight_update() and end_weight_update()"
SESSION_ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
SESSION_NOT_OPEN = "no weight-update session is open; call begin_weight_update() first"


def begin_weight_update_body(selector: WeightSelector = WeightSelector.ALL) -> dict:
    """/begin_weight_update: open the session the next version's buckets run in."""
    return {"selector": WeightSelector(selector).value}


def end_weight_update_body() -> dict:
    """/end_weight_update: close the open session (SGLang runs post_load_weights if nothing was loaded)."""
    return {}


def update_distributed_body(bucket: Sequence[tuple[str, torch.Tensor]], group_name: str,
                            version: int | None) -> dict:
    """Metadata of one broadcast bucket; the bucket that carries `weight_version` is the last one, the
    engine applies the staged update with it (and flushes its prefix cache)."""
    body = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket], "group_name": group_name, "flush_cache": version is not None}
    if version is not None:
        body["weight_version"] = version_to_wire(version)
    return body


def update_disk_body(model_path: str, version: int | None = None) -> dict:
    body = {"model_path": model_path, "flush_cache": True}
    if version is not None:
        body["weight_version"] = version_to_wire(version)
    return body


def serialize_named_tensors(named) -> str:
    """SGLang's MultiprocessingSerializer format: torch's ForkingPickler (CUDA tensors travel as IPC
    handles, CPU tensors as named shared memory), base64-encoded. `named`: a list of (name, tensor)
    pairs, or a flattened bucket's dict (tensor_bucket.py). The receiving process must run on the same
    node, and the tensors must stay alive until it has answered."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    # CPU tensors: shared memory by file name. The default (file descriptors) passes fds through
    # multiprocessing's resource sharer, which only a child of this process may connect to.
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        buf = io.BytesIO()
        if isinstance(named, dict):
            ForkingPickler(buf).dump(named)
        else:
            ForkingPickler(buf).dump([(name, t.detach()) for name, t in named])
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def update_tensor_body(named: Sequence[tuple[str, torch.Tensor]], tp_size: int = 1, version: int | None = None,
                       flush_cache: bool = True) -> dict:
    """/update_weights_from_tensor (colocated engines), one handle per tensor: one serialized payload
    per TP rank of the engine (here every rank gets the full tensors; the engine's loader shards them)."""
    return _tensor_body(serialize_named_tensors(named), None, tp_size, version, flush_cache)


def update_flattened_bucket_body(flat: torch.Tensor, metadata: Sequence, tp_size: int = 1,
                                 version: int | None = None, flush_cache: bool = True) -> dict:
    """/update_weights_from_tensor with SGLang's `load_format: "flattened_bucket"`: one handle for the
    whole bucket (`flat`, uint8) and its tensors' metadata (tensor_bucket.flatten). `flat` must stay
    alive until every engine has answered."""
    from pipeline.rollout import tensor_bucket

    payload = serialize_named_tensors({"flattened_tensor": flat, "metadata": list(metadata)})
    return _tensor_body(payload, tensor_bucket.LOAD_FORMAT, tp_size, version, flush_cache)


def _tensor_body(payload: str, load_format: str | None, tp_size: int, version: int | None, flush_cache: bool) -> dict:
    body = {"serialized_named_tensors": [payload] * tp_size, "flush_cache": flush_cache}
    if load_format is not None:
        body["load_format"] = load_format
    if version is not None:
        body["weight_version"] = version_to_wire(version)
    return body


def memory_body(tags: Sequence[MemoryTag] | None = None) -> dict:
    """/release_memory_occupation and /resume_memory_occupation: tags (None: all)."""
    return {"tags": [MemoryTag(t).value for t in tags] if tags is not None else None}


def memory_tags(body: dict) -> list[MemoryTag] | None:
    """The tags of a memory request as the engine reads them (ValueError naming an unknown one)."""
    tags = body.get("tags")
    if tags is None:
        return None
    unknown = [t for t in tags if t not in set(MemoryTag)]
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}: use {', '.join(t.value for t in MemoryTag)}")
    return [MemoryTag(t) for t in tags]
