"""Stand-alone torch.distributed process groups for weight updates (outside the trainer's world).

Trainer rank 0 is rank 0 of the group, engine i takes ranks rank_offset..rank_offset+tp-1 (SGLang's
scheme). The group has its own TCPStore and its own timeout, so a vanished peer raises an error
instead of hanging a collective forever.
"""

from __future__ import annotations

import datetime
import threading
from concurrent.futures import Future

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


def create_root_group(master_address: str, master_port: int, world_size: int, backend: str, timeout_s: float,
                      joins: list[Future], poll_s: float = 0.1):
    """Rank 0's side of a new group while the other ranks' join requests (`joins`, which raise when a
    peer cannot join) are in flight. Returns the group once it is up and every join succeeded; raises the
    first failed join's error as soon as it fails: a peer that died before joining (an engine restarted
    on a new address, its old one refusing connections) is an error within a poll, not a wait of
    `timeout_s` for a rank that will never come. The abandoned rendezvous thread times out on its own."""
    box: dict = {}

    def make() -> None:
        try:
            box["pg"] = create_group(master_address, master_port, 0, world_size, backend, timeout_s)
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            box["error"] = e

    maker = threading.Thread(target=make, name="weights-group", daemon=True)
    maker.start()
    while maker.is_alive():
        maker.join(poll_s)
        for f in joins:
            if f.done() and f.exception() is not None:
                raise f.exception()
    if "error" in box:
        raise box["error"]
    for f in joins:
        f.result()
    return box["pg"]


def broadcast(pg, tensor: torch.Tensor, src: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    pg.broadcast([tensor], opts).wait()


def backend_for(device: torch.device) -> str:
    # NCCL's name covers RCCL too: on ROCm builds torch maps "nccl" to RCCL.
    return "nccl" if device.type == "cuda" else "gloo"
