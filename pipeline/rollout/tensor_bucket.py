"""SGLang's "flattened_bucket" form of a colocated weight update: one flat uint8 tensor per bucket plus
each tensor's name, shape, dtype and byte range in it.

Sharing a tensor with another process (torch's CUDA IPC or shared-memory reduction) costs per tensor
pickled: an IPC handle, an interprocess event and a ref-counter entry on GPUs, even when every tensor
of a bucket is a view of one storage. A bucket of 384 expert projections then pays it 384 times; the
flattened form pays it once. The payload is the dict SGLang's /update_weights_from_tensor reads with
`load_format: "flattened_bucket"` (sglang/srt/weight_sync/tensor_bucket.py,
model_runner_components/weight_updater.py): `{"flattened_tensor": <uint8 [nbytes]>, "metadata": [...]}`,
the entries instances of a dataclass with SGLang's fields (name, shape, dtype, start_idx, end_idx,
numel; indices and numel in bytes). Pickle names the entries' class, so a payload for SGLang must use
SGLang's own class (`sglang_metadata_class`); the built-in engine reads either that one or Lockstep's
twin below (pipeline/weights/receiver.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

LOAD_FORMAT = "flattened_bucket"


@dataclass
class FlattenedTensorMetadata:
    """One tensor of a flattened bucket (SGLang's FlattenedTensorMetadata, field for field)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    """First byte of the tensor in the flat tensor (a multiple of the dtype's size)."""
    end_idx: int
    """One past its last byte."""
    numel: int
    """Its bytes: end_idx - start_idx (SGLang's name: the numel of its uint8 view)."""


def sglang_metadata_class() -> type | None:
    """SGLang's own FlattenedTensorMetadata when this process can import it, else None."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata as SglangMetadata
    except ImportError:
        return None
    return SglangMetadata


def _one_span(tensors: Sequence[torch.Tensor]) -> bool:
    """True if the tensors are contiguous and lie back to back in one storage, in this order."""
    end = None
    for t in tensors:
        if not t.is_contiguous():
            return False
        start = t.storage_offset() * t.element_size()
        if end is not None and (t.untyped_storage().data_ptr() != tensors[0].untyped_storage().data_ptr()
                                or start != end):
            return False
        end = start + t.numel() * t.element_size()
    return True


def flatten(named: Sequence[tuple[str, torch.Tensor]], metadata_cls: type = FlattenedTensorMetadata
            ) -> tuple[torch.Tensor, list]:
    """(flat uint8 tensor, metadata) of a bucket. Tensors that lie back to back in one storage (a weight
    sync's exported bucket, pipeline/trainer/fsdp.full_state) give a view of that storage: no copy.
    Any others are copied into a new buffer, each starting at a multiple of its dtype's size (SGLang
    rebuilds a tensor with `flat[start:end].view(dtype)`, which needs that)."""
    if not named:
        raise ValueError("cannot flatten an empty bucket")
    tensors = [t.detach() for _, t in named]
    if _one_span(tensors):
        first = tensors[0]
        base = torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage())
        start = first.storage_offset() * first.element_size()
        offsets = [t.storage_offset() * t.element_size() - start for t in tensors]
        nbytes = offsets[-1] + tensors[-1].numel() * tensors[-1].element_size()
        flat = base[start: start + nbytes]
    else:
        offsets, nbytes = [], 0
        for t in tensors:
            nbytes += -nbytes % t.element_size()
            offsets.append(nbytes)
            nbytes += t.numel() * t.element_size()
        flat = torch.empty(nbytes, dtype=torch.uint8, device=tensors[0].device)
        for t, offset in zip(tensors, offsets):
            flat[offset: offset + t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
    metadata = [metadata_cls(name=name, shape=t.shape, dtype=t.dtype, start_idx=offset,
                             end_idx=offset + t.numel() * t.element_size(), numel=t.numel() * t.element_size())
                for (name, _), t, offset in zip(named, tensors, offsets)]
    return flat, metadata


def reconstruct(flat: torch.Tensor, metadata: Sequence) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a flattened bucket, as views of `flat` (no copy). ValueError naming the
    first entry that does not fit (a malformed payload changes no weights)."""
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"flattened_tensor must be a 1-D uint8 tensor, got {getattr(flat, 'dtype', type(flat))}")
    out = []
    for m in metadata:
        if not isinstance(m.dtype, torch.dtype):
            raise ValueError(f"{m.name}: dtype {m.dtype!r} is not a torch dtype")
        shape = torch.Size(m.shape)
        size = shape.numel() * m.dtype.itemsize
        if not (0 <= m.start_idx and m.end_idx - m.start_idx == size and m.end_idx <= flat.numel()
                and m.start_idx % m.dtype.itemsize == 0):
            raise ValueError(f"{m.name}: bytes [{m.start_idx}, {m.end_idx}) do not hold {m.dtype} {list(shape)} "
                             f"inside a flat tensor of {flat.numel()} bytes")
        out.append((m.name, flat[m.start_idx: m.end_idx].view(m.dtype).view(shape)))
    return out
