"""Stand-alone torch.distributed process groups for weight updates (outside the trainer's world).

Trainer rank 0 is rank 0 of the group, engine i takes ranks rank_offset..rank_offset+tp-1 (SGLang's
scheme). The group has its own TCPStore and its own timeout, so a vanished peer raises an error
instead of hanging a collective forever.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def create_group(master_address: str, master_port: int, rank: int, world_size: int, backend: str,
                 timeout_s: float):
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout,
                          wait_for_workers=False)
    store = dist.PrefixStore("lockstep-weights", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    else:
        raise ValueError(f"weight-update backend {backend!r}: use gloo or nccl")
    return pg


def broadcast(pg, tensor: torch.Tensor, src: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    pg.broadcast([tensor], opts).wait()


def backend_for(device: torch.device) -> str:
    # NCCL's name covers RCCL too: on ROCm builds torch maps "nccl" to RCCL.
    return "nccl" if device.type == "cuda" else "gloo"
