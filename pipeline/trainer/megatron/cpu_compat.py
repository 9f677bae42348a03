"""Run megatron-core on CPU processes (gloo): a small shim, for tests and CPU-only development.

megatron-core calls CUDA unconditionally in a few places on the path we use (device placement of
RoPE tables and buffers, the model-parallel RNG tracker, streams). On a machine without CUDA,
`install()` points those at the CPU. It is never installed when CUDA is available: the GPU path runs
megatron-core as shipped.
"""

from __future__ import annotations

import contextlib

import torch

_installed = False


def install() -> None:
    global _installed
    if _installed or torch.cuda.is_available():
        return
    _installed = True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.get_rng_state = lambda device=None: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_stream = lambda device=None: _NoStream()
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.cuda.Stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.Event = lambda *args, **kwargs: _NoStream()
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    # Under pipeline parallelism GPTModel copies the tied embedding to the last stage through `.cuda()`;
    # the backend loads both copies from the checkpoint anyway.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule._is_in_embd_group = lambda self: False


class _NoStream:
    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or _NoStream()  # an "event" that is always complete
