"""Stand-alone torch.distributed process groups for weight updates (outside the trainer's world).

Trainer rank 0 is rank 0 of the group, engine i takes ranks rank_offset..rank_offset+tp-1 (SGLang's
scheme). The group has its own TCPStore and its own timeout, so a vanished peer raises an error
instead of hanging a collective forever.
"""

from __future__ import annotations

import datetime
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, wait

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
                      joins: list[Future]):
    """Rank 0's side of a new group while the other ranks' join requests (`joins`, which raise when a
    peer cannot join) are in flight. Returns the group once it is up and every join succeeded; raises the
    first failed join's error as soon as it fails: a peer that died before joining (an engine restarted
    on a new address, its old one refusing connections) is an error at once, not a wait of `timeout_s`
    for a rank that will never come. The rendezvous runs in a daemon thread (an executor's would hold
    the process's exit until it times out); abandoned, it times out on its own."""
    made: Future = Future()

    def make() -> None:
        try:
            made.set_result(create_group(master_address, master_port, 0, world_size, backend, timeout_s))
        except BaseException as e:  # noqa: BLE001 (raised in the caller's thread)
            made.set_exception(e)

    threading.Thread(target=make, name="weights-group", daemon=True).start()
    wait([made, *joins], return_when=FIRST_EXCEPTION)
    for f in (*joins, made):  # a peer's own error says more than the rendezvous's
        if f.done() and f.exception() is not None:
            raise f.exception()
    return made.result()


def broadcast(pg, tensor: torch.Tensor, src: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    pg.broadcast([tensor], opts).wait()


def backend_for(device: torch.device) -> str:
    # NCCL's name covers RCCL too: on ROCm builds torch maps "nccl" to RCCL.
    return "nccl" if device.type == "cuda" else "gloo"
