"""Pipeline parallelism for the megatron backend: activations between stages, inside autograd.

A micro-batch's forward runs stage by stage: stage s receives the hidden states of stage s-1, runs its
layers and sends the result on; the last stage computes the per-token logprobs (and entropies) and
broadcasts them to the stages before it, so every rank of a pipeline holds the same loss inputs and
the trainer loop (pipeline/trainer/loop.py) runs unchanged on all of them. Backward retraces the
chain: the last stage's loss reaches its input, whose gradient goes to stage s-1, and so on.

Both hand-overs are autograd Functions: `from_previous` (forward: receive; backward: send the input's
gradient back) and `to_next` (forward: send, then take the last stage's outputs; backward: receive the
gradient of what was sent). Each rank's own copy of the loss only decides which outputs need a
gradient; the gradient that flows is the last stage's. Micro-batches go through one at a time (no
1F1B interleaving): the stages split the model's memory, not its time.

Sends are asynchronous (kept until `flush`), receives block. A model has its own pipeline groups
(`Links(ps, own_groups=True)`: PPO's critic), so when one backward carries two models' hand-overs
the stages may run them in different orders: each group pairs its own messages, and no send waits.

Legend: T padded length (over TP ranks under sequence parallelism), B sequences, D hidden, M scored.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HEADER = 6  # dtype code, ndim, up to 4 dims


_pending: list[tuple] = []  # (work, tensor) of sends not yet known complete


def send_tensor(t: torch.Tensor, dst: int, group) -> None:
    """Send `t` (any shape up to 4-D, float) to global rank `dst` in `group`, header first; returns at once."""
    header = torch.zeros(_HEADER, dtype=torch.int64, device=t.device)
    header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
    header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    t = t.contiguous()
    for x in (header, t):
        _pending.append((dist.isend(x, dst, group=group), x))


def flush() -> None:
    """Wait for every send so far (their buffers may then be freed)."""
    while _pending:
        work, _ = _pending.pop(0)
        work.wait()


def recv_tensor(src: int, device: torch.device, group) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    code, ndim, *dims = header.tolist()
    out = torch.empty(dims[:ndim], dtype=_DTYPES[code], device=device)
    dist.recv(out, src, group=group)
    return out


class Links:
    """This rank's neighbours in its pipeline: global ranks of the previous, next and last stage."""

    def __init__(self, ps, own_groups: bool = False):
        self.stage, self.size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
        self.group = ps.get_pipeline_model_parallel_group()
        self.ranks = dist.get_process_group_ranks(self.group)  # by stage
        if own_groups and self.size > 1:  # collective: every pipeline's ranks, in one order on all ranks
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, self.ranks)
            for ranks in sorted({tuple(r) for r in every}):
                group = dist.new_group(list(ranks))
                if list(ranks) == self.ranks:
                    self.group = group
        self.first, self.last = self.stage == 0, self.stage == self.size - 1
        self.prev = None if self.first else self.ranks[self.stage - 1]
        self.next = None if self.last else self.ranks[self.stage + 1]
        self.last_rank = self.ranks[-1]


class _FromPrevious(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: torch.Tensor, src: int, group) -> torch.Tensor:
        ctx.src, ctx.group = src, group
        return recv_tensor(src, anchor.device, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_tensor(grad, ctx.src, ctx.group)
        return None, None, None


class _ToNext(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, links: Links, shapes: tuple) -> tuple[torch.Tensor, ...]:
        ctx.links = links
        send_tensor(hidden, links.next, links.group)
        return tuple(broadcast_from_last(None, shape, hidden.device, links) for shape in shapes)

    @staticmethod
    def backward(ctx, *grads):
        return recv_tensor(ctx.links.next, grads[0].device, ctx.links.group), None, None


def from_previous(links: Links, device: torch.device) -> torch.Tensor:
    """The previous stage's output, as this stage's differentiable input."""
    anchor = torch.empty(0, device=device, requires_grad=torch.is_grad_enabled())
    return _FromPrevious.apply(anchor, links.prev, links.group)


def to_next(hidden: torch.Tensor, links: Links, shapes: tuple) -> tuple[torch.Tensor, ...]:
    """Send this stage's output on; return the last stage's outputs (fp32, of `shapes`), through which
    the gradient of `hidden` arrives from the next stage in backward."""
    return _ToNext.apply(hidden, links, shapes)


def broadcast_from_last(t: torch.Tensor | None, shape, device: torch.device, links: Links) -> torch.Tensor:
    """The last stage's fp32 tensor `t` on every stage of the pipeline (others pass None)."""
    buf = t.detach().float().contiguous() if links.last else torch.empty(shape, dtype=torch.float32, device=device)
    dist.broadcast(buf, links.last_rank, group=links.group)
    return buf
